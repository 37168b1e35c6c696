// ruvllm CPU kernels for XLA:CPU, called from jitted steps through the XLA FFI: the handlers, the
// work split over a small thread pool, activation quantization and the choice of ISA variant.
//
// Built at install (setup.py) for the baseline ISA of the target architecture; the kernels
// themselves are in cpu_kernels_variant.cc, compiled once per ISA variant into the same library.
// The best variant the CPU supports is chosen once, at load, from its features (cpuid and xgetbv on
// x86-64, getauxval(AT_HWCAP) on Linux/aarch64); ruvllm_select_isa forces another it supports.
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
// (sliding windows) with the model's score scale (attribute "scale").
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__linux__) && defined(__aarch64__)
#include <sys/auxv.h>
#endif

#include "xla/ffi/api/ffi.h"

#include "cpu_kernels.h"

namespace ffi = xla::ffi;
using ruvllm::DecodeJob;
using ruvllm::LoraJob;
using ruvllm::PrefillJob;
using ruvllm::GroupMatrix;
using ruvllm::KernelTable;
using ruvllm::RowMatrix;

// Every variant the build may hold; those it did not compile (another architecture) are null.
#define RUVLLM_VARIANTS(X) \
  X(scalar) X(avx2) X(avxvnni) X(avxvnni_evex) X(avx512vnni) X(neon) X(neon_dotprod) X(neon_i8mm)
#define RUVLLM_WEAK_DECL(sym) extern "C" const KernelTable* ruvllm_kernels_##sym() __attribute__((weak));
RUVLLM_VARIANTS(RUVLLM_WEAK_DECL)

namespace {

// -- CPU features and the variant in use -------------------------------------------------------------

enum Feature : unsigned {
  kAvx2 = 1u << 0,        // AVX2 + FMA + F16C, YMM state enabled by the OS
  kAvxVnni = 1u << 1,     // AVX-VNNI (VEX vpdpbusd)
  kAvx512Vnni = 1u << 2,  // AVX-512 F + BW + VL + VNNI, ZMM state enabled by the OS
  kNeon = 1u << 8,
  kNeonDot = 1u << 9,     // sdot / udot
  kNeonI8mm = 1u << 10,   // smmla / usdot
};

unsigned detect_features() {
  unsigned f = 0;
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29), avx = c & (1u << 28);
  if (!osxsave || !avx) return 0;
  unsigned xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool ymm = (xlo & 0x6u) == 0x6u, zmm = (xlo & 0xE6u) == 0xE6u;
  if (!ymm || __get_cpuid_max(0, nullptr) < 7) return 0;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512bw = b & (1u << 30), avx512vl = b & (1u << 31);
  const bool avx512vnni = c & (1u << 11);
  __cpuid_count(7, 1, a, b, c, d);
  const bool avxvnni = a & (1u << 4);
  if (avx2 && fma && f16c) {
    f |= kAvx2;
    if (avxvnni) f |= kAvxVnni;
    if (zmm && avx512f && avx512bw && avx512vl && avx512vnni) f |= kAvx512Vnni;
  }
#elif defined(__aarch64__)
  f |= kNeon;
#if defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  if (hw & (1ul << 20)) f |= kNeonDot;               // HWCAP_ASIMDDP
  if ((f & kNeonDot) && (hw2 & (1ul << 13))) f |= kNeonI8mm;  // HWCAP2_I8MM
#endif
#endif
  return f;
}

struct Variant {
  const char* name;                        // what RUVLLM_CPU_ISA calls it
  const KernelTable* (*table)();           // null where this build lacks it
  unsigned needs;                          // features the CPU must have
};

// Best last. "avxvnni" has two builds of the same 256-bit code: VEX-encoded for CPUs with AVX-VNNI,
// EVEX-encoded for CPUs with AVX-512 VNNI but not AVX-VNNI (most AVX-512 server parts), so the
// AVX-VNNI path can be measured on either.
const Variant kVariants[] = {
    {"scalar", ruvllm_kernels_scalar, 0},
    {"avx2", ruvllm_kernels_avx2, kAvx2},
    {"avxvnni", ruvllm_kernels_avxvnni_evex, kAvx512Vnni},
    {"avxvnni", ruvllm_kernels_avxvnni, kAvxVnni},
    {"avx512vnni", ruvllm_kernels_avx512vnni, kAvx512Vnni},
    {"neon", ruvllm_kernels_neon, kNeon},
    {"neon-dotprod", ruvllm_kernels_neon_dotprod, kNeonDot},
    {"neon-i8mm", ruvllm_kernels_neon_i8mm, kNeonI8mm},
};

std::atomic<const KernelTable*> g_table{nullptr};
std::string g_isa;
std::atomic<int> g_threads{0};
std::atomic<int> g_pool_threads{0};  // nonzero once the pool has started

bool usable(const Variant& v, unsigned f) { return v.table != nullptr && (v.needs & f) == v.needs; }

const KernelTable* kernels() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  return t != nullptr ? t : ruvllm_kernels_scalar();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

// -- the thread pool ---------------------------------------------------------------------------------
// A small pool of worker threads of our own. XLA's intra-op pool wakes a sleeping thread for each
// task, which costs tens of microseconds; a decode step makes ~120 kernel calls, each a few hundred
// microseconds of work, so that latency would be a large part of the step. A job's parts are claimed
// (the calling thread runs whatever no worker took), so a worker without a core never holds a call
// up. These workers spin for a short while after each job (RUVLLM_JAX_NATIVE_SPIN_US, default 50) and then sleep, so they are
// hot during a step and idle between requests. The thread count is set from Python before the pool
// starts (ruvllm_set_threads: --threads / RUVLLM_THREADS, else the CPUs this process may use).
//
// Calls of many rows (prompt chunks, large decode batches) also hand parts to XLA's own intra-op
// threads (the FFI call's ffi::ThreadPool), as helpers that claim parts exactly as our workers do.
// While one of XLA's threads runs the call, its others have nothing to do and share the cores with
// our workers; a helper puts such a thread to work on the call instead. On a 2-core Zen 4
// (docs/jax-backend.md) a 128-token Gemma-3-270M prefill took 15-25% less time with them, a decode
// batch of 32 about 6% less, one of 16 the same, and one of 8 about 3% more, so calls of fewer than
// kHelperRows rows (every one-row decode call among them) do not use them.
class Pool {
 public:
  static constexpr int kMaxParts = 0xffff;

  static Pool& get() {
    // Never destroyed: workers may outlive static destruction. A forked child has none of the
    // parent's threads, so it builds its own pool.
    static std::atomic<Pool*> pool{nullptr};
    static std::mutex create;
    Pool* p = pool.load(std::memory_order_acquire);
    if (p == nullptr || p->pid_ != getpid()) {
      std::lock_guard<std::mutex> lk(create);
      p = pool.load(std::memory_order_acquire);
      if (p == nullptr || p->pid_ != getpid()) {
        p = new Pool();
        pool.store(p, std::memory_order_release);
      }
    }
    return *p;
  }
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(part) once for each part in [0, parts) (default: one per thread). Parts are claimed,
  // not assigned: the calling thread takes every part no worker has claimed yet, so a worker that is
  // not on a core (XLA's own threads may hold them) never stalls the call; the caller waits only for
  // parts a worker is running. helpers: XLA's intra-op pool, given up to threads() - 1 tasks that
  // claim parts too (one that starts after the job is over finds none left and returns).
  template <typename F>
  void run(F&& fn, int parts = 0, ffi::ThreadPool* helpers = nullptr) {
    if (parts <= 0) parts = threads();
    parts = std::min(parts, kMaxParts);
    if (workers_.empty() || parts == 1) {
      for (int p = 0; p < parts; ++p) fn(p);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mutex_);  // one job at a time (XLA may call concurrently)
    std::function<void(int)> job = fn;
    job_ = &job;
    done_.store(0, std::memory_order_relaxed);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen = generation_.fetch_add(1, std::memory_order_relaxed) + 1;
      claim_.store(((gen & 0xffffffffu) << 32) | (static_cast<uint64_t>(parts) << 16), std::memory_order_release);
    }
    cv_.notify_all();
    if (helpers != nullptr) {
      const int64_t n = std::min<int64_t>(helpers->num_threads(), threads()) - 1;
      for (int64_t i = 0; i < n; ++i) helpers->Schedule([this, gen] { work_on(gen); });
    }
    for (int p; (p = claim(gen)) >= 0;) {
      fn(p);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
    for (int spins = 0; done_.load(std::memory_order_acquire) != parts; ++spins) {
      if (spins < 4096) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
    job_ = nullptr;
  }

 private:
  Pool() {
    int n = g_threads.load() > 0 ? g_threads.load() : static_cast<int>(std::thread::hardware_concurrency());
    if (n < 1) n = 1;
    if (n > 256) n = 256;
    g_pool_threads.store(n);
    const char* spin = std::getenv("RUVLLM_JAX_NATIVE_SPIN_US");
    spin_us_ = spin ? std::atoi(spin) : 50;
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
    for (auto& t : workers_) t.detach();
  }

  // The next unclaimed part of job `gen`, or -1 when none is left (or that job is over).
  int claim(uint64_t gen) {
    uint64_t v = claim_.load(std::memory_order_acquire);
    for (;;) {
      if ((v >> 32) != (gen & 0xffffffffu) || (v & 0xffff) >= ((v >> 16) & 0xffff)) return -1;
      if (claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) return static_cast<int>(v & 0xffff);
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen = generation_.load(std::memory_order_acquire);
      if (gen == seen) {
        const auto start = std::chrono::steady_clock::now();
        while ((gen = generation_.load(std::memory_order_acquire)) == seen) {
          // Yield rather than pause: XLA's own threads may need this core between our calls.
          std::this_thread::yield();
          if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us_)) {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
            gen = generation_.load(std::memory_order_acquire);
            break;
          }
        }
      }
      seen = gen;
      work_on(gen);
    }
  }

  // Runs parts of job `gen` until none is left. job_ stays set while a claimed part is unfinished.
  void work_on(uint64_t gen) {
    for (int p; (p = claim(gen)) >= 0;) {
      (*job_)(p);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  // (job generation << 32) | (parts << 16) | next part to claim, one word so that a claim checks the
  // job, its part count and the next part at once; job_ is written before it is stored.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};
  std::function<void(int)>* volatile job_ = nullptr;
  int spin_us_ = 50;
  pid_t pid_ = getpid();
};

// -- activation quantization (owning buffers; the kernels see cpu_kernels.h's views) ---------------

struct RowActsBuf {
  int64_t M = 0, K = 0, Kp = 0;
  std::vector<int8_t> q;      // [M, Kp], zero padded
  std::vector<uint8_t> a;     // [M, Kp], q + 128 (zero padding -> 128)
  std::vector<float> scale;   // [M]

  void quantize(const float* x, const float* in_scale, int64_t rows, int64_t cols) {
    M = rows;
    K = cols;
    Kp = (cols + 63) / 64 * 64;
    q.assign(M * Kp, 0);
    a.assign(M * Kp, 128);
    scale.assign(M, 1.0f);
    std::vector<float> tmp(K);
    for (int64_t m = 0; m < M; ++m) {
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        float v = x[m * K + k];
        if (in_scale) v *= in_scale[k];
        tmp[k] = v;
        amax = std::fmax(amax, std::fabs(v));
      }
      const float sc = amax > 0.f ? amax / 127.0f : 1.0f;
      scale[m] = sc;
      for (int64_t k = 0; k < K; ++k) {
        float r = std::nearbyint(tmp[k] / sc);
        r = std::fmin(std::fmax(r, -127.f), 127.f);
        const int8_t v = static_cast<int8_t>(r);
        q[m * Kp + k] = v;
        a[m * Kp + k] = static_cast<uint8_t>(v + 128);
      }
    }
  }

  ruvllm::RowActs view() const { return {q.data(), a.data(), scale.data(), M, K, Kp}; }
};

struct GroupActsBuf {
  int64_t M = 0, K = 0, G = 0, Gp = 0;
  std::vector<int8_t> q, q4;
  std::vector<float> dx, sx;
  std::vector<int32_t> isum, isum16;
  std::vector<float> sx16;
  bool with_q4 = false;

  // with_q4: also lay the codes out for the row-major 4-bit kernel (panel matrices do not need it):
  // per pair of groups (a, b): a[0:16] b[0:16] a[16:32] b[16:32], matching how one 32-byte load of
  // packed codes unpacks (low nibbles of a and b, then their high nibbles).
  void quantize(const float* x, int64_t rows, int64_t cols, bool want_q4) {
    M = rows;
    K = cols;
    G = cols / 32;
    Gp = (G + 15) / 16 * 16;
    with_q4 = want_q4;
    q.assign(M * K, 0);
    if (with_q4) q4.assign(M * K, 0);
    dx.assign(M * Gp, 0.f);
    sx.assign(M * Gp, 0.f);
    isum.assign(M * Gp, 0);
    isum16.assign(M * 2 * Gp, 0);
    sx16.assign(M * 2 * Gp, 0.f);
    kernels()->quantize_groups(x, M, K, {q.data(), dx.data(), sx.data(), sx16.data(), isum.data(), isum16.data(), Gp});
    for (int64_t m = 0; with_q4 && m < M; ++m) {
      for (int64_t p = 0; with_q4 && p + 1 < G; p += 2) {
        const int8_t* a = q.data() + m * K + p * 32;
        const int8_t* b = a + 32;
        int8_t* o = q4.data() + m * K + p * 32;
        std::memcpy(o, a, 16);
        std::memcpy(o + 16, b, 16);
        std::memcpy(o + 32, a + 16, 16);
        std::memcpy(o + 48, b + 16, 16);
      }
    }
  }

  ruvllm::GroupActs view() const {
    return {q.data(), with_q4 ? q4.data() : nullptr, dx.data(), sx.data(), isum.data(), isum16.data(),
            sx16.data(), M, K, G, Gp};
  }
};

// How a product of `rows` activation rows and `work` multiply-adds is split: parts (runs of every
// matrix's panels or row blocks), and XLA's pool as helpers or not. One part per thread, except for
// calls of kHelperRows rows or more: kPartsPerThread per thread with helpers (see the pool), so that
// whichever threads are on the cores take the parts.
constexpr int64_t kHelperRows = 16;
constexpr int kPartsPerThread = 4;

struct Split {
  int parts = 1;
  ffi::ThreadPool* helpers = nullptr;
};

Split product_split(int64_t rows, int64_t work, ffi::ThreadPool* xla_pool) {
  const int threads = Pool::get().threads();
  if (work < (int64_t{1} << 16) || threads == 1) return {};
  if (rows < kHelperRows || xla_pool == nullptr) return {threads, nullptr};
  return {threads * kPartsPerThread, xla_pool};
}

// w8a8_rows over every matrix, each split into equal runs of 4-row blocks across the pool's threads.
void run_split(const ruvllm::RowActs& x, ffi::ThreadPool* xla_pool, const std::vector<RowMatrix>& mats) {
  const KernelTable* kt = kernels();
  int64_t total = 0;
  for (const auto& m : mats) total += m.N;
  const Split split = product_split(x.M, total * x.K * x.M, xla_pool);
  const int parts = split.parts;
  Pool::get().run(
      [&](int part) {
        for (const auto& m : mats) {
          const int64_t blocks = (m.N + 3) / 4;
          const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
          kt->w8a8_rows(x, m, std::min(m.N, b0 * 4), std::min(m.N, b1 * 4));
        }
      },
      parts, split.helpers);
}

void run_group_split(const ruvllm::GroupActs& x, ffi::ThreadPool* xla_pool, const std::vector<GroupMatrix>& mats,
                     const std::vector<ruvllm::KMatrix>& kmats = {}) {
  const KernelTable* kt = kernels();
  int64_t work = 0;
  for (const auto& m : mats) work += m.N * x.K * x.M;
  for (const auto& m : kmats) work += m.N * x.K * x.M;
  Pool& pool = Pool::get();
  const Split split = product_split(x.M, work, xla_pool);
  const int parts = split.parts;
  auto run_part = [&](int part) {
    for (const auto& m : mats) {
      if (m.panel) {
        const int64_t panels = m.N / 16;
        kt->panel_rows(x, m, panels * part / parts, panels * (part + 1) / parts);
        continue;
      }
      const int64_t blocks = (m.N + 1) / 2;
      const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
      kt->group_rows(x, m, std::min(m.N, b0 * 2), std::min(m.N, b1 * 2));
    }
    for (const auto& m : kmats) {
      const int64_t panels = m.N / 16;
      kt->kpanel_rows(x, m, panels * part / parts, panels * (part + 1) / parts);
    }
  };
  pool.run(run_part, parts, split.helpers);
}

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
    if (K % 256 != 0) return ffi::Error::InvalidArgument("ruvllm_kxa8: k-quants need a multiple of 256 inputs");
    const int64_t SB = K / 256;
    if (static_cast<int64_t>(a->element_count()) != L * N * SB || static_cast<int64_t>(b->element_count()) != L * N * SB ||
        static_cast<int64_t>(sc->element_count()) != L * N * 2 * G ||
        static_cast<int64_t>(mn->element_count()) != L * N * 2 * G)
      return ffi::Error::InvalidArgument("ruvllm_kxa8: k-quant factors have the wrong sizes");
    kmats.push_back(ruvllm::KMatrix{codes, ap + l * N * SB, bp + l * N * SB, sc->typed_data<int8_t>() + l * N * 2 * G,
                                    mn->typed_data<int8_t>() + l * N * 2 * G, (*y)->typed_data<float>(), N, bits});
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
  if (parts == 1) {
    for (int64_t t = 0; t < tasks; ++t) kt->decode(j, t / j.KVH, t % j.KVH, scratch(j, t / j.KVH));
    return ffi::Error::Success();
  }
  // Fewer (sequence, kv head) tasks than threads (one sequence of a model with one kv head: Gemma-3
  // 270M decoding alone): each task's keys split into ranges, one per thread, merged after.
  int64_t longest = 0;
  for (int64_t s = 0; s < j.S; ++s) longest = std::max<int64_t>(longest, j.context[s] - std::max(0, j.first[s]));
  const int64_t splits =
      std::min({(parts + tasks - 1) / tasks, std::max<int64_t>(1, longest / kMinSplitKeys), kMaxSplits});
  if (splits == 1) {
    pool.run([&](int part) {
      for (int64_t t = part; t < tasks; t += parts) kt->decode(j, t / j.KVH, t % j.KVH, scratch(j, t / j.KVH));
    });
    return ffi::Error::Success();
  }
  const int64_t group = j.H / j.KVH, stride = group * j.D + 2 * group, units = tasks * splits;
  thread_local std::vector<float> partial;
  if (partial.size() < static_cast<size_t>(units * stride)) partial.resize(units * stride);
  auto keys = [&](int64_t s, int64_t i) {  // split i of sequence s's keys
    const int64_t end = std::max<int64_t>(0, std::min<int64_t>(j.context[s], j.Bd * j.BS));
    const int64_t t0 = std::max<int64_t>(0, std::min<int64_t>(j.first[s], end));
    return std::pair<int64_t, int64_t>{t0 + (end - t0) * i / splits, t0 + (end - t0) * (i + 1) / splits};
  };
  float* part_out = partial.data();
  pool.run([&](int part) {
    for (int64_t u = part; u < units; u += parts) {
      const int64_t t = u / splits, s = t / j.KVH;
      const auto [a, b] = keys(s, u % splits);
      float* o = part_out + u * stride;
      kt->decode_part(j, s, t % j.KVH, a, b, scratch(j, s), o, o + group * j.D);
    }
  });
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t s = t / j.KVH, g = t % j.KVH;
    float* out = j.out + (s * j.H + g * group) * j.D;
    for (int64_t hh = 0; hh < group; ++hh) {
      float m = -INFINITY;
      for (int64_t i = 0; i < splits; ++i) m = std::max(m, part_out[(t * splits + i) * stride + group * j.D + hh]);
      float l = 0.f;
      float w[kMaxSplits];
      for (int64_t i = 0; i < splits; ++i) {
        const float* st = part_out + (t * splits + i) * stride + group * j.D;
        w[i] = st[group + hh] > 0.f ? std::exp(st[hh] - m) : 0.f;
        l += w[i] * st[group + hh];
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      float* oh = out + hh * j.D;
      for (int64_t d = 0; d < j.D; ++d) {
        float acc = 0.f;
        for (int64_t i = 0; i < splits; ++i) acc += w[i] * part_out[(t * splits + i) * stride + hh * j.D + d];
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

}  // namespace

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

// -- choosing the variant (called from ruvllm_jax.native) --------------------------------------------

// Comma-separated names of the variants this CPU can run with this build, worst first.
extern "C" const char* ruvllm_supported_isas() {
  static const std::string out = [] {
    const unsigned f = detect_features();
    std::vector<std::string> names;
    for (const auto& v : kVariants)
      if (usable(v, f) && std::find(names.begin(), names.end(), v.name) == names.end()) names.push_back(v.name);
    std::string joined;
    for (const auto& n : names) joined += (joined.empty() ? "" : ",") + n;
    return joined;
  }();
  return out.c_str();
}

// Selects a variant by name ("auto": the best the CPU supports). Returns 0, or 1 for a name this
// build does not know, 2 for a variant the CPU lacks the instructions for.
extern "C" int ruvllm_select_isa(const char* name) {
  const unsigned f = detect_features();
  const Variant* pick = nullptr;
  bool known = std::strcmp(name, "auto") == 0;
  for (const auto& v : kVariants) {
    if (std::strcmp(name, "auto") != 0 && std::strcmp(name, v.name) != 0) continue;
    if (v.table != nullptr) known = true;
    if (usable(v, f)) pick = &v;  // the last usable one: the best, or the preferred encoding
  }
  if (!known) return 1;
  if (pick == nullptr) return 2;
  g_isa = pick->name;
  g_table.store(pick->table(), std::memory_order_release);
  return 0;
}

// The selected variant's name and the build of it that runs (they differ for avxvnni_evex).
extern "C" const char* ruvllm_isa() { return g_isa.empty() ? "scalar" : g_isa.c_str(); }
extern "C" const char* ruvllm_isa_build() { return kernels()->name; }

// Sets the pool's thread count before it starts; returns the count it has (n, or the count the pool
// already started with).
extern "C" int ruvllm_set_threads(int n) {
  g_threads.store(n);
  const int started = g_pool_threads.load();
  return started != 0 ? started : n;
}

extern "C" int ruvllm_threads() { return Pool::get().threads(); }

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
