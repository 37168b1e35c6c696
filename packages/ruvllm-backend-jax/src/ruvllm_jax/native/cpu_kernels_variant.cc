// One ISA variant of ruvllm's CPU kernels (see cpu_kernels.h). The build compiles this file once per
// variant with that variant's -m flags and -DRUVLLM_VARIANT=<symbol>. Here: what every variant
// shares (the scalar loops, LoRA, the panel loops, the exported table) and, included, the attention
// kernels (cpu_kernels_attention.inc) and the one body of vector paths the ISA macros those flags
// define choose: cpu_kernels_avx512.inc, cpu_kernels_avx2.inc or cpu_kernels_neon.inc. Every variant
// falls back to the same scalar loops for what it has no vector path for. Functions have internal
// linkage and no std templates are instantiated here, so no code compiled for a wider ISA can leak
// into another variant.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#ifndef RUVLLM_VARIANT
#error "compile with -DRUVLLM_VARIANT=<variant symbol>"
#endif

// x86 vector paths. RUVLLM_WIDTH_256 keeps an AVX-512 VNNI build to 256-bit vectors (the avxvnni
// variant's code, EVEX-encoded, for CPUs with AVX-512 VNNI but not AVX-VNNI).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && !defined(RUVLLM_WIDTH_256)
#define RUVLLM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RUVLLM_AVX2 1
#if defined(__AVXVNNI__)
#define RUVLLM_DPBUSD256(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RUVLLM_DPBUSD256(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#endif
#endif

#define RUVLLM_CAT2(a, b) a##b
#define RUVLLM_CAT(a, b) RUVLLM_CAT2(a, b)
#define RUVLLM_STR2(a) #a
#define RUVLLM_STR(a) RUVLLM_STR2(a)

namespace {

using ruvllm::DecodeJob;
using ruvllm::GroupActs;
using ruvllm::GroupActsOut;
using ruvllm::GroupMatrix;
using ruvllm::KernelTable;
using ruvllm::KMatrix;
using ruvllm::LoraJob;
using ruvllm::PrefillJob;
using ruvllm::panel_byte;
using ruvllm::RowActs;
using ruvllm::RowMatrix;

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t f;
  if (exp == 0) {
    if (man == 0) {
      f = sign;
    } else {  // subnormal
      float v = ldexpf(static_cast<float>(man), -24);
      memcpy(&f, &v, 4);
      f |= sign;
    }
  } else if (exp == 31) {
    f = sign | 0x7F800000u | (man << 13);
  } else {
    f = sign | ((exp + 112) << 23) | (man << 13);
  }
  float out;
  memcpy(&out, &f, 4);
  return out;
}

// Group i's offset: stored, or (symmetric formats) -2^(bits - 1) d.
inline float group_offset(const GroupMatrix& w, int64_t i) {
  return w.mn != nullptr ? half_to_float(w.mn[i]) : ruvllm::symmetric_zero(w.bits) * half_to_float(w.d[i]);
}

// ---------------------------------------------------------------------------------------------------
// Scalar loops: the reference every vector path is tested against, and the fallback for shapes a
// vector path does not take.

inline void store_group(const GroupActsOut& o, int64_t m, int64_t g, float d, int32_t h0, int32_t h1) {
  const int64_t i = m * o.Gp + g, i16 = m * 2 * o.Gp + 2 * g;
  o.dx[i] = d;
  o.sx[i] = d * static_cast<float>(h0 + h1);
  o.isum[i] = h0 + h1;
  o.isum16[i16] = h0;
  o.isum16[i16 + 1] = h1;
  o.sx16[i16] = d * static_cast<float>(h0);
  o.sx16[i16 + 1] = d * static_cast<float>(h1);
}

void quantize_groups_scalar(const float* x, int64_t M, int64_t K, const GroupActsOut& o) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * 32;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(xg[j]));
      const float d = amax / 127.0f;
      int32_t half[2] = {0, 0};
      int8_t* qg = o.q + m * K + g * 32;
      for (int j = 0; j < 32; ++j) {
        float r = amax > 0.f ? nearbyintf(xg[j] / d) : 0.f;
        r = fminf(fmaxf(r, -127.f), 127.f);
        qg[j] = static_cast<int8_t>(r);
        half[j / 16] += qg[j];
      }
      store_group(o, m, g, d, half[0], half[1]);
    }
  }
}

void w8a8_scalar(const RowActs& x, const RowMatrix& w, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w.w + n * x.K;
    for (int64_t m = 0; m < x.M; ++m) {
      const int8_t* xr = x.q + m * x.Kp;
      int32_t s = 0;
      for (int64_t k = 0; k < x.K; ++k) s += static_cast<int32_t>(xr[k]) * static_cast<int32_t>(wr[k]);
      w.y[m * w.N + n] = (static_cast<float>(s) * x.scale[m]) * w.scale[n];
    }
  }
}

void group_scalar(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1) {
  const int64_t K = x.K, G = x.G;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < x.M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t p = 0;
        const int8_t* xq = x.q + m * K + g * 32;
        for (int j = 0; j < 32; ++j) {
          p += ruvllm::code_at(w.q, w.bits, false, n, g, j, G) * static_cast<int32_t>(xq[j]);
        }
        acc += half_to_float(w.d[n * G + g]) * x.dx[m * x.Gp + g] * static_cast<float>(p) +
               group_offset(w, n * G + g) * x.sx[m * x.Gp + g];
      }
      w.y[m * w.N + n] = acc;
    }
  }
}

void panel_scalar(const GroupActs& x, const GroupMatrix& w, int64_t p0, int64_t p1) {
  const int64_t G = x.G;
  for (int64_t n = p0 * 16; n < p1 * 16; ++n) {
    for (int64_t m = 0; m < x.M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t p = 0;
        const int8_t* xq = x.q + m * x.K + g * 32;
        for (int j = 0; j < 32; ++j) {
          p += ruvllm::code_at(w.q, w.bits, true, n, g, j, G) * static_cast<int32_t>(xq[j]);
        }
        const int64_t si = (n / 16) * 16 * G + g * 16 + n % 16;
        acc = fmaf(static_cast<float>(p), half_to_float(w.d[si]) * x.dx[m * x.Gp + g], acc);
        acc = fmaf(group_offset(w, si), x.sx[m * x.Gp + g], acc);
      }
      w.y[m * w.N + n] = acc;
    }
  }
}

// k-quants, panel layout (cpu_kernels.h, KMatrix): two half groups of 16 per group of 32.
void kpanel_scalar(const GroupActs& x, const KMatrix& w, int64_t p0, int64_t p1) {
  const int64_t G = x.G, SB = x.K / 256;
  for (int64_t n = p0 * 16; n < p1 * 16; ++n) {
    const int64_t P = n / 16, r = n % 16;
    for (int64_t m = 0; m < x.M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t p[2] = {0, 0};
        const int8_t* xq = x.q + m * x.K + g * 32;
        for (int j = 0; j < 32; ++j) {
          p[j / 16] += ruvllm::code_at(w.q, w.bits, true, n, g, j, G) * static_cast<int32_t>(xq[j]);
        }
        const float D = half_to_float(w.D[(P * SB + g / 8) * 16 + r]);
        const float Dm = w.Dm != nullptr ? half_to_float(w.Dm[(P * SB + g / 8) * 16 + r]) : D * ruvllm::ksym_zero(w.bits);
        const float dx = x.dx[m * x.Gp + g];
        if (w.sub == 32) {  // one scale and min for the group: its whole dot at once
          const int64_t k = ruvllm::ksub_at(w, P, G, g, 0) + r;
          const float dg = D * static_cast<float>(w.sc[k]);
          const float mg = Dm * static_cast<float>(ruvllm::kmins(w)[k]);
          acc = fmaf(static_cast<float>(p[0] + p[1]), dg * dx, acc);
          acc = fmaf(-mg, x.sx[m * x.Gp + g], acc);
          continue;
        }
        for (int h = 0; h < 2; ++h) {
          const int64_t k = ruvllm::ksub_at(w, P, G, g, h) + r;
          const float dh = D * static_cast<float>(w.sc[k]);
          const float mh = Dm * static_cast<float>(ruvllm::kmins(w)[k]);
          acc = fmaf(static_cast<float>(p[h]), dh * dx, acc);
          acc = fmaf(-mh, x.sx16[m * 2 * x.Gp + 2 * g + h], acc);
        }
      }
      w.y[m * w.N + n] = acc;
    }
  }
}

#include "cpu_kernels_attention.inc"

// LoRA (cpu_kernels.h, LoraJob): per token, the rank-R projection A_s x (dot products along IN), then
// y = sum_k tmp[k] * bt_s[k] (rows of OUT values): both loops vectorise.
void lora_rows(const LoraJob& j, int64_t t0, int64_t t1) {
  float tmp[ruvllm::kLoraMaxRank];
  for (int64_t t = t0; t < t1; ++t) {
    float* yt = j.y + t * j.OUT;
    for (int64_t o = 0; o < j.OUT; ++o) yt[o] = 0.f;
    const int64_t s = j.slot[t];
    if (s < 0 || (s + 1) * j.R > j.SR) continue;
    const float* xt = j.x + t * j.IN;
    const float* a = j.a + (j.layer * j.SR + s * j.R) * j.IN;
    const float* bt = j.bt + (j.layer * j.SR + s * j.R) * j.OUT;
    for (int64_t k = 0; k < j.R; ++k) {
      tmp[k] = dot_fixed(a + k * j.IN, xt, j.IN);  // one order whatever the alignment (see dot_fixed)
    }
    for (int64_t k = 0; k < j.R; ++k) {
      const float w = tmp[k];
      const float* bk = bt + k * j.OUT;
#pragma omp simd
      for (int64_t o = 0; o < j.OUT; ++o) yt[o] += w * bk[o];
    }
  }
}

// The variant's vector paths: one body per ISA family, each defining quantize_groups_vec, w8a8_vec,
// group_vec and, where it has panel kernels, panel_block / kpanel_block with RUVLLM_PANEL_MB and
// RUVLLM_KPANEL_MB for the panel loops below. The scalar variant uses the scalar loops throughout.
// aarch64's baseline has NEON, so there the scalar variant (the reference) is told apart by its name.
#define RUVLLM_SCALAR_VARIANT_scalar 1
#if RUVLLM_AVX512
#include "cpu_kernels_avx512.inc"
#elif RUVLLM_AVX2
#include "cpu_kernels_avx2.inc"
#elif defined(__aarch64__) && defined(__ARM_NEON) && !RUVLLM_CAT(RUVLLM_SCALAR_VARIANT_, RUVLLM_VARIANT)
#include "cpu_kernels_neon.inc"
#else
void quantize_groups_vec(const float* x, int64_t M, int64_t K, const GroupActsOut& o) {
  quantize_groups_scalar(x, M, K, o);
}
void w8a8_vec(const RowActs& x, const RowMatrix& w, int64_t n0, int64_t n1) { w8a8_scalar(x, w, n0, n1); }
void group_vec(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1) { group_scalar(x, w, n0, n1); }
#endif

#if defined(RUVLLM_PANEL_MB) && defined(RUVLLM_KPANEL_MB)
#ifdef RUVLLM_PANEL_UNPACK
// Blocks of activation rows after a panel's first (x86 vector variants): the panel's 4- to 6-bit
// codes unpacked once, one byte each, in the 8-bit panel layout (group g's codes 4t .. 4t+3 of the
// 16 rows at g * 512 + t * 64, codes 16+4t .. at g * 512 + (4 + t) * 64), so later blocks load them
// instead of unpacking them again. The buffer is the calling thread's, grown as needed (null if it
// cannot be: the caller then unpacks in place).
struct UnpackBuffer {
  uint8_t* p = nullptr;
  int64_t cap = 0;
  ~UnpackBuffer() { free(p); }
};

inline uint8_t* unpack_buffer(int64_t bytes) {
  static thread_local UnpackBuffer buf;
  if (bytes > buf.cap) {
    free(buf.p);
    buf.p = static_cast<uint8_t*>(aligned_alloc(64, static_cast<size_t>(bytes)));
    buf.cap = buf.p != nullptr ? bytes : 0;
  }
  return buf.p;
}

template <int BITS>
const uint8_t* unpack_panel(const uint8_t* q, int64_t G, int64_t p) {
  if constexpr (BITS == 8) {
    return nullptr;
  } else {
    const int64_t GB = ruvllm::group_bytes(BITS);
    uint8_t* out = unpack_buffer(G * 512);
    if (out == nullptr) return nullptr;
    const uint8_t* base = q + p * 16 * G * GB;
    for (int64_t g = 0; g < G; ++g) unpack_group<BITS>(base + g * GB * 16, out + g * 512);
    return out;
  }
}

// One block of MB activation rows against one panel, plain or k-quant (un: the panel's codes
// unpacked, where the variant does that; see unpack_buffer).
template <int BITS, int MB>
void block(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m, const uint8_t* un) {
  panel_block<BITS, MB>(x, w, p, m, un);
}
template <int BITS, int MB>
void block(const GroupActs& x, const KMatrix& w, int64_t p, int64_t m, const uint8_t* un) {
  kpanel_block<BITS, MB>(x, w, p, m, un);
}
#else  // no unpacking: every block reads the packed codes
template <int BITS>
const uint8_t* unpack_panel(const uint8_t*, int64_t, int64_t) { return nullptr; }
template <int BITS, int MB>
void block(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m, const uint8_t*) { panel_block<BITS, MB>(x, w, p, m); }
template <int BITS, int MB>
void block(const GroupActs& x, const KMatrix& w, int64_t p, int64_t m, const uint8_t*) { kpanel_block<BITS, MB>(x, w, p, m); }
#endif

// Whether a panel's codes are unpacked once for its blocks (a variant's k-quant kernels may read them
// packed every time: RUVLLM_KPANEL_NO_UNPACK).
inline bool unpacks(const GroupMatrix&) { return true; }
#ifdef RUVLLM_KPANEL_NO_UNPACK
inline bool unpacks(const KMatrix&) { return false; }
#else
inline bool unpacks(const KMatrix&) { return true; }
#endif

// The last block, of fewer than the widest number of rows.
template <int BITS, int MB, typename Mat>
void tail_block(const GroupActs& x, const Mat& w, int64_t p, int64_t m, int left, const uint8_t* un) {
  if constexpr (MB > 0) {
    if (left == MB) return block<BITS, MB>(x, w, p, m, un);
    tail_block<BITS, MB - 1>(x, w, p, m, left, un);
  }
}

// Blocks of MBMAX activation rows, then the rest in one smaller block. With more than one block the
// panel's codes are unpacked once first where the variant does that.
template <int BITS, int MBMAX, typename Mat>
void panel_blocks(const GroupActs& x, const Mat& w, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* un = x.M > MBMAX && unpacks(w) ? unpack_panel<BITS>(w.q, x.G, p) : nullptr;
    int64_t m = 0;
    for (; m + MBMAX <= x.M; m += MBMAX) block<BITS, MBMAX>(x, w, p, m, un);
    if (m < x.M) tail_block<BITS, MBMAX - 1>(x, w, p, m, static_cast<int>(x.M - m), un);
  }
}

template <int MBMAX, typename Mat>
void panels(const GroupActs& x, const Mat& w, int64_t p0, int64_t p1) {
  if (w.bits == 4) return panel_blocks<4, MBMAX>(x, w, p0, p1);
  if (w.bits == 5) return panel_blocks<5, MBMAX>(x, w, p0, p1);
  if (w.bits == 6) return panel_blocks<6, MBMAX>(x, w, p0, p1);
  return panel_blocks<8, MBMAX>(x, w, p0, p1);
}

void panel_vec(const GroupActs& x, const GroupMatrix& w, int64_t p0, int64_t p1) {
  panels<RUVLLM_PANEL_MB>(x, w, p0, p1);
}
void kpanel_vec(const GroupActs& x, const KMatrix& w, int64_t p0, int64_t p1) {
  panels<RUVLLM_KPANEL_MB>(x, w, p0, p1);
}
#else
void panel_vec(const GroupActs& x, const GroupMatrix& w, int64_t p0, int64_t p1) { panel_scalar(x, w, p0, p1); }
void kpanel_vec(const GroupActs& x, const KMatrix& w, int64_t p0, int64_t p1) { kpanel_scalar(x, w, p0, p1); }
#endif

#include "cpu_kernels_stored.inc"

// KernelTable.float_rows: plain loops, so each variant's flags vectorise the 16 lane sums (independent
// lanes: no reassociation) and every variant adds in the same order (-ffp-contract=off: no FMA).
void float_rows(const float* x, const float* w, float* y, int64_t T, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int kLanes = 16;
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * K;
    for (int64_t n = n0; n < n1; ++n) {
      const float* wr = w + n * K;
      float acc[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= K; i += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] += xr[i + l] * wr[i + l];
      for (int l = 0; i + l < K; ++l) acc[l] += xr[i + l] * wr[i + l];
      for (int h = kLanes / 2; h >= 1; h /= 2)
        for (int l = 0; l < h; ++l) acc[l] += acc[l + h];
      y[t * N + n] = acc[0];
    }
  }
}

const KernelTable kTable = {RUVLLM_STR(RUVLLM_VARIANT), quantize_groups_vec, w8a8_vec, group_vec, panel_vec,
                            kpanel_vec, decode_one, decode_part, prefill_tile, lora_rows, stored_rows, float_rows};

}  // namespace

extern "C" const ruvllm::KernelTable* RUVLLM_CAT(ruvllm_kernels_, RUVLLM_VARIANT)() { return &kTable; }
