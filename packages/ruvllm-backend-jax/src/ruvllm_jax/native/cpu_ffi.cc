// ruvllm CPU kernels for XLA:CPU, called from jitted steps through the XLA FFI: the handlers (operand
// checks, the activations quantized into cpu_acts.h's buffers, the split of attention and LoRA over
// the pool). The kernels are in cpu_kernels_variant.cc, compiled once per ISA variant into the same
// library; which variant runs is cpu_isa.cc's choice, the thread pool and the split of the quantized
// products cpu_pool.cc's.
// This file is built at install (setup.py) for the baseline ISA of the target architecture.
//
// ruvllm_w8a8: y_i = x @ W_i.T for a group of int8 weight matrices W_i that share one input x
// (q/k/v, or gate/up). x [M, K] float32 is multiplied by the group's per-input-channel smoothing
// factors, quantized to int8 once per row (scale = row max / 127, round half to even, clip +-127),
// and multiplied in int32 against each W_i (int8, one float32 scale per output channel). The weights
// may be stacked over layers ([L, N, K]); the layer operand picks one without copying it.
//
// ruvllm_wxa8 / ruvllm_wxa8_panel: weights in groups of 32 along the input (GGUF Q4_0 / Q4_1 / Q8_0
// blocks), activations quantized to int8 per group of 32 (llama.cpp's Q8_1 scheme); see
// cpu_kernels.h for the arithmetic. ruvllm_paged_decode: attention of one token per sequence over
// the paged cache (float32, float16 or bfloat16), read in place, from a first key per sequence
// (sliding windows) with the model's score scale (attribute "scale"). ruvllm_mean_square: each row's
// mean of squares in a fixed order (RMSNorm's, batch invariant).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "cpu_acts.h"
#include "cpu_isa.h"
#include "cpu_kernels.h"
#include "cpu_pool.h"

namespace ffi = xla::ffi;
using ruvllm::DecodeJob;
using ruvllm::LoraJob;
using ruvllm::PrefillJob;
using ruvllm::GroupActsBuf;
using ruvllm::GroupMatrix;
using ruvllm::KernelTable;
using ruvllm::RowActsBuf;
using ruvllm::RowMatrix;
using ruvllm::kernels;
using ruvllm::kHelperRows;
using ruvllm::Pool;
using ruvllm::run_group_split;
using ruvllm::run_split;

namespace {

// Rows, stacked layers and code width of a grouped matrix's codes [L?, N, bytes] for K inputs
// (bytes per row: 4-bit K / 2, 5-bit 5 K / 8, 6-bit 3 K / 4, 8-bit K), with the layer index checked.
struct CodeLayout {
  int64_t N = 0, L = 0, row_bytes = 0;
  int bits = 0;
};

ffi::Error code_layout(const ffi::AnyBuffer& q, int64_t K, int64_t layer, const std::string& who, CodeLayout& c) {
  const auto qd = q.dimensions();
  if (qd.size() < 2) return ffi::Error::InvalidArgument(who + ": codes must be [.., out, bytes]");
  c.N = qd[qd.size() - 2];
  c.row_bytes = qd.back();
  if (c.row_bytes == K / 2) c.bits = 4;
  else if (c.row_bytes == K / 8 * 5) c.bits = 5;
  else if (c.row_bytes == K / 4 * 3) c.bits = 6;
  else if (c.row_bytes == K) c.bits = 8;
  else return ffi::Error::InvalidArgument(who + ": code bytes per row are not K / 2, 5 K / 8, 3 K / 4 or K");
  c.L = c.N * c.row_bytes == 0 ? 0 : static_cast<int64_t>(q.element_count()) / (c.N * c.row_bytes);
  if (layer < 0 || layer >= c.L) return ffi::Error::InvalidArgument(who + ": layer index out of range");
  return ffi::Error::Success();
}

// A k-quant's factors (cpu_kernels.h, KMatrix) for `stacked` matrices of N rows and K inputs: D, and Dm
// unless symmetric, float16 per super-block; sc, and mn unless symmetric, int8 per 16 or per 32
// inputs. The form follows from the sizes (b and mn empty: symmetric). Returns what is wrong, or
// nullptr with the matrix `m`'s factors in `out` (its q, y, N and bits left to the caller).
const char* kquant_factors(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& sc,
                           const ffi::AnyBuffer& mn, int64_t stacked, int64_t N, int64_t K, int64_t m,
                           ruvllm::KMatrix& out) {
  if (K % 256 != 0) return "k-quants need a multiple of 256 inputs";
  const int64_t SB = K / 256, subs = static_cast<int64_t>(sc.element_count());
  const bool symmetric = b.element_count() == 0 && mn.element_count() == 0;
  const int sub = subs == stacked * N * (K / 16) ? 16 : subs == stacked * N * (K / 32) ? 32 : 0;
  if (sub == 0 || static_cast<int64_t>(a.element_count()) != stacked * N * SB ||
      (!symmetric && (static_cast<int64_t>(b.element_count()) != stacked * N * SB ||
                      static_cast<int64_t>(mn.element_count()) != subs)))
    return "k-quant factors have the wrong sizes";
  const int64_t per = N * (K / sub);
  out.D = reinterpret_cast<const uint16_t*>(a.untyped_data()) + m * N * SB;
  out.Dm = symmetric ? nullptr : reinterpret_cast<const uint16_t*>(b.untyped_data()) + m * N * SB;
  out.sc = reinterpret_cast<const int8_t*>(sc.untyped_data()) + m * per;
  out.mn = symmetric ? nullptr : reinterpret_cast<const int8_t*>(mn.untyped_data()) + m * per;
  out.sub = sub;
  return nullptr;
}

// Rows of x that carry tokens: the layer operand is [layer] or [layer, live rows]. A step's padding
// rows come after its live ones; they get zeros instead of products, so padding a step to its
// compiled shape costs no arithmetic.
int64_t live_rows(ffi::Buffer<ffi::S32> layer, int64_t M) {
  if (layer.element_count() < 2) return M;
  return std::max<int64_t>(0, std::min<int64_t>(M, layer.typed_data()[1]));
}

void zero_rows(float* y, int64_t live, int64_t M, int64_t N) {
  if (live < M) std::memset(y + live * N, 0, static_cast<size_t>((M - live) * N) * sizeof(float));
}

ffi::Error WxA8Common(bool panel, ffi::ThreadPool& xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                      ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("ruvllm_wxa8: x must be [rows, features]");
  const int64_t M = xd[0], K = xd[1];
  if (K % 32 != 0) return ffi::Error::InvalidArgument("ruvllm_wxa8: input features must be a multiple of 32");
  const int64_t G = K / 32;
  const int64_t l = layer.typed_data()[0];
  if (weights.size() != 3 * outs.size() || outs.size() == 0)
    return ffi::Error::InvalidArgument("ruvllm_wxa8: expected (codes, scale, offset) triples, one per output");
  std::vector<GroupMatrix> mats;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto q = weights.get<ffi::AnyBuffer>(3 * i);
    auto d = weights.get<ffi::AnyBuffer>(3 * i + 1);
    auto mn = weights.get<ffi::AnyBuffer>(3 * i + 2);
    auto y = outs.get<ffi::AnyBuffer>(i);
    if (!q.has_value() || !d.has_value() || !mn.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("ruvllm_wxa8: bad operand");
    if (q->element_type() != ffi::DataType::U8 || d->element_type() != ffi::DataType::F16 ||
        mn->element_type() != ffi::DataType::F16 || (*y)->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("ruvllm_wxa8: codes must be uint8 with float16 scales and offsets");
    CodeLayout c;
    if (ffi::Error e = code_layout(*q, K, l, "ruvllm_wxa8", c); e.failure()) return e;
    const int64_t N = c.N, L = c.L, row_bytes = c.row_bytes;
    const int bits = c.bits;
    // An empty offset operand: a symmetric format (cpu_kernels.h, GroupMatrix).
    const bool symmetric = mn->element_count() == 0;
    if (static_cast<int64_t>(d->element_count()) != L * N * G ||
        (!symmetric && static_cast<int64_t>(mn->element_count()) != L * N * G))
      return ffi::Error::InvalidArgument("ruvllm_wxa8: one scale (and offset) per group of 32 expected");
    if (static_cast<int64_t>((*y)->element_count()) != M * N)
      return ffi::Error::InvalidArgument("ruvllm_wxa8: output shape mismatch");
    if (panel && N % 16 != 0)
      return ffi::Error::InvalidArgument("ruvllm_wxa8: the panel layout needs a multiple of 16 output rows");
    mats.push_back(GroupMatrix{q->typed_data<uint8_t>() + l * N * row_bytes,
                               reinterpret_cast<const uint16_t*>(d->untyped_data()) + l * N * G,
                               symmetric ? nullptr : reinterpret_cast<const uint16_t*>(mn->untyped_data()) + l * N * G,
                               (*y)->typed_data<float>(), N, bits, panel});
  }
  const int64_t live = live_rows(layer, M);
  for (const auto& m : mats) zero_rows(m.y, live, M, m.N);
  if (live == 0) return ffi::Error::Success();
  thread_local GroupActsBuf acts;
  bool row_major_4bit = false;
  for (const auto& m : mats) row_major_4bit |= !m.panel && m.bits == 4;
  acts.quantize(x.typed_data(), live, K, row_major_4bit);
  run_group_split(acts.view(), &xla_pool, mats);
  return ffi::Error::Success();
}

ffi::Error WxA8Impl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                    ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  return WxA8Common(false, xla_pool, x, layer, weights, outs);
}

ffi::Error WxA8PanelImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                         ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  return WxA8Common(true, xla_pool, x, layer, weights, outs);
}

// ruvllm_kxa8_panel: like ruvllm_wxa8_panel, with operand 5-tuples (codes, a, b, sc, mn) per output:
// a k-quant matrix (cpu_kernels.h, KMatrix: D, Dm float16, sc and mn int8) or, with sc and mn
// empty, a plain group-quantized one (d, m float16), so a group sharing an input may mix both.
ffi::Error KxA8PanelImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                         ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("ruvllm_kxa8: x must be [rows, features]");
  const int64_t M = xd[0], K = xd[1];
  if (K % 32 != 0) return ffi::Error::InvalidArgument("ruvllm_kxa8: input features must be a multiple of 32");
  const int64_t G = K / 32;
  const int64_t l = layer.typed_data()[0];
  if (weights.size() != 5 * outs.size() || outs.size() == 0)
    return ffi::Error::InvalidArgument("ruvllm_kxa8: expected (codes, a, b, sc, mn) 5-tuples, one per output");
  std::vector<GroupMatrix> mats;
  std::vector<ruvllm::KMatrix> kmats;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto q = weights.get<ffi::AnyBuffer>(5 * i);
    auto a = weights.get<ffi::AnyBuffer>(5 * i + 1);
    auto b = weights.get<ffi::AnyBuffer>(5 * i + 2);
    auto sc = weights.get<ffi::AnyBuffer>(5 * i + 3);
    auto mn = weights.get<ffi::AnyBuffer>(5 * i + 4);
    auto y = outs.get<ffi::AnyBuffer>(i);
    if (!q.has_value() || !a.has_value() || !b.has_value() || !sc.has_value() || !mn.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("ruvllm_kxa8: bad operand");
    if (q->element_type() != ffi::DataType::U8 || a->element_type() != ffi::DataType::F16 ||
        b->element_type() != ffi::DataType::F16 || sc->element_type() != ffi::DataType::S8 ||
        mn->element_type() != ffi::DataType::S8 || (*y)->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("ruvllm_kxa8: expected uint8 codes, float16 factors, int8 sc and mn");
    CodeLayout c;
    if (ffi::Error e = code_layout(*q, K, l, "ruvllm_kxa8", c); e.failure()) return e;
    const int64_t N = c.N, L = c.L, row_bytes = c.row_bytes;
    const int bits = c.bits;
    if (N % 16 != 0) return ffi::Error::InvalidArgument("ruvllm_kxa8: the panel layout needs a multiple of 16 rows");
    if (static_cast<int64_t>((*y)->element_count()) != M * N)
      return ffi::Error::InvalidArgument("ruvllm_kxa8: output shape mismatch");
    const uint8_t* codes = q->typed_data<uint8_t>() + l * N * row_bytes;
    const uint16_t* ap = reinterpret_cast<const uint16_t*>(a->untyped_data());
    const uint16_t* bp = reinterpret_cast<const uint16_t*>(b->untyped_data());
    if (sc->element_count() == 0) {  // a plain group matrix; b empty: symmetric
      const bool symmetric = b->element_count() == 0;
      if (static_cast<int64_t>(a->element_count()) != L * N * G ||
          (!symmetric && static_cast<int64_t>(b->element_count()) != L * N * G))
        return ffi::Error::InvalidArgument("ruvllm_kxa8: one scale (and offset) per group of 32 expected");
      mats.push_back(GroupMatrix{codes, ap + l * N * G, symmetric ? nullptr : bp + l * N * G,
                                 (*y)->typed_data<float>(), N, bits, true});
      continue;
    }
    ruvllm::KMatrix k{};
    if (const char* bad = kquant_factors(*a, *b, *sc, *mn, L, N, K, l, k))
      return ffi::Error::InvalidArgument(std::string("ruvllm_kxa8: ") + bad);
    k.q = codes;
    k.y = (*y)->typed_data<float>();
    k.N = N;
    k.bits = bits;
    kmats.push_back(k);
  }
  const int64_t live = live_rows(layer, M);
  for (const auto& m : mats) zero_rows(m.y, live, M, m.N);
  for (const auto& m : kmats) zero_rows(m.y, live, M, m.N);
  if (live == 0) return ffi::Error::Success();
  thread_local GroupActsBuf acts;
  acts.quantize(x.typed_data(), live, K, false);
  run_group_split(acts.view(), &xla_pool, mats, kmats);
  return ffi::Error::Success();
}

// A grouped-experts call's rows: x [R, K] and, per expert, a count of consecutive rows (sorted by
// expert, as ruvllm.modeling.moe_mlp builds them); layer [1] picks the layer of the stacked experts.
struct ExpertGroups {
  int64_t R = 0, K = 0, E = 0, l = 0;
  std::vector<int64_t> first;  // expert e's rows are first[e] .. first[e + 1] - 1
};

// Reads and checks the operands every grouped-experts handler shares; an error names the handler.
ffi::Error read_expert_groups(const std::string& who, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S32>& layer,
                              ffi::Buffer<ffi::S32>& sizes, ExpertGroups* g) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument(who + ": x must be [rows, features]");
  g->R = xd[0];
  g->K = xd[1];
  g->E = static_cast<int64_t>(sizes.element_count());
  if (g->E == 0) return ffi::Error::InvalidArgument(who + ": no experts");
  g->l = layer.typed_data()[0];
  const int32_t* sz = sizes.typed_data();
  g->first.assign(g->E + 1, 0);
  for (int64_t e = 0; e < g->E; ++e) {
    if (sz[e] < 0) return ffi::Error::InvalidArgument(who + ": a negative group size");
    g->first[e + 1] = g->first[e] + sz[e];
  }
  if (g->first[g->E] > g->R)
    return ffi::Error::InvalidArgument(who + ": group sizes add up to more rows than x has");
  return ffi::Error::Success();
}

// ruvllm_experts: the grouped products of a mixture of experts. x [R, K] holds a step's (token, expert)
// rows sorted by expert and sizes [E] how many rows each expert has (rows past their sum are padding
// and get zeros). Each weight is a 5-tuple as ruvllm_kxa8_panel's (k-quant, or plain with sc and mn
// empty), its matrices stacked [L, E, N, ...]; the layer operand is [l]. Expert e's rows are multiplied
// by matrix l * E + e only: a step reads the panels of the experts it routed rows to, whatever E is.
// x is quantized once for all the weights, per row as the dense products do, so a row's result does
// not depend on the other rows of the step.
ffi::Error ExpertsImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> sizes, ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const std::string who = "ruvllm_experts";
  ExpertGroups groups;
  if (auto err = read_expert_groups(who, x, layer, sizes, &groups); err.failure()) return err;
  const int64_t R = groups.R, K = groups.K, E = groups.E, l = groups.l;
  const std::vector<int64_t>& first = groups.first;
  if (K % 32 != 0) return ffi::Error::InvalidArgument(who + ": input features must be a multiple of 32");
  const int64_t G = K / 32;
  if (weights.size() != 5 * outs.size() || outs.size() == 0)
    return ffi::Error::InvalidArgument(who + ": expected (codes, a, b, sc, mn) 5-tuples, one per output");
  // Per weight, its E matrices of layer l (reserved up front: items below point into them).
  std::vector<GroupMatrix> mats;
  std::vector<ruvllm::KMatrix> kmats;
  mats.reserve(outs.size() * E);
  kmats.reserve(outs.size() * E);
  std::vector<std::pair<float*, int64_t>> ys;  // each output and its row length
  std::vector<bool> is_k;                       // each output's weight is a k-quant
  for (size_t i = 0; i < outs.size(); ++i) {
    auto q = weights.get<ffi::AnyBuffer>(5 * i);
    auto a = weights.get<ffi::AnyBuffer>(5 * i + 1);
    auto b = weights.get<ffi::AnyBuffer>(5 * i + 2);
    auto sc = weights.get<ffi::AnyBuffer>(5 * i + 3);
    auto mn = weights.get<ffi::AnyBuffer>(5 * i + 4);
    auto y = outs.get<ffi::AnyBuffer>(i);
    if (!q.has_value() || !a.has_value() || !b.has_value() || !sc.has_value() || !mn.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument(who + ": bad operand");
    if (q->element_type() != ffi::DataType::U8 || a->element_type() != ffi::DataType::F16 ||
        b->element_type() != ffi::DataType::F16 || sc->element_type() != ffi::DataType::S8 ||
        mn->element_type() != ffi::DataType::S8 || (*y)->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument(who + ": expected uint8 codes, float16 factors, int8 sc and mn");
    CodeLayout c;
    if (ffi::Error e = code_layout(*q, K, 0, who, c); e.failure()) return e;
    const int64_t N = c.N, row_bytes = c.row_bytes, stacked = c.L;  // stacked: L * E matrices
    if (stacked % E != 0 || l < 0 || l >= stacked / E)
      return ffi::Error::InvalidArgument(who + ": the codes are not [layers, experts, ...] or the layer is out of range");
    if (N % 16 != 0) return ffi::Error::InvalidArgument(who + ": the panel layout needs a multiple of 16 rows");
    if (static_cast<int64_t>((*y)->element_count()) != R * N)
      return ffi::Error::InvalidArgument(who + ": output shape mismatch");
    float* yp = (*y)->typed_data<float>();
    ys.emplace_back(yp, N);
    const uint8_t* codes = q->typed_data<uint8_t>();
    const uint16_t* ap = reinterpret_cast<const uint16_t*>(a->untyped_data());
    const uint16_t* bp = reinterpret_cast<const uint16_t*>(b->untyped_data());
    const bool kquant = sc->element_count() != 0;
    is_k.push_back(kquant);
    if (!kquant) {  // plain group matrices; b empty: symmetric
      const bool symmetric = b->element_count() == 0;
      if (static_cast<int64_t>(a->element_count()) != stacked * N * G ||
          (!symmetric && static_cast<int64_t>(b->element_count()) != stacked * N * G))
        return ffi::Error::InvalidArgument(who + ": one scale (and offset) per group of 32 expected");
    } else {
      ruvllm::KMatrix k{};
      if (const char* bad = kquant_factors(*a, *b, *sc, *mn, stacked, N, K, 0, k))
        return ffi::Error::InvalidArgument(who + ": " + bad);
    }
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = l * E + e;  // the matrix index in the stack; only experts with rows are read
      float* ye = yp + first[e] * N;
      if (!kquant) {
        const bool symmetric = b->element_count() == 0;
        mats.push_back(GroupMatrix{codes + m * N * row_bytes, ap + m * N * G, symmetric ? nullptr : bp + m * N * G,
                                   ye, N, c.bits, true});
      } else {
        ruvllm::KMatrix k{};
        kquant_factors(*a, *b, *sc, *mn, stacked, N, K, m, k);  // checked above
        k.q = codes + m * N * row_bytes;
        k.y = ye;
        k.N = N;
        k.bits = c.bits;
        kmats.push_back(k);
      }
    }
  }
  const int64_t live = first[E];
  for (const auto& [yp, N] : ys) zero_rows(yp, live, R, N);
  if (live == 0) return ffi::Error::Success();
  thread_local GroupActsBuf acts;
  acts.quantize(x.typed_data(), live, K, false);
  const ruvllm::GroupActs all = acts.view();
  std::vector<ruvllm::ExpertPanels> items;
  size_t gi = 0, ki = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    const bool kquant = is_k[i];
    for (int64_t e = 0; e < E; ++e) {
      const GroupMatrix* g = kquant ? nullptr : &mats[gi++];
      const ruvllm::KMatrix* k = kquant ? &kmats[ki++] : nullptr;
      const int64_t r0 = first[e], rows = first[e + 1] - first[e];
      if (rows == 0) continue;
      ruvllm::GroupActs xe = all;  // the expert's rows: the same buffers from row r0 on
      xe.q = all.q + r0 * K;
      xe.dx = all.dx + r0 * all.Gp;
      xe.sx = all.sx + r0 * all.Gp;
      xe.isum = all.isum + r0 * all.Gp;
      xe.isum16 = all.isum16 + r0 * 2 * all.Gp;
      xe.sx16 = all.sx16 + r0 * 2 * all.Gp;
      xe.M = rows;
      items.push_back(ruvllm::ExpertPanels{xe, g, k, ys[i].second / 16});
    }
  }
  ruvllm::run_expert_split(items, live, &xla_pool);
  return ffi::Error::Success();
}

// ruvllm_experts_w8a8: ruvllm_experts for w8a8 experts, (int8 [L, E, N, K], float32 scale [L, E, N(, 1)])
// pairs; x quantized once per row as ruvllm_w8a8 does (no smoothing factors).
ffi::Error ExpertsW8A8Impl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> sizes, ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const std::string who = "ruvllm_experts_w8a8";
  ExpertGroups groups;
  if (auto err = read_expert_groups(who, x, layer, sizes, &groups); err.failure()) return err;
  const int64_t R = groups.R, K = groups.K, E = groups.E, l = groups.l;
  const std::vector<int64_t>& first = groups.first;
  if (weights.size() != 2 * outs.size() || outs.size() == 0)
    return ffi::Error::InvalidArgument(who + ": expected (weight, scale) pairs, one per output");
  std::vector<RowMatrix> mats;  // per output, its E matrices of layer l
  std::vector<std::pair<float*, int64_t>> ys;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto wq = weights.get<ffi::AnyBuffer>(2 * i);
    auto ws = weights.get<ffi::AnyBuffer>(2 * i + 1);
    auto y = outs.get<ffi::AnyBuffer>(i);
    if (!wq.has_value() || !ws.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(who + ": bad operand");
    if (wq->element_type() != ffi::DataType::S8 || ws->element_type() != ffi::DataType::F32 ||
        (*y)->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument(who + ": weights must be int8 with float32 scales");
    const auto wd = wq->dimensions();
    if (wd.size() < 2 || wd.back() != K)
      return ffi::Error::InvalidArgument(who + ": weight columns differ from the input features");
    const int64_t N = wd[wd.size() - 2];
    const int64_t stacked = N * K == 0 ? 0 : static_cast<int64_t>(wq->element_count()) / (N * K);
    if (stacked % E != 0 || l < 0 || l >= stacked / E)
      return ffi::Error::InvalidArgument(who + ": the weights are not [layers, experts, ...] or the layer is out of range");
    if (static_cast<int64_t>(ws->element_count()) != stacked * N)
      return ffi::Error::InvalidArgument(who + ": one scale per output channel expected");
    if (static_cast<int64_t>((*y)->element_count()) != R * N)
      return ffi::Error::InvalidArgument(who + ": output shape mismatch");
    float* yp = (*y)->typed_data<float>();
    ys.emplace_back(yp, N);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = l * E + e;
      mats.push_back(RowMatrix{wq->typed_data<int8_t>() + m * N * K, ws->typed_data<float>() + m * N,
                               yp + first[e] * N, N});
    }
  }
  const int64_t live = first[E];
  for (const auto& [yp, N] : ys) zero_rows(yp, live, R, N);
  if (live == 0) return ffi::Error::Success();
  thread_local RowActsBuf acts;
  acts.quantize(x.typed_data(), nullptr, live, K);
  const ruvllm::RowActs all = acts.view();
  std::vector<ruvllm::ExpertRows> items;
  for (size_t i = 0; i < outs.size(); ++i) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = first[e], rows = first[e + 1] - first[e];
      if (rows == 0) continue;
      ruvllm::RowActs xe = all;  // the expert's rows
      xe.q = all.q + r0 * all.Kp;
      xe.a = all.a + r0 * all.Kp;
      xe.scale = all.scale + r0;
      xe.M = rows;
      items.push_back(ruvllm::ExpertRows{xe, mats[i * E + e]});
    }
  }
  ruvllm::run_expert_row_split(items, live, &xla_pool);
  return ffi::Error::Success();
}

// Regions of memory the stored-block handler may read (a GGUF file's mapping, registered at load by
// ruvllm_register_region): its tables name a region by handle and an offset into it, and every
// expert's bytes are checked to lie inside the region before anything is read.
struct Region {
  const uint8_t* base;
  int64_t bytes;
};
std::mutex g_regions_mutex;
std::vector<Region> g_regions;

bool region_of(int32_t handle, Region& out) {
  std::lock_guard<std::mutex> lock(g_regions_mutex);
  if (handle < 0 || handle >= static_cast<int32_t>(g_regions.size())) return false;
  out = g_regions[handle];
  return true;
}

// Activations of StoredActs for blocks of bv inputs (the calling thread's buffers, grown as needed).
struct StoredActsBuf {
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int32_t> xs;
  ruvllm::StoredActs quantize(const float* x, int64_t M, int64_t K, int64_t bv) {
    const int64_t B = K / bv;
    q.resize(static_cast<size_t>(M * K));
    dx.resize(static_cast<size_t>(M * B));
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t b = 0; b < B; ++b) {
        const float* xb = x + m * K + b * bv;
        float amax = 0.f;
        for (int64_t j = 0; j < bv; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / 127.0f;
        int8_t* qb = q.data() + m * K + b * bv;
        for (int64_t j = 0; j < bv; ++j) {
          float r = amax > 0.f ? std::nearbyint(xb[j] / d) : 0.f;
          qb[j] = static_cast<int8_t>(std::min(std::max(r, -127.f), 127.f));
        }
        dx[static_cast<size_t>(m * B + b)] = d;
      }
    }
    if (bv != 256) return ruvllm::StoredActs{q.data(), dx.data(), M, K, nullptr};
    // The k-quants' terms of their mins (Q4_K) and offsets (Q6_K) need only these sums: once per call,
    // not once per weight row.
    xs.resize(static_cast<size_t>(M * K / 16));
    for (int64_t i = 0; i < M * K / 16; ++i) {
      int32_t sum = 0;
      for (int j = 0; j < 16; ++j) sum += q[static_cast<size_t>(16 * i + j)];
      xs[static_cast<size_t>(i)] = sum;
    }
    return ruvllm::StoredActs{q.data(), dx.data(), M, K, xs.data()};
  }
};

// ruvllm_experts_stored: ruvllm_experts for experts left as GGUF blocks in a registered region (the
// file's mapping), read as stored (cpu_kernels.h, StoredMatrix). x [R, K], layer [1], sizes [E] as
// ruvllm_experts'; then one table per output, int32 [L, 5]: each layer's (region handle, byte offset
// low and high 32 bits, ggml type, bytes per row) of its [E, N, row_bytes] stack, N the output's
// width. x is quantized per row and block (32 or 256 inputs) once per block size.
ffi::Error ExpertsStoredImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                             ffi::Buffer<ffi::S32> sizes, ffi::RemainingArgs tables, ffi::RemainingRets outs) {
  const std::string who = "ruvllm_experts_stored";
  ExpertGroups groups;
  if (auto err = read_expert_groups(who, x, layer, sizes, &groups); err.failure()) return err;
  const int64_t R = groups.R, K = groups.K, E = groups.E, l = groups.l;
  const std::vector<int64_t>& first = groups.first;
  if (tables.size() != outs.size() || outs.size() == 0)
    return ffi::Error::InvalidArgument(who + ": expected one table per output");
  struct Out {
    const uint8_t* w;
    int64_t N, row_bytes;
    int type;
    float* y;
  };
  std::vector<Out> mats;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto t = tables.get<ffi::AnyBuffer>(i);
    auto y = outs.get<ffi::AnyBuffer>(i);
    if (!t.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(who + ": bad operand");
    if (t->element_type() != ffi::DataType::S32 || (*y)->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument(who + ": tables must be int32, outputs float32");
    const int64_t L = static_cast<int64_t>(t->element_count()) / 5;
    if (static_cast<int64_t>(t->element_count()) != L * 5 || l < 0 || l >= L)
      return ffi::Error::InvalidArgument(who + ": a table is not [layers, 5] or the layer is out of range");
    const int32_t* row = t->typed_data<int32_t>() + l * 5;
    const int type = row[3];
    const int64_t bb = ruvllm::stored_block_bytes(type), bv = ruvllm::stored_block_values(type);
    if (bb == 0) return ffi::Error::InvalidArgument(who + ": ggml type " + std::to_string(type) + " is not read as stored");
    if (K % bv != 0 || row[4] != K / bv * bb)
      return ffi::Error::InvalidArgument(who + ": the rows' bytes do not hold the input features in the type's blocks");
    const int64_t N = R == 0 ? 0 : static_cast<int64_t>((*y)->element_count()) / R;
    if (N * R != static_cast<int64_t>((*y)->element_count()))
      return ffi::Error::InvalidArgument(who + ": output shape mismatch");
    Region region;
    if (!region_of(row[0], region)) return ffi::Error::InvalidArgument(who + ": unknown region handle");
    const int64_t offset = static_cast<int64_t>(static_cast<uint32_t>(row[1])) | (static_cast<int64_t>(row[2]) << 32);
    if (offset < 0 || offset + E * N * row[4] > region.bytes)
      return ffi::Error::InvalidArgument(who + ": the experts' blocks lie outside the registered region");
    mats.push_back(Out{region.base + offset, N, row[4], type, (*y)->typed_data<float>()});
  }
  const int64_t live = first[E];
  for (const auto& m : mats) zero_rows(m.y, live, R, m.N);
  if (live == 0) return ffi::Error::Success();
  thread_local StoredActsBuf acts32, acts256;
  ruvllm::StoredActs a32{}, a256{};
  bool need32 = false, need256 = false;
  for (const auto& m : mats) (ruvllm::stored_block_values(m.type) == 32 ? need32 : need256) = true;
  if (need32) a32 = acts32.quantize(x.typed_data(), live, K, 32);
  if (need256) a256 = acts256.quantize(x.typed_data(), live, K, 256);
  // Tasks: (output, expert with rows, 16 output rows); each y element is one task's.
  struct Task {
    ruvllm::StoredActs x;
    ruvllm::StoredMatrix w;
    int64_t n0, n1;
  };
  std::vector<Task> tasks;
  for (const auto& m : mats) {
    const ruvllm::StoredActs& all = ruvllm::stored_block_values(m.type) == 32 ? a32 : a256;
    const int64_t B = K / ruvllm::stored_block_values(m.type);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = first[e], rows = first[e + 1] - first[e];
      if (rows == 0) continue;  // an expert no row chose is never read
      ruvllm::StoredActs xe{all.q + r0 * K, all.dx + r0 * B, rows, K, all.xs ? all.xs + r0 * K / 16 : nullptr};
      ruvllm::StoredMatrix we{m.w + e * m.N * m.row_bytes, m.row_bytes, m.type, m.y + r0 * m.N, m.N};
      for (int64_t n = 0; n < m.N; n += 16) tasks.push_back(Task{xe, we, n, std::min(m.N, n + 16)});
    }
  }
  const KernelTable* kt = kernels();
  const int64_t total = static_cast<int64_t>(tasks.size());
  const int parts = static_cast<int>(std::min<int64_t>(total, Pool::get().threads()));
  Pool::get().run(
      [&](int part) {
        for (int64_t i = total * part / parts; i < total * (part + 1) / parts; ++i)
          kt->stored_rows(tasks[i].x, tasks[i].w, tasks[i].n0, tasks[i].n1);
      },
      parts);
  return ffi::Error::Success();
}

ffi::Error W8A8Impl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                    ffi::Buffer<ffi::F32> in_scale, ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("ruvllm_w8a8: x must be [rows, features]");
  const int64_t M = xd[0], K = xd[1];
  const int64_t l = layer.typed_data()[0];
  if (weights.size() != 2 * outs.size() || outs.size() == 0)
    return ffi::Error::InvalidArgument("ruvllm_w8a8: expected (weight, scale) pairs, one per output");
  if (in_scale.element_count() != 0 && in_scale.dimensions().back() != K)
    return ffi::Error::InvalidArgument("ruvllm_w8a8: smoothing factors do not match the input features");
  std::vector<RowMatrix> mats;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto wq = weights.get<ffi::AnyBuffer>(2 * i);
    auto ws = weights.get<ffi::AnyBuffer>(2 * i + 1);
    auto y = outs.get<ffi::AnyBuffer>(i);
    if (!wq.has_value() || !ws.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("ruvllm_w8a8: bad operand");
    if (wq->element_type() != ffi::DataType::S8 || ws->element_type() != ffi::DataType::F32 ||
        (*y)->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("ruvllm_w8a8: weights must be int8 with float32 scales");
    const auto wd = wq->dimensions();
    if (wd.size() < 2 || wd.back() != K)
      return ffi::Error::InvalidArgument("ruvllm_w8a8: weight columns differ from the input features");
    const int64_t N = wd[wd.size() - 2];
    const int64_t L = static_cast<int64_t>(wq->element_count()) / (N * K);
    if (l < 0 || l >= L) return ffi::Error::InvalidArgument("ruvllm_w8a8: layer index out of range");
    if (static_cast<int64_t>(ws->element_count()) != L * N)
      return ffi::Error::InvalidArgument("ruvllm_w8a8: one scale per output channel expected");
    if (static_cast<int64_t>((*y)->element_count()) != M * N)
      return ffi::Error::InvalidArgument("ruvllm_w8a8: output shape mismatch");
    mats.push_back(RowMatrix{wq->typed_data<int8_t>() + l * N * K, ws->typed_data<float>() + l * N,
                          (*y)->typed_data<float>(), N});
  }
  const float* is = nullptr;
  if (in_scale.element_count() != 0) {
    const int64_t L = static_cast<int64_t>(in_scale.element_count()) / K;
    if (l >= L) return ffi::Error::InvalidArgument("ruvllm_w8a8: smoothing layer index out of range");
    is = in_scale.typed_data() + l * K;
  }
  const int64_t live = live_rows(layer, M);
  for (const auto& m : mats) zero_rows(m.y, live, M, m.N);
  if (live == 0) return ffi::Error::Success();
  thread_local RowActsBuf acts;
  acts.quantize(x.typed_data(), is, live, K);
  run_split(acts.view(), &xla_pool, mats);
  return ffi::Error::Success();
}

// Decode attention splits a task's keys across threads only in ranges of this many keys or more, and
// in at most kMaxSplits ranges.
constexpr int64_t kMinSplitKeys = 64;
constexpr int64_t kMaxSplits = 64;

// Per-thread room for one (sequence, kv head)'s attention probabilities.
float* scratch(const DecodeJob& j, int64_t s) {
  thread_local std::vector<float> p;
  const int64_t ctx = std::max<int64_t>(0, std::min<int64_t>(j.context[s], j.Bd * j.BS));
  const size_t need = static_cast<size_t>(std::max<int64_t>(1, (j.H / j.KVH) * ctx));
  if (p.size() < need) p.resize(need);
  return p.data();
}

// Fills a paged-attention job's cache fields (k, v or k16, v16 and their element type, tables and
// their sizes, layer); nullptr, or what is wrong with the operands.
template <typename Job>
const char* fill_paged_cache(Job& j, ffi::AnyBuffer& k, ffi::AnyBuffer& v, ffi::Buffer<ffi::S32>& layer,
                             ffi::Buffer<ffi::S32>& tables) {
  const auto kd = k.dimensions();
  const auto td = tables.dimensions();
  if (kd.size() != 5 || v.dimensions().size() != 5 || td.size() != 2)
    return "caches must be [L, NB, BS, KVH, D], tables [S, Bd]";
  for (int i = 0; i < 5; ++i)
    if (kd[i] != v.dimensions()[i]) return "K and V caches differ";
  if (k.element_type() != v.element_type()) return "K and V caches differ in element type";
  switch (k.element_type()) {
    case ffi::DataType::F32:
      j.kv = ruvllm::kKvF32;
      j.k = static_cast<const float*>(k.untyped_data());
      j.v = static_cast<const float*>(v.untyped_data());
      break;
    case ffi::DataType::F16:
    case ffi::DataType::BF16:
      j.kv = k.element_type() == ffi::DataType::F16 ? ruvllm::kKvF16 : ruvllm::kKvBF16;
      j.k16 = static_cast<const uint16_t*>(k.untyped_data());
      j.v16 = static_cast<const uint16_t*>(v.untyped_data());
      if (kd[4] > ruvllm::kMaxWidenedRow) return "a 16-bit cache's head dimension is over 1024";
      break;
    default:
      return "caches must be float32, float16 or bfloat16";
  }
  j.tables = tables.typed_data();
  j.NB = kd[1];
  j.BS = kd[2];
  j.KVH = kd[3];
  j.D = kd[4];
  j.S = td[0];
  j.Bd = td[1];
  j.layer = layer.typed_data()[0];
  if (j.layer < 0 || j.layer >= kd[0]) return "layer out of range";
  return nullptr;
}

ffi::Error PagedDecodeImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> tables,
                           ffi::Buffer<ffi::S32> context, ffi::Buffer<ffi::S32> first, float scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  DecodeJob j{};
  if (const char* bad = fill_paged_cache(j, k, v, layer, tables))
    return ffi::Error::InvalidArgument(std::string("ruvllm_paged_decode: ") + bad);
  j.q = q.typed_data();
  j.context = context.typed_data();
  j.first = first.typed_data();
  j.out = out->typed_data();
  if (static_cast<int64_t>(context.element_count()) != j.S || static_cast<int64_t>(first.element_count()) != j.S)
    return ffi::Error::InvalidArgument("ruvllm_paged_decode: one context length and first key per sequence expected");
  const int64_t qn = static_cast<int64_t>(q.element_count());
  if (j.S == 0 || qn % (j.S * j.D) != 0) return ffi::Error::InvalidArgument("ruvllm_paged_decode: q shape mismatch");
  j.H = qn / (j.S * j.D);
  if (j.H % j.KVH != 0) return ffi::Error::InvalidArgument("ruvllm_paged_decode: heads not a multiple of kv heads");
  j.scale = scale;
  const int64_t tasks = j.S * j.KVH;
  int64_t work = 0;
  for (int64_t s = 0; s < j.S; ++s) work += std::max<int64_t>(0, j.context[s] - std::max(0, j.first[s])) * j.H * j.D;
  const KernelTable* kt = kernels();
  Pool& pool = Pool::get();
  const int parts = work < (int64_t{1} << 17) ? 1 : pool.threads();
  // How many ranges a sequence's keys split into (a model with fewer kv heads than threads, Gemma-3
  // 270M's one among them: otherwise one sequence decoding alone would leave threads idle). It
  // depends on the sequence's own key count, the kv heads and the thread count only, never on the
  // other sequences of the step or the step's work, so a sequence gets the same arithmetic (one
  // range: decode; several: decode_part's, merged in range order) alone or in any batch.
  const int64_t ways = (pool.threads() + j.KVH - 1) / j.KVH;
  auto keys_of = [&](int64_t s) {  // first key and end of sequence s's keys
    const int64_t end = std::max<int64_t>(0, std::min<int64_t>(j.context[s], j.Bd * j.BS));
    return std::pair<int64_t, int64_t>{std::max<int64_t>(0, std::min<int64_t>(j.first[s], end)), end};
  };
  auto splits_of = [&](int64_t s) {
    const auto [t0, end] = keys_of(s);
    return std::min({ways, std::max<int64_t>(1, (end - t0) / kMinSplitKeys), kMaxSplits});
  };
  std::vector<int64_t> first_unit(tasks + 1, 0);  // task t's ranges are units first_unit[t] ..
  for (int64_t t = 0; t < tasks; ++t) first_unit[t + 1] = first_unit[t] + splits_of(t / j.KVH);
  const int64_t units = first_unit[tasks];
  if (units == tasks) {
    pool.run(
        [&](int part) {
          for (int64_t t = part; t < tasks; t += parts) kt->decode(j, t / j.KVH, t % j.KVH, scratch(j, t / j.KVH));
        },
        parts);
    return ffi::Error::Success();
  }
  const int64_t group = j.H / j.KVH, stride = group * j.D + 2 * group;
  thread_local std::vector<float> partial;
  if (partial.size() < static_cast<size_t>(units * stride)) partial.resize(units * stride);
  float* part_out = partial.data();
  pool.run(
      [&](int part) {
        for (int64_t t = 0; t < tasks; ++t) {
          const int64_t s = t / j.KVH, n = first_unit[t + 1] - first_unit[t];
          for (int64_t i = 0; i < n; ++i) {
            const int64_t u = first_unit[t] + i;
            if (u % parts != part) continue;
            if (n == 1) {
              kt->decode(j, s, t % j.KVH, scratch(j, s));
              continue;
            }
            const auto [t0, end] = keys_of(s);
            float* o = part_out + u * stride;
            kt->decode_part(j, s, t % j.KVH, t0 + (end - t0) * i / n, t0 + (end - t0) * (i + 1) / n, scratch(j, s), o,
                            o + group * j.D);
          }
        }
      },
      parts);
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t s = t / j.KVH, g = t % j.KVH, splits = first_unit[t + 1] - first_unit[t];
    if (splits == 1) continue;
    const float* pt = part_out + first_unit[t] * stride;
    float* out = j.out + (s * j.H + g * group) * j.D;
    for (int64_t hh = 0; hh < group; ++hh) {
      float m = -INFINITY;
      for (int64_t i = 0; i < splits; ++i) m = std::max(m, pt[i * stride + group * j.D + hh]);
      float l = 0.f;
      float w[kMaxSplits];
      for (int64_t i = 0; i < splits; ++i) {
        const float* st = pt + i * stride + group * j.D;
        w[i] = st[group + hh] > 0.f ? std::exp(st[hh] - m) : 0.f;
        l += w[i] * st[group + hh];
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      float* oh = out + hh * j.D;
      for (int64_t d = 0; d < j.D; ++d) {
        float acc = 0.f;
        for (int64_t i = 0; i < splits; ++i) acc += w[i] * pt[i * stride + hh * j.D + d];
        oh[d] = acc * inv;
      }
    }
  }
  return ffi::Error::Success();
}

// Tiles of at most `tq` consecutive live queries (context > 0) of one sequence.
std::vector<std::pair<int64_t, int64_t>> prefill_tiles(const PrefillJob& j, int64_t tq) {
  std::vector<std::pair<int64_t, int64_t>> tiles;
  int64_t i = 0;
  while (i < j.N) {
    if (j.context[i] <= 0) {
      ++i;
      continue;
    }
    int64_t e = i + 1;
    while (e < j.N && e - i < tq && j.context[e] > 0 && j.seq[e] == j.seq[i]) ++e;
    tiles.emplace_back(i, e);
    i = e;
  }
  return tiles;
}

ffi::Error PagedPrefillImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq,
                            ffi::Buffer<ffi::S32> context, ffi::Buffer<ffi::S32> first, float scale,
                            ffi::ResultBuffer<ffi::F32> out) {
  PrefillJob j{};
  if (const char* bad = fill_paged_cache(j, k, v, layer, tables))
    return ffi::Error::InvalidArgument(std::string("ruvllm_paged_prefill: ") + bad);
  const auto qd = q.dimensions();
  if (qd.size() != 3) return ffi::Error::InvalidArgument("ruvllm_paged_prefill: q must be [N, H, D]");
  j.q = q.typed_data();
  j.seq = seq.typed_data();
  j.context = context.typed_data();
  j.first = first.typed_data();
  j.out = out->typed_data();
  j.N = qd[0];
  j.H = qd[1];
  j.scale = scale;
  if (qd[2] != j.D || j.H % j.KVH != 0)
    return ffi::Error::InvalidArgument("ruvllm_paged_prefill: q must be [N, H, D] with H a multiple of kv heads");
  for (const auto* b : {&seq, &context, &first})
    if (static_cast<int64_t>(b->element_count()) != j.N)
      return ffi::Error::InvalidArgument("ruvllm_paged_prefill: one sequence, context and first key per query");
  for (int64_t i = 0; i < j.N; ++i)
    if (j.context[i] > 0 && (j.seq[i] < 0 || j.seq[i] >= j.S))
      return ffi::Error::InvalidArgument("ruvllm_paged_prefill: sequence index out of range");
  for (int64_t i = 0; i < j.N; ++i)  // padding queries (the kernel zeroes the rows of its tiles)
    if (j.context[i] <= 0) std::memset(j.out + i * j.H * j.D, 0, sizeof(float) * j.H * j.D);
  const int64_t group = j.H / j.KVH;
  Pool& pool = Pool::get();
  // Tiles as large as the row limit allows, smaller while that leaves threads idle.
  int64_t tq = std::max<int64_t>(1, ruvllm::kPrefillRows / group);
  auto tiles = prefill_tiles(j, tq);
  while (tq > 4 && static_cast<int64_t>(tiles.size()) * j.KVH < 2 * pool.threads()) {
    tq = (tq + 1) / 2;
    tiles = prefill_tiles(j, tq);
  }
  if (tiles.empty()) return ffi::Error::Success();
  const int64_t keys = j.Bd * j.BS;
  const size_t need = static_cast<size_t>(ruvllm::prefill_scratch(tq * group, keys, j.D));
  const int64_t tasks = static_cast<int64_t>(tiles.size()) * j.KVH;
  const KernelTable* kt = kernels();
  // One task per part, claimed last tile first: under the causal mask a later tile sees more keys, so
  // the longest tasks start first and the short ones fill in at the end; with helpers when the call
  // has the rows for them (see the pool).
  auto task = [&](int part) {
    thread_local std::vector<float> p;
    if (p.size() < need) p.resize(need);
    const int64_t t = tasks - 1 - part;
    const auto& tile = tiles[t / j.KVH];
    kt->prefill(j, tile.first, tile.second, t % j.KVH, p.data());
  };
  if (tasks > Pool::kMaxParts) {  // more tasks than one job takes: in jobs of at most that many
    for (int64_t first = 0; first < tasks; first += Pool::kMaxParts) {
      const int n = static_cast<int>(std::min<int64_t>(Pool::kMaxParts, tasks - first));
      pool.run([&](int part) { task(static_cast<int>(first) + part); }, n);
    }
    return ffi::Error::Success();
  }
  pool.run(task, static_cast<int>(tasks), j.N >= kHelperRows ? &xla_pool : nullptr);
  return ffi::Error::Success();
}

ffi::Error LoraImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> a,
                    ffi::Buffer<ffi::F32> bt, ffi::Buffer<ffi::S32> slot, int64_t rank,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = bt.dimensions();
  if (xd.size() != 2 || ad.size() != 3 || bd.size() != 3)
    return ffi::Error::InvalidArgument("ruvllm_lora: x must be [T, IN], a [L, S*R, IN], bt [L, S*R, OUT]");
  LoraJob j{};
  j.x = x.typed_data();
  j.a = a.typed_data();
  j.bt = bt.typed_data();
  j.slot = slot.typed_data();
  j.y = y->typed_data();
  j.T = xd[0];
  j.IN = xd[1];
  j.SR = ad[1];
  j.OUT = bd[2];
  j.R = rank;
  j.layer = layer.typed_data()[0];
  if (ad[2] != j.IN || bd[0] != ad[0] || bd[1] != j.SR)
    return ffi::Error::InvalidArgument("ruvllm_lora: factor shapes do not match x");
  if (j.layer < 0 || j.layer >= ad[0]) return ffi::Error::InvalidArgument("ruvllm_lora: layer out of range");
  if (j.R < 1 || j.R > ruvllm::kLoraMaxRank || j.SR % j.R != 0)
    return ffi::Error::InvalidArgument("ruvllm_lora: rank must divide the factors' rows and be at most 512");
  if (static_cast<int64_t>(slot.element_count()) != j.T)
    return ffi::Error::InvalidArgument("ruvllm_lora: one slot per token expected");
  const KernelTable* kt = kernels();
  Pool& pool = Pool::get();
  const int64_t work = j.T * j.R * (j.IN + j.OUT);
  if (work < (int64_t{1} << 16) || pool.threads() == 1 || j.T == 1) {
    kt->lora_rows(j, 0, j.T);
    return ffi::Error::Success();
  }
  const int parts = pool.threads();
  pool.run([&](int part) { kt->lora_rows(j, j.T * part / parts, j.T * (part + 1) / parts); });
  return ffi::Error::Success();
}

// One row's mean of squares (RMSNorm's) in a fixed order: 16 running lane sums over the row, then the
// lanes folded as a fixed tree. The order depends on the row's length only, never on the number of
// rows or on how they are split, so the norm is the same for a row alone and in a batch. Plain loops:
// the lane sums vectorise without reassociation, the same arithmetic on every ISA.
float fixed_order_mean_square(const float* row, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += row[i + l] * row[i + l];
  for (int l = 0; i + l < n; ++l) acc[l] += row[i + l] * row[i + l];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0] / static_cast<float>(n);
}

ffi::Error MeanSquareImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const int64_t n = xd.size() == 0 ? 1 : xd[xd.size() - 1];
  if (n < 1) return ffi::Error::InvalidArgument("ruvllm_mean_square: rows must not be empty");
  const int64_t rows = static_cast<int64_t>(x.element_count()) / n;
  if (static_cast<int64_t>(out->element_count()) != rows)
    return ffi::Error::InvalidArgument("ruvllm_mean_square: one output per row expected");
  const float* p = x.typed_data();
  float* o = out->typed_data();
  // A memory-bound pass (a prefill chunk of 512 rows of 576 reads 1.2 MB): one thread is enough.
  for (int64_t r = 0; r < rows; ++r) o[r] = fixed_order_mean_square(p + r * n, n);
  return ffi::Error::Success();
}

// ruvllm_w8a8_rescale: y [T, N] = (float(acc) * x_scale[t]) * w_scale[n], each product rounded, as
// the w8a8 kernels write their outputs. XLA's integer GEMM (the w8a8 product of steps too large for the
// kernels) ends in these two multiplies; left to XLA they fuse into the next operation, and XLA:CPU
// contracts the last multiply and the residual stream's add into one FMA, so a row's hidden state
// depended on whether its step was small enough for the kernels. A custom call keeps them apart.
ffi::Error W8A8RescaleImpl(ffi::Buffer<ffi::S32> acc, ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::F32> w_scale,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto ad = acc.dimensions();
  if (ad.size() != 2) return ffi::Error::InvalidArgument("ruvllm_w8a8_rescale: acc must be [rows, N]");
  const int64_t T = ad[0], N = ad[1];
  if (static_cast<int64_t>(x_scale.element_count()) != T || static_cast<int64_t>(w_scale.element_count()) != N ||
      static_cast<int64_t>(y->element_count()) != T * N)
    return ffi::Error::InvalidArgument("ruvllm_w8a8_rescale: one scale per row and per column expected");
  const int32_t* a = acc.typed_data();
  const float* xs = x_scale.typed_data();
  const float* ws = w_scale.typed_data();
  float* o = y->typed_data();
  auto rows = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t n = 0; n < N; ++n) o[t * N + n] = (static_cast<float>(a[t * N + n]) * xs[t]) * ws[n];
  };
  Pool& pool = Pool::get();
  // Split by rows (a split changes no output's arithmetic); a decode step's few rows on one thread.
  const int parts = T * N < (int64_t{1} << 16) ? 1 : static_cast<int>(std::min<int64_t>(pool.threads(), T));
  if (parts == 1) {
    rows(0, T);
  } else {
    pool.run([&](int part) { rows(T * part / parts, T * (part + 1) / parts); }, parts);
  }
  return ffi::Error::Success();
}

// ruvllm_float_product: y [T, N] = x [T, K] times w [N, K] transposed, float32, every output summed in
// one fixed order (KernelTable.float_rows, the same bits on every variant). For a mixture of experts'
// router: XLA's dot sums a row of a one-row step in another order than a row of a larger one, which
// changed a sequence's routing weights with the batch.
// Split across threads by output columns; a split never changes an output's order.
ffi::Error FloatProductImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("ruvllm_float_product: x must be [rows, K] and w [N, K]");
  const int64_t T = xd[0], K = xd[1], N = wd[0];
  if (static_cast<int64_t>(y->element_count()) != T * N)
    return ffi::Error::InvalidArgument("ruvllm_float_product: output shape mismatch");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const KernelTable* kt = kernels();
  auto columns = [&](int64_t n0, int64_t n1) { kt->float_rows(xp, wp, yp, T, N, K, n0, n1); };
  Pool& pool = Pool::get();
  // A decode step's router (one row, 128 x 2048 weights) is a few microseconds' work: one thread.
  const int parts = T * N * K < (int64_t{1} << 22) ? 1 : static_cast<int>(std::min<int64_t>(pool.threads(), N));
  if (parts == 1) {
    columns(0, N);
  } else {
    pool.run([&](int part) { columns(N * part / parts, N * (part + 1) / parts); }, parts);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmFloatProduct, FloatProductImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmW8A8Rescale, W8A8RescaleImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmMeanSquare, MeanSquareImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmW8A8, W8A8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

// The grouped products: (x float32, layer int32, weight operands..., outputs...).
#define RUVLLM_GROUPED_HANDLER(name, impl)                                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                                                            \
                                ffi::Ffi::Bind()                                                       \
                                    .Ctx<ffi::ThreadPool>()                                            \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                      \
                                    .Arg<ffi::Buffer<ffi::S32>>()                                      \
                                    .RemainingArgs()                                                   \
                                    .RemainingRets())
RUVLLM_GROUPED_HANDLER(RuvllmWxA8, WxA8Impl);
RUVLLM_GROUPED_HANDLER(RuvllmWxA8Panel, WxA8PanelImpl);
RUVLLM_GROUPED_HANDLER(RuvllmKxA8Panel, KxA8PanelImpl);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmExpertsW8A8, ExpertsW8A8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmExpertsStored, ExpertsStoredImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

// Registers [base, base + bytes) for ruvllm_experts_stored to read; returns its handle (never reused:
// a region stays registered for the process's life, as the model holding the mapping may).
extern "C" int ruvllm_register_region(const void* base, int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_regions_mutex);
  g_regions.push_back(Region{static_cast<const uint8_t*>(base), bytes});
  return static_cast<int>(g_regions.size()) - 1;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmExperts, ExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmPagedPrefill, PagedPrefillImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmLora, LoraImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("rank")
                                  .Ret<ffi::Buffer<ffi::F32>>());
