// One ISA variant of ruvllm's CPU kernels (see cpu_kernels.h). The build compiles this file once per
// variant with that variant's -m flags and -DRUVLLM_VARIANT=<symbol>; the vector paths below are
// chosen by the ISA macros those flags define, and every variant falls back to the same scalar
// loops for what it has no vector path for. Functions have internal linkage and no std templates are
// instantiated here, so no code compiled for a wider ISA can leak into another variant.
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
        const float Dm = half_to_float(w.Dm[(P * SB + g / 8) * 16 + r]);
        const float dx = x.dx[m * x.Gp + g];
        for (int h = 0; h < 2; ++h) {
          const int64_t k = (P * 2 * G + 2 * g + h) * 16 + r;
          const float dh = D * static_cast<float>(w.sc[k]);
          const float mh = Dm * static_cast<float>(w.mn[k]);
          acc = fmaf(static_cast<float>(p[h]), dh * dx, acc);
          acc = fmaf(-mh, x.sx16[m * 2 * x.Gp + 2 * g + h], acc);
        }
      }
      w.y[m * w.N + n] = acc;
    }
  }
}

// exp(x) for x <= 0 (softmax weights) in a form every variant vectorises: 2^n * p(r) with
// x = n ln2 + r, |r| <= ln2 / 2, p a degree-7 Taylor polynomial (truncation below 5e-9 relative: what
// is left is float rounding, as in expf); below -87 it returns 0.
inline float exp_neg(float x) {
  const float xc = x < -87.f ? -87.f : x;
  const float n = floorf(xc * 1.44269504f + 0.5f);
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  memcpy(&bits, &e, sizeof bits);
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
}

// -- 16-bit K/V caches (cpu_kernels.h, KvType) ------------------------------------------------------

inline float bf16_to_float(uint16_t h) {
  const uint32_t f = static_cast<uint32_t>(h) << 16;
  float out;
  memcpy(&out, &f, 4);
  return out;
}

// n float16 (kv = kKvF16) or bfloat16 elements widened to float32: exact, so every variant reads the
// same floats a float32 cache would hold.
inline void widen_row(const uint16_t* src, float* dst, int64_t n, int kv) {
  int64_t i = 0;
#if RUVLLM_AVX512 || RUVLLM_AVX2
  if (kv == ruvllm::kKvF16) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  } else {
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = kv == ruvllm::kKvF16 ? half_to_float(src[i]) : bf16_to_float(src[i]);
}

// Element index of key t's row (sequence s's block table, kv head g) in a paged cache [L, NB, BS, KVH, D].
template <typename Job>
inline int64_t kv_index(const Job& j, int64_t s, int64_t g, int64_t t) {
  const int64_t blk = imin(imax(j.tables[s * j.Bd + t / j.BS], 0), j.NB - 1);
  return (((j.layer * j.NB + blk) * j.BS + t % j.BS) * j.KVH + g) * j.D;
}

// Elements d0 .. d0 + n of that row of the keys (values: of the values), in place from a float32
// cache, else widened into buf (n floats). KIND: whether the cache is float32 or 16-bit, fixed at
// compile time in the prefill loops (over a float32 cache they stay as they were) or asked (kAny).
enum class Kv { kF32, kWide, kAny };
template <Kv KIND = Kv::kAny, typename Job>
inline const float* kv_span(const Job& j, bool values, int64_t s, int64_t g, int64_t t, int64_t d0, int64_t n,
                            float* buf) {
  const int64_t i = kv_index(j, s, g, t) + d0;
  if (KIND == Kv::kF32 || (KIND == Kv::kAny && j.kv == ruvllm::kKvF32)) return (values ? j.v : j.k) + i;
  widen_row((values ? j.v16 : j.k16) + i, buf, n, j.kv);
  return buf;
}

// Decode attention (cpu_kernels.h, DecodeJob). Keys a .. b - 1 of sequence s, kv head g: per head hh
// of the group, stats[hh] = the largest score m, stats[group + hh] = l = sum of exp(score - m), and
// o[hh * D ..] = sum of exp(score - m) * value, not yet divided by l (an empty range: m = -inf, l = 0,
// o = 0). A task's keys split into ranges and merged (the FFI handler) give its attention as one
// range does. Rows kDecodeAhead keys ahead are prefetched: a block table scatters rows across the cache.
constexpr int64_t kDecodeAhead = 4;

// Prefetches key t + kDecodeAhead's row of the keys (values: of the values), if that key is before b.
inline void prefetch_ahead_row(const DecodeJob& j, bool values, int64_t s, int64_t g, int64_t t, int64_t b) {
  if (t + kDecodeAhead >= b) return;
  const int64_t i = kv_index(j, s, g, t + kDecodeAhead);
  const char* next = j.kv == ruvllm::kKvF32 ? reinterpret_cast<const char*>((values ? j.v : j.k) + i)
                                             : reinterpret_cast<const char*>((values ? j.v16 : j.k16) + i);
  const int64_t bytes = j.D * (j.kv == ruvllm::kKvF32 ? 4 : 2);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(next + off);
}

// p[hh * (b - a) + t - a] = scale * q_hh . k_t for keys a .. b - 1, each head hh of the group.
void decode_scores(const DecodeJob& j, int64_t s, int64_t g, int64_t a, int64_t b, float* p) {
  const int64_t group = j.H / j.KVH, D = j.D, n = b - a;
  const float* q = j.q + (s * j.H + g * group) * D;
  float buf[ruvllm::kMaxWidenedRow];
  for (int64_t t = a; t < b; ++t) {
    prefetch_ahead_row(j, false, s, g, t, b);
    const float* kr = kv_span(j, false, s, g, t, 0, D, buf);
    for (int64_t hh = 0; hh < group; ++hh) {
      const float* qh = q + hh * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qh[d] * kr[d];
      p[hh * n + t - a] = acc * j.scale;
    }
  }
}

// o[hh * D ..] += sum over keys a .. b - 1 of p[hh * (b - a) + t - a] * v_t.
void decode_values(const DecodeJob& j, int64_t s, int64_t g, int64_t a, int64_t b, const float* p, float* o) {
  const int64_t group = j.H / j.KVH, D = j.D, n = b - a;
  float buf[ruvllm::kMaxWidenedRow];
  for (int64_t t = a; t < b; ++t) {
    prefetch_ahead_row(j, true, s, g, t, b);
    const float* vr = kv_span(j, true, s, g, t, 0, D, buf);
    for (int64_t hh = 0; hh < group; ++hh) {
      const float wgt = p[hh * n + t - a];
      float* oh = o + hh * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) oh[d] += wgt * vr[d];
    }
  }
}

void decode_part(const DecodeJob& j, int64_t s, int64_t g, int64_t a, int64_t b, float* p, float* o, float* stats) {
  const int64_t group = j.H / j.KVH, n = b - a;
  float* mx = stats;
  float* sum = stats + group;
  for (int64_t i = 0; i < group * j.D; ++i) o[i] = 0.f;
  for (int64_t hh = 0; hh < group; ++hh) {
    mx[hh] = -INFINITY;
    sum[hh] = 0.f;
  }
  if (n <= 0) return;
  decode_scores(j, s, g, a, b, p);
  for (int64_t hh = 0; hh < group; ++hh) {
    float* ph = p + hh * n;
    float m = ph[0];
    for (int64_t t = 1; t < n; ++t) m = ph[t] > m ? ph[t] : m;
    float l = 0.f;
#pragma omp simd reduction(+ : l)
    for (int64_t t = 0; t < n; ++t) {
      ph[t] = exp_neg(ph[t] - m);
      l += ph[t];
    }
    mx[hh] = m;
    sum[hh] = l;
  }
  decode_values(j, s, g, a, b, p, o);
}

// All keys of sequence s, kv head g (first[s] .. context[s] - 1, clipped to the table): the
// weights normalised first (expf), then their sum over the values, the arithmetic this kernel has
// always had (greedy decodes that sit on a near-tie keep their tokens); decode_part is for ranges.
void decode_one(const DecodeJob& j, int64_t s, int64_t g, float* p) {
  const int64_t group = j.H / j.KVH;
  const int64_t end = imax(0, imin(j.context[s], j.Bd * j.BS));
  const int64_t t0 = imax(0, imin(j.first[s], end));
  const int64_t ctx = end - t0;  // keys t0 .. end - 1; p[hh * ctx + t - t0] their weights
  float* out = j.out + (s * j.H + g * group) * j.D;
  for (int64_t i = 0; i < group * j.D; ++i) out[i] = 0.f;
  if (ctx == 0) return;
  decode_scores(j, s, g, t0, end, p);
  for (int64_t hh = 0; hh < group; ++hh) {
    float* ph = p + hh * ctx;
    float mx = ph[0];
    for (int64_t t = 1; t < ctx; ++t) mx = ph[t] > mx ? ph[t] : mx;
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) {
      ph[t] = expf(ph[t] - mx);
      sum += ph[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < ctx; ++t) ph[t] *= inv;
  }
  decode_values(j, s, g, t0, end, p, out);
}

// Prompt-chunk attention (cpu_kernels.h, PrefillJob). Rows r = (query - q0) * group + head of the tile
// sit side by side (RP of them, a multiple of 16), so the inner loops run over rows or over the head
// dimension with compile-time trip counts and vectorise in every variant: scores[t][r] = q_r . k_t for
// KB keys at a time (each key row loaded once for the whole tile), the masked softmax per row, then
// out[r] += p[t][r] * v_t for RB rows and DC values of the head at a time, accumulated in registers.
#if RUVLLM_AVX512
constexpr int kScoreKeys = 4, kPvRows = 4, kPvCols = 64;
#else
constexpr int kScoreKeys = 2, kPvRows = 4, kPvCols = 16;
#endif

// st[t][r] = q_r . k_t for keys t0 .. t1 (all in the caller's block table), rows RP.
template <int RP, Kv KIND>
void prefill_scores(const PrefillJob& j, int64_t s, int64_t g, const float* qt, int64_t t0, int64_t t1,
                    int64_t tbase, float* sc) {
  const int64_t D = j.D;
  float buf[kScoreKeys][KIND == Kv::kF32 ? 1 : ruvllm::kMaxWidenedRow];  // 16-bit caches: the rows widened
  int64_t t = t0;
  for (; t + kScoreKeys <= t1; t += kScoreKeys) {
    const float* kr[kScoreKeys];
    for (int u = 0; u < kScoreKeys; ++u) kr[u] = kv_span<KIND>(j, false, s, g, t + u, 0, D, buf[u]);
    float acc[kScoreKeys][RP];
    for (int u = 0; u < kScoreKeys; ++u)
      for (int r = 0; r < RP; ++r) acc[u][r] = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float* qd = qt + d * RP;
      for (int u = 0; u < kScoreKeys; ++u) {
        const float x = kr[u][d];
#pragma omp simd
        for (int r = 0; r < RP; ++r) acc[u][r] += qd[r] * x;
      }
    }
    for (int u = 0; u < kScoreKeys; ++u)
      for (int r = 0; r < RP; ++r) sc[(t + u - tbase) * RP + r] = acc[u][r];
  }
  for (; t < t1; ++t) {
    const float* k0 = kv_span<KIND>(j, false, s, g, t, 0, D, buf[0]);
    float acc[RP];
    for (int r = 0; r < RP; ++r) acc[r] = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float* qd = qt + d * RP;
      const float x = k0[d];
#pragma omp simd
      for (int r = 0; r < RP; ++r) acc[r] += qd[r] * x;
    }
    for (int r = 0; r < RP; ++r) sc[(t - tbase) * RP + r] = acc[r];
  }
}

// acc[r][d0 .. d0 + DC) = sum_t w[t][r] v_t[d0 ..] for rows r0 .. r0 + RB.
template <int RB, int DC, Kv KIND>
void prefill_pv(const PrefillJob& j, int64_t s, int64_t g, const float* sc, int64_t RP, int64_t t0, int64_t t1,
                int64_t r0, int64_t d0, float* out) {
  float acc[RB][DC];
  for (int b = 0; b < RB; ++b)
    for (int c = 0; c < DC; ++c) acc[b][c] = 0.f;
  float buf[DC];
  for (int64_t t = t0; t < t1; ++t) {
    const float* vr = kv_span<KIND>(j, true, s, g, t, d0, DC, buf);
    const float* w = sc + (t - t0) * RP + r0;
    for (int b = 0; b < RB; ++b) {
      const float wb = w[b];
#pragma omp simd
      for (int c = 0; c < DC; ++c) acc[b][c] += wb * vr[c];
    }
  }
  for (int b = 0; b < RB; ++b)
    for (int c = 0; c < DC; ++c) out[(r0 + b) * j.D + d0 + c] = acc[b][c];
}

template <int RP, Kv KIND>
void prefill_rows(const PrefillJob& j, int64_t q0, int64_t q1, int64_t g, float* scratch, int64_t t0, int64_t end) {
  const int64_t group = j.H / j.KVH, D = j.D, R = (q1 - q0) * group, cap = j.Bd * j.BS;
  const int64_t L = end - t0, s = j.seq[q0];
  float* qt = scratch;          // [D][RP]: the tile's queries, transposed
  float* sc = qt + D * RP;      // [L][RP]: scores, then weights
  float* acc = sc + L * RP;     // [RP][D]: unnormalised outputs
  float* lo = acc + RP * D;     // [RP] first key of each row
  float* hi = lo + RP;          // [RP] end of each row's keys (0 for rows past the tile)
  float* mx = hi + RP;          // [RP]
  float* sum = mx + RP;         // [RP]
  for (int64_t r = 0; r < RP; ++r) {
    const int64_t i = q0 + r / group;
    const bool real = r < R;
    const int64_t e = real ? imax(0, imin(j.context[i], cap)) : 0;
    lo[r] = static_cast<float>(e ? imax(0, imin(j.first[i], e)) : 0);
    hi[r] = static_cast<float>(e);
    const float* qr = real ? j.q + (i * j.H + g * group + r % group) * D : nullptr;
    for (int64_t d = 0; d < D; ++d) qt[d * RP + r] = real ? qr[d] : 0.f;
  }
  prefill_scores<RP, KIND>(j, s, g, qt, t0, end, t0, sc);
  for (int64_t x = 0; x < L * RP; ++x) sc[x] *= j.scale;  // after the dot products, as decode does
  const float ft0 = static_cast<float>(t0);
  for (int64_t r = 0; r < RP; ++r) {
    mx[r] = -3.0e38f;
    sum[r] = 0.f;
  }
  for (int64_t t = 0; t < L; ++t) {
    const float ft = ft0 + static_cast<float>(t);
    const float* st = sc + t * RP;
#pragma omp simd
    for (int64_t r = 0; r < RP; ++r) mx[r] = (ft >= lo[r] && ft < hi[r] && st[r] > mx[r]) ? st[r] : mx[r];
  }
  for (int64_t t = 0; t < L; ++t) {
    const float ft = ft0 + static_cast<float>(t);
    float* st = sc + t * RP;
#pragma omp simd
    for (int64_t r = 0; r < RP; ++r) {
      const float w = (ft >= lo[r] && ft < hi[r]) ? exp_neg(st[r] - mx[r]) : 0.f;
      st[r] = w;
      sum[r] += w;
    }
  }
  for (int64_t r0 = 0; r0 < R; r0 += kPvRows) {  // RP is a multiple of kPvRows: rows past R are zeros
    int64_t d0 = 0;
    for (; d0 + kPvCols <= D; d0 += kPvCols)
      prefill_pv<kPvRows, kPvCols, KIND>(j, s, g, sc, RP, t0, end, r0, d0, acc);
    for (; d0 + 8 <= D; d0 += 8) prefill_pv<kPvRows, 8, KIND>(j, s, g, sc, RP, t0, end, r0, d0, acc);
    for (; d0 < D; ++d0) prefill_pv<kPvRows, 1, KIND>(j, s, g, sc, RP, t0, end, r0, d0, acc);
  }
  for (int64_t r = 0; r < R; ++r) {
    if (sum[r] == 0.f) continue;
    const float inv = 1.f / sum[r];
    float* o = j.out + ((q0 + r / group) * j.H + g * group + r % group) * D;
    const float* ar = acc + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] = ar[d] * inv;
  }
}

template <Kv KIND>
void prefill_rows_of(const PrefillJob& j, int64_t q0, int64_t q1, int64_t g, float* scratch, int64_t t0, int64_t end,
                     int64_t R) {
  if (R <= 16) return prefill_rows<16, KIND>(j, q0, q1, g, scratch, t0, end);
  if (R <= 32) return prefill_rows<32, KIND>(j, q0, q1, g, scratch, t0, end);
  prefill_rows<48, KIND>(j, q0, q1, g, scratch, t0, end);
}

void prefill_tile(const PrefillJob& j, int64_t q0, int64_t q1, int64_t g, float* scratch) {
  const int64_t group = j.H / j.KVH, R = (q1 - q0) * group, cap = j.Bd * j.BS;
  int64_t t0 = cap, end = 0;
  for (int64_t i = q0; i < q1; ++i) {
    const int64_t e = imax(0, imin(j.context[i], cap));
    if (e == 0) continue;
    t0 = imin(t0, imax(0, imin(j.first[i], e)));
    end = imax(end, e);
  }
  for (int64_t i = q0; i < q1; ++i) {
    float* o = j.out + (i * j.H + g * group) * j.D;
    for (int64_t x = 0; x < group * j.D; ++x) o[x] = 0.f;
  }
  if (end <= t0) return;
  if (j.kv != ruvllm::kKvF32) return prefill_rows_of<Kv::kWide>(j, q0, q1, g, scratch, t0, end, R);
  prefill_rows_of<Kv::kF32>(j, q0, q1, g, scratch, t0, end, R);
}

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
      const float* ak = a + k * j.IN;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < j.IN; ++i) acc += ak[i] * xt[i];
      tmp[k] = acc;
    }
    for (int64_t k = 0; k < j.R; ++k) {
      const float w = tmp[k];
      const float* bk = bt + k * j.OUT;
#pragma omp simd
      for (int64_t o = 0; o < j.OUT; ++o) yt[o] += w * bk[o];
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Blocks of activation rows after a panel's first (x86 vector variants): the panel's 4- to 6-bit
// codes unpacked once, one byte each, in the 8-bit panel layout (group g's codes 4t .. 4t+3 of the
// 16 rows at g * 512 + t * 64, codes 16+4t .. at g * 512 + (4 + t) * 64), so later blocks load them
// instead of unpacking them again. The buffer is the calling thread's, grown as needed (null if it
// cannot be: the caller then unpacks in place).
#if RUVLLM_AVX512 || RUVLLM_AVX2
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
#endif

#if RUVLLM_AVX512
// w8a8, 4 weight rows x MB activation rows. vpdpbusd multiplies unsigned by signed bytes: with
// a = q + 128, sum(a * w) = sum(q * w) + 128 * sum(w); the row sum of w comes from one more vpdpbusd
// against ones per weight load, shared by the block's activation rows.
template <int MB>
void w8a8_block4(const RowActs& x, const RowMatrix& w, int64_t n, int64_t m0) {
  constexpr int R = 4;
  const int64_t K = x.K, full = K / 64, tail = K - full * 64;
  const __mmask64 tmask = tail ? (~0ULL >> (64 - tail)) : 0;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[R][MB], rs[R];
  for (int r = 0; r < R; ++r) {
    rs[r] = _mm512_setzero_si512();
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_si512();
  }
  const int64_t chunks = full + (tail ? 1 : 0);
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i a[MB];
    for (int m = 0; m < MB; ++m) a[m] = _mm512_loadu_si512(x.a + (m0 + m) * x.Kp + c * 64);
    for (int r = 0; r < R; ++r) {
      const int8_t* wp = w.w + (n + r) * K + c * 64;
      const __m512i wv = c < full ? _mm512_loadu_si512(wp) : _mm512_maskz_loadu_epi8(tmask, wp);
      rs[r] = _mm512_dpbusd_epi32(rs[r], ones, wv);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_dpbusd_epi32(acc[r][m], a[m], wv);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int32_t corr = 128 * _mm512_reduce_add_epi32(rs[r]);
    for (int m = 0; m < MB; ++m) {
      const int32_t s = _mm512_reduce_add_epi32(acc[r][m]) - corr;
      w.y[(m0 + m) * w.N + n + r] = (static_cast<float>(s) * x.scale[m0 + m]) * w.scale[n + r];
    }
  }
}

void w8a8_vec(const RowActs& x, const RowMatrix& w, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t m = 0;
    for (; m + 4 <= x.M; m += 4) w8a8_block4<4>(x, w, n, m);
    switch (x.M - m) {
      case 3: w8a8_block4<3>(x, w, n, m); break;
      case 2: w8a8_block4<2>(x, w, n, m); break;
      case 1: w8a8_block4<1>(x, w, n, m); break;
      default: break;
    }
  }
  w8a8_scalar(x, w, n, n1);
}

// Row-major wxa8: two weight rows by MB activation rows; per chunk of 16 groups the scale products
// d * dx are formed once, then every pair of groups is one vpdpbusd per (row, activation row), its 16
// int32 lanes converted and scaled by the lanes' groups' factors (a permute of the chunk's products).
template <int BITS, int MB>
void group_block2(const GroupActs& x, const GroupMatrix& w, int64_t n, int64_t m0) {
  constexpr int R = 2;
  const int64_t K = x.K, G = x.G;
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  const int8_t* xbase = BITS == 4 ? x.q4 : x.q;
  __m512 facc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) facc[r][m] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t c = 0; c < G; c += 16) {
    const int64_t gc = imin(16, G - c);
    const __mmask16 gm = static_cast<__mmask16>((1u << gc) - 1u);
    __m512 sc[R][MB];
    for (int r = 0; r < R; ++r) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, w.d + (n + r) * G + c));
      const __m512 mv = w.mn != nullptr ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, w.mn + (n + r) * G + c))
                                          : _mm512_mul_ps(dv, _mm512_set1_ps(ruvllm::symmetric_zero(w.bits)));
      for (int m = 0; m < MB; ++m) {
        const __m512 dxv = _mm512_loadu_ps(x.dx + (m0 + m) * x.Gp + c);
        const __m512 sxv = _mm512_loadu_ps(x.sx + (m0 + m) * x.Gp + c);
        sc[r][m] = _mm512_mul_ps(dv, dxv);
        facc[r][m] = _mm512_fmadd_ps(mv, sxv, facc[r][m]);
      }
    }
    for (int64_t p = 0; p < gc; p += 2) {
      const int a = static_cast<int>(p), b = a + 1;
      const __m512i idx = BITS == 4 ? _mm512_setr_epi32(a, a, a, a, b, b, b, b, a, a, a, a, b, b, b, b)
                                    : _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
      const int64_t g = c + p;
      __m512i z[R];
      for (int r = 0; r < R; ++r) {
        if (BITS == 4) {
          const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + (n + r) * row_bytes + g * 16));
          const __m256i lo = _mm256_and_si256(y, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(y, 4), low4);
          z[r] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        } else {
          z[r] = _mm512_loadu_si512(w.q + (n + r) * row_bytes + g * 32);
        }
      }
      for (int m = 0; m < MB; ++m) {
        const __m512i xv = _mm512_loadu_si512(xbase + (m0 + m) * K + g * 32);
        for (int r = 0; r < R; ++r) {
          const __m512 pf = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, z[r], xv));
          facc[r][m] = _mm512_fmadd_ps(pf, _mm512_permutexvar_ps(idx, sc[r][m]), facc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) w.y[(m0 + m) * w.N + n + r] = _mm512_reduce_add_ps(facc[r][m]);
}

template <int BITS>
void group_rows_bits(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    int64_t m = 0;
    for (; m + 4 <= x.M; m += 4) group_block2<BITS, 4>(x, w, n, m);
    switch (x.M - m) {
      case 3: group_block2<BITS, 3>(x, w, n, m); break;
      case 2: group_block2<BITS, 2>(x, w, n, m); break;
      case 1: group_block2<BITS, 1>(x, w, n, m); break;
      default: break;
    }
  }
  group_scalar(x, w, n, n1);
}

void group_vec(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1) {
  if (x.G % 2 != 0 || w.bits == 5 || w.bits == 6 || (w.bits == 4 && x.q4 == nullptr))
    return group_scalar(x, w, n0, n1);
  if (w.bits == 4) return group_rows_bits<4>(x, w, n0, n1);
  return group_rows_bits<8>(x, w, n0, n1);
}

// v | (bit `from` of every byte of h moved to bit `to`): a byte test into a mask, then a masked add of
// bit `to`, which no caller has set yet (the nibbles hold bits 0-3).
inline __m512i or_bit_512(__m512i v, __m512i h, int from, int to) {
  const __mmask64 k = _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(1 << from)));
  return _mm512_mask_add_epi8(v, k, v, _mm512_set1_epi8(static_cast<char>(1 << to)));
}

// v | (bits 2t and 2t + 1 of every byte of h moved to bits 4 and 5): one shift, and one ternary
// logic op for the mask and the or (A | (B & C) is 0xF8).
inline __m512i or_pair_512(__m512i v, __m512i h, int t) {
  const __m512i s = t < 2 ? _mm512_slli_epi16(h, 4 - 2 * t) : t > 2 ? _mm512_srli_epi16(h, 2 * t - 4) : h;
  return _mm512_ternarylogic_epi32(v, s, _mm512_set1_epi8(0x30), 0xF8);
}

// Codes 4t .. 4t+3 (lo) and 16+4t .. 16+4t+3 (hi) of the 16 rows of a 4-, 5- or 6-bit panel group:
// the nibbles; 5-bit: bit 4 from bit t (lo) or 4 + t (hi) of the plane's bytes; 6-bit: bits 4 and 5
// from bits 2t and 2t + 1 of the lower (lo) or upper (hi) pairs' bytes (cpu_kernels.h).
template <int BITS>
inline void nibble_codes_512(const uint8_t* gp, int t, __m512i& lo, __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i z = _mm512_loadu_si512(gp + t * 64);
  lo = _mm512_and_si512(z, low4);
  hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);
  if constexpr (BITS == 5) {
    const __m512i h = _mm512_loadu_si512(gp + 256);
    lo = or_bit_512(lo, h, t, 4);
    hi = or_bit_512(hi, h, 4 + t, 4);
  } else if constexpr (BITS == 6) {
    lo = or_pair_512(lo, _mm512_loadu_si512(gp + 256), t);
    hi = or_pair_512(hi, _mm512_loadu_si512(gp + 320), t);
  }
}

// The 8 registers of one group's codes (codes 4t .. 4t+3 of the 16 rows in register t, 16+4t .. in
// 4 + t): loaded from the unpacked panel (UN, see unpack_buffer), or unpacked from its bytes gp.
template <int BITS, bool UN>
inline void group_codes_512(const uint8_t* gp, const uint8_t* ug, __m512i* wv) {
  if (BITS == 8 || UN) {
    const uint8_t* src = BITS == 8 ? gp : ug;
    for (int t = 0; t < 8; ++t) wv[t] = _mm512_loadu_si512(src + t * 64);
  } else {
    for (int t = 0; t < 4; ++t) nibble_codes_512<BITS>(gp, t, wv[t], wv[4 + t]);
  }
}

// One group of a panel's 4- to 6-bit codes unpacked to one byte each (see unpack_buffer).
#define RUVLLM_PANEL_UNPACK 1
template <int BITS>
inline void unpack_group(const uint8_t* gp, uint8_t* out) {
  __m512i wv[8];
  group_codes_512<BITS, false>(gp, nullptr, wv);
  for (int t = 0; t < 8; ++t) _mm512_store_si512(out + t * 64, wv[t]);
}

// Panel layout: one vpdpbusd forms four products for each of the 16 rows against a broadcast dword
// of the activations; each output is a sequential sum over groups (the scalar loop's float
// operations in the scalar loop's order).
template <int BITS, int MB, bool UN>
void panel_block_512(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m0, const uint8_t* un) {
  const int64_t G = x.G, K = x.K;
  constexpr int64_t GB = BITS == 4 ? 16 : BITS == 5 ? 20 : BITS == 6 ? 24 : 32;  // code bytes per row and group
  const uint8_t* base = w.q + p * 16 * G * GB;
  const uint16_t* dp = w.d + p * 16 * G;
  const uint16_t* mp = w.mn != nullptr ? w.mn + p * 16 * G : nullptr;
  __m512 facc[MB];
  for (int m = 0; m < MB; ++m) facc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = base + g * GB * 16;
    __m512i wv[8];
    group_codes_512<BITS, UN>(gp, UN ? un + g * 512 : nullptr, wv);
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dp + g * 16)));
    const __m512 mv = mp != nullptr ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mp + g * 16)))
                                    : _mm512_mul_ps(dv, _mm512_set1_ps(ruvllm::symmetric_zero(BITS)));
    // The activation rows interleaved: MB independent accumulation chains keep the dot-product
    // units busy (one chain of 8 dependent vpdpbusd would wait on their latency).
    __m512i acc[MB];
    const int32_t* xd[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_setzero_si512();
      xd[m] = reinterpret_cast<const int32_t*>(x.q + (m0 + m) * K + g * 32);
    }
    if constexpr (MB == 1) {  // one row: four chains of two, summed (integer sums: exact in any order)
      __m512i a4[4];
      for (int t = 0; t < 4; ++t) a4[t] = _mm512_dpbusd_epi32(acc[0], wv[t], _mm512_set1_epi32(xd[0][t]));
      for (int t = 4; t < 8; ++t) a4[t - 4] = _mm512_dpbusd_epi32(a4[t - 4], wv[t], _mm512_set1_epi32(xd[0][t]));
      acc[0] = _mm512_add_epi32(_mm512_add_epi32(a4[0], a4[1]), _mm512_add_epi32(a4[2], a4[3]));
    } else {
      for (int t = 0; t < 8; ++t)
        for (int m = 0; m < MB; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], wv[t], _mm512_set1_epi32(xd[m][t]));
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(x.dx[(m0 + m) * x.Gp + g]));
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), s, facc[m]);
      facc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.sx[(m0 + m) * x.Gp + g]), facc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(w.y + (m0 + m) * w.N + p * 16, facc[m]);
}
template <int BITS, int MB>
void panel_block(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m0, const uint8_t* un) {
  if (un != nullptr) return panel_block_512<BITS, MB, true>(x, w, p, m0, un);
  panel_block_512<BITS, MB, false>(x, w, p, m0, un);
}
#define RUVLLM_PANEL_MB 8

// k-quants: the panel kernel's products, one accumulator per half group, then the two-level factors
// (cpu_kernels.h, KMatrix) formed per half group for the 16 rows.
template <int BITS, int MB, bool UN>
void kpanel_block_512(const GroupActs& x, const KMatrix& w, int64_t p, int64_t m0, const uint8_t* un) {
  const int64_t G = x.G, K = x.K, SB = K / 256;
  constexpr int64_t GB = BITS == 4 ? 16 : BITS == 5 ? 20 : BITS == 6 ? 24 : 32;
  const uint8_t* base = w.q + p * 16 * G * GB;
  __m512 facc[MB];
  for (int m = 0; m < MB; ++m) facc[m] = _mm512_setzero_ps();
  __m512 Dv = _mm512_setzero_ps(), Dmv = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (g % 8 == 0) {
      Dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.D + (p * SB + g / 8) * 16)));
      Dmv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.Dm + (p * SB + g / 8) * 16)));
    }
    const uint8_t* gp = base + g * GB * 16;
    __m512i wv[8];
    group_codes_512<BITS, UN>(gp, UN ? un + g * 512 : nullptr, wv);
    __m512i acc[2][MB];
    const int32_t* xd[MB];
    for (int m = 0; m < MB; ++m) {
      acc[0][m] = acc[1][m] = _mm512_setzero_si512();
      xd[m] = reinterpret_cast<const int32_t*>(x.q + (m0 + m) * K + g * 32);
    }
    if constexpr (MB == 1) {  // one row: each half group's four products as two chains of two, summed
      for (int h = 0; h < 2; ++h) {
        __m512i a2[2];
        for (int t = 0; t < 2; ++t) a2[t] = _mm512_dpbusd_epi32(acc[h][0], wv[4 * h + t], _mm512_set1_epi32(xd[0][4 * h + t]));
        for (int t = 2; t < 4; ++t)
          a2[t - 2] = _mm512_dpbusd_epi32(a2[t - 2], wv[4 * h + t], _mm512_set1_epi32(xd[0][4 * h + t]));
        acc[h][0] = _mm512_add_epi32(a2[0], a2[1]);
      }
    } else {
      for (int t = 0; t < 8; ++t)
        for (int m = 0; m < MB; ++m)
          acc[t / 4][m] = _mm512_dpbusd_epi32(acc[t / 4][m], wv[t], _mm512_set1_epi32(xd[m][t]));
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t k = (p * 2 * G + 2 * g + h) * 16;
      const __m512 scv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + k))));
      const __m512 mnv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mn + k))));
      const __m512 dh = _mm512_mul_ps(Dv, scv), mh = _mm512_mul_ps(Dmv, mnv);
      for (int m = 0; m < MB; ++m) {
        const __m512 s = _mm512_mul_ps(dh, _mm512_set1_ps(x.dx[(m0 + m) * x.Gp + g]));
        facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h][m]), s, facc[m]);
        facc[m] = _mm512_fnmadd_ps(mh, _mm512_set1_ps(x.sx16[(m0 + m) * 2 * x.Gp + 2 * g + h]), facc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(w.y + (m0 + m) * w.N + p * 16, facc[m]);
}
template <int BITS, int MB>
void kpanel_block(const GroupActs& x, const KMatrix& w, int64_t p, int64_t m0, const uint8_t* un) {
  if (un != nullptr) return kpanel_block_512<BITS, MB, true>(x, w, p, m0, un);
  kpanel_block_512<BITS, MB, false>(x, w, p, m0, un);
}
// 4, not 8: two integer accumulators per row plus a float one and the 8 code registers would be 32
// zmm registers at 8 rows, and spill (bench_kernels.py, 128 rows on a Zen 4: Q4_K 2.3x, Q6_K 2.0x).
#define RUVLLM_KPANEL_MB 4

// Activation quantization, 16 lanes at a time: division and round-to-nearest-even as the scalar
// loop's, so the same codes.
void quantize_groups_vec(const float* x, int64_t M, int64_t K, const GroupActsOut& o) {
  const int64_t G = K / 32;
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * 32;
      const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float d = amax / 127.0f;
      int8_t* qg = o.q + m * K + g * 32;
      if (!(amax > 0.f)) {
        memset(qg, 0, 32);
        store_group(o, m, g, d, 0, 0);
        continue;
      }
      const __m512 dv = _mm512_set1_ps(d);
      const __m512i ia = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(
          _mm512_roundscale_ps(_mm512_div_ps(a, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi));
      const __m512i ib = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(
          _mm512_roundscale_ps(_mm512_div_ps(b, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qg), _mm512_cvtsepi32_epi8(ia));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + 16), _mm512_cvtsepi32_epi8(ib));
      store_group(o, m, g, d, _mm512_reduce_add_epi32(ia), _mm512_reduce_add_epi32(ib));
    }
  }
}

#elif RUVLLM_AVX2
// 256-bit paths: AVX2 multiplies bytes with vpmaddubsw (unsigned x signed, pairs summed to int16)
// and vpmaddwd against ones (pairs of int16 summed to int32), four products per int32 lane as one
// vpdpbusd does; with AVX-VNNI (or AVX-512 VNNI at 256 bits) it is one vpdpbusd.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#ifdef RUVLLM_DPBUSD256
  return RUVLLM_DPBUSD256(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Products of unsigned codes up to 255 with signed activations. vpmaddubsw saturates a pair's sum at
// 32767 (255 * 127 * 2 does not fit), so AVX2 multiplies the signed codes c - 128 instead, as
// |c - 128| times the activation with the code's sign, and the caller adds 128 * sum(activations).
inline __m256i dot4_u8(__m256i acc, __m256i codes, __m256i s) {
#ifdef RUVLLM_DPBUSD256
  return RUVLLM_DPBUSD256(acc, codes, s);
#else
  const __m256i c = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));
  return dot4(acc, _mm256_sign_epi8(c, c), _mm256_sign_epi8(s, c));
#endif
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Bit `from` of every byte moved to bit `to` and nothing else kept: 16-bit shifts, whose bits
// crossing a byte boundary the mask drops.
inline __m256i bit_to_256(__m256i v, int from, int to) {
  const __m256i s = from < to ? _mm256_slli_epi16(v, to - from) : from > to ? _mm256_srli_epi16(v, from - to) : v;
  return _mm256_and_si256(s, _mm256_set1_epi8(static_cast<char>(1 << to)));
}

// Software prefetch kPrefetchAhead bytes ahead of a panel group's 4- to 6-bit codes, in the 256-bit
// kernels' single pass over a panel (activation rows no more than a block: decode). The hardware
// prefetcher alone left these kernels, heavier in instructions per byte than the 512-bit ones, short
// of the memory bandwidth: on a 2-core Zen 4 VM, in one process alternating with and without, a
// Gemma-3-270M decode step took 9.6-10.2 ms with AVX2 against 10.6 without (9.7 against 10.3 with
// the AVX-VNNI build) at 4096 bytes, 10.0-10.3 at 1024 and 8192. The 8-bit kernels (the LM head,
// bandwidth-bound already) and the AVX-512 ones were a little slower with it, so have none.
constexpr int64_t kPrefetchAhead = 4096;

template <int64_t BYTES>
inline void prefetch_ahead(const uint8_t* p) {
  for (int64_t o = 0; o < BYTES; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead + o), _MM_HINT_T0);
}

// Bits 2t and 2t + 1 of every byte moved to bits 4 and 5 and nothing else kept (t = 0..3).
inline __m256i pair_to_256(__m256i v, int t) {
  const __m256i s = t < 2 ? _mm256_slli_epi16(v, 4 - 2 * t) : t > 2 ? _mm256_srli_epi16(v, 2 * t - 4) : v;
  return _mm256_and_si256(s, _mm256_set1_epi8(0x30));
}

// w8a8, 4 weight rows x MB activation rows; signed x signed as |w| times x with w's sign (weights
// are in [-127, 127], so |w| fits a byte and no pair sum saturates).
template <int MB>
void w8a8_block4(const RowActs& x, const RowMatrix& w, int64_t n, int64_t m0) {
  constexpr int R = 4;
  const int64_t K = x.K, full = K / 32;
  __m256i acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_si256();
  for (int64_t c = 0; c < full; ++c) {
    __m256i a[MB];
    for (int m = 0; m < MB; ++m)
      a[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m0 + m) * x.Kp + c * 32));
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.w + (n + r) * K + c * 32));
      const __m256i aw = _mm256_sign_epi8(wv, wv);
      for (int m = 0; m < MB; ++m) acc[r][m] = dot4(acc[r][m], aw, _mm256_sign_epi8(a[m], wv));
    }
  }
  for (int r = 0; r < R; ++r) {
    const int8_t* wr = w.w + (n + r) * K;
    for (int m = 0; m < MB; ++m) {
      const int8_t* xr = x.q + (m0 + m) * x.Kp;
      int32_t s = hsum_epi32(acc[r][m]);
      for (int64_t k = full * 32; k < K; ++k) s += static_cast<int32_t>(xr[k]) * static_cast<int32_t>(wr[k]);
      w.y[(m0 + m) * w.N + n + r] = (static_cast<float>(s) * x.scale[m0 + m]) * w.scale[n + r];
    }
  }
}

void w8a8_vec(const RowActs& x, const RowMatrix& w, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t m = 0;
    for (; m + 2 <= x.M; m += 2) w8a8_block4<2>(x, w, n, m);
    if (m < x.M) w8a8_block4<1>(x, w, n, m);
  }
  w8a8_scalar(x, w, n, n1);
}

void group_vec(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1) { group_scalar(x, w, n0, n1); }

// 8-bit codes (Q8_0 as unsigned code + 128), panel layout: 16 rows as two halves of 8 int32 lanes,
// MB activation rows; each broadcast activation dword serves both halves (the 4- to 6-bit codes
// use panel_block_256 below).
template <int MB>
void panel_block_8(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m0) {
  const int64_t G = x.G, K = x.K;
  constexpr int64_t GB = 32;
  const uint8_t* base = w.q + p * 16 * G * GB;
  const uint16_t* dp = w.d + p * 16 * G;
  const uint16_t* mp = w.mn != nullptr ? w.mn + p * 16 * G : nullptr;
  __m256 facc[MB][2];
  for (int m = 0; m < MB; ++m) facc[m][0] = facc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = base + g * GB * 16;
    __m256i acc[MB][2];
    const int32_t* xd[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m][0] = acc[m][1] = _mm256_setzero_si256();
      xd[m] = reinterpret_cast<const int32_t*>(x.q + (m0 + m) * K + g * 32);
    }
    for (int t = 0; t < 8; ++t) {
      for (int h = 0; h < 2; ++h) {
        const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + t * 64 + h * 32));
        for (int m = 0; m < MB; ++m) acc[m][h] = dot4_u8(acc[m][h], z, _mm256_set1_epi32(xd[m][t]));
      }
    }
#ifndef RUVLLM_DPBUSD256
    for (int m = 0; m < MB; ++m) {
      const __m256i corr = _mm256_set1_epi32(128 * x.isum[(m0 + m) * x.Gp + g]);
      acc[m][0] = _mm256_add_epi32(acc[m][0], corr);
      acc[m][1] = _mm256_add_epi32(acc[m][1], corr);
    }
#endif
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + g * 16 + h * 8)));
      const __m256 mv = mp != nullptr
                            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp + g * 16 + h * 8)))
                            : _mm256_mul_ps(dv, _mm256_set1_ps(ruvllm::symmetric_zero(8)));
      for (int m = 0; m < MB; ++m) {
        const __m256 s = _mm256_mul_ps(dv, _mm256_set1_ps(x.dx[(m0 + m) * x.Gp + g]));
        facc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][h]), s, facc[m][h]);
        facc[m][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.sx[(m0 + m) * x.Gp + g]), facc[m][h]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm256_storeu_ps(w.y + (m0 + m) * w.N + p * 16, facc[m][0]);
    _mm256_storeu_ps(w.y + (m0 + m) * w.N + p * 16 + 8, facc[m][1]);
  }
}

// k-quants with 8-bit codes at 256 bits (see the AVX-512 kpanel_block): rows in two halves of 8, one
// accumulator per half group of 16 codes (4- to 6-bit codes use kpanel_block_256 below).
template <int MB>
void kpanel_block_8(const GroupActs& x, const KMatrix& w, int64_t p, int64_t m0) {
  const int64_t G = x.G, K = x.K, SB = K / 256;
  constexpr int64_t GB = 32;
  const uint8_t* base = w.q + p * 16 * G * GB;
  __m256 facc[MB][2];
  for (int m = 0; m < MB; ++m) facc[m][0] = facc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = base + g * GB * 16;
    const int32_t* xd[MB];
    for (int m = 0; m < MB; ++m) xd[m] = reinterpret_cast<const int32_t*>(x.q + (m0 + m) * K + g * 32);
    for (int r = 0; r < 2; ++r) {  // rows 8r .. 8r+7
      __m256i acc[2][MB];
      for (int m = 0; m < MB; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + t * 64 + r * 32));
        for (int m = 0; m < MB; ++m) acc[t / 4][m] = dot4_u8(acc[t / 4][m], z, _mm256_set1_epi32(xd[m][t]));
      }
#ifndef RUVLLM_DPBUSD256
      for (int m = 0; m < MB; ++m)
        for (int h = 0; h < 2; ++h)
          acc[h][m] = _mm256_add_epi32(acc[h][m], _mm256_set1_epi32(128 * x.isum16[(m0 + m) * 2 * x.Gp + 2 * g + h]));
#endif
      const __m256 Dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.D + (p * SB + g / 8) * 16 + r * 8)));
      const __m256 Dmv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.Dm + (p * SB + g / 8) * 16 + r * 8)));
      for (int h = 0; h < 2; ++h) {
        const int64_t k = (p * 2 * G + 2 * g + h) * 16 + r * 8;
        const __m256 scv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + k))));
        const __m256 mnv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.mn + k))));
        const __m256 dh = _mm256_mul_ps(Dv, scv), mh = _mm256_mul_ps(Dmv, mnv);
        for (int m = 0; m < MB; ++m) {
          const __m256 s = _mm256_mul_ps(dh, _mm256_set1_ps(x.dx[(m0 + m) * x.Gp + g]));
          facc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[h][m]), s, facc[m][r]);
          facc[m][r] = _mm256_fnmadd_ps(mh, _mm256_set1_ps(x.sx16[(m0 + m) * 2 * x.Gp + 2 * g + h]), facc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm256_storeu_ps(w.y + (m0 + m) * w.N + p * 16, facc[m][0]);
    _mm256_storeu_ps(w.y + (m0 + m) * w.N + p * 16 + 8, facc[m][1]);
  }
}

// AVX2 without VNNI: codes below 64 times activations in [-127, 127] make vpmaddubsw pair sums of at
// most 2 * 127 * (2^BITS - 1), so F = 32767 / that many of them (8 for 4-bit codes, 4 for 5-bit, 2
// for 6-bit) add up in int16 lanes without overflow before one vpmaddwd widens them to int32: the
// same exact integer dot products for fewer multiplies. The kernels below take rows in halves of 8
// for the whole panel (fewer accumulators live at a time) and unpack the codes of each half group
// of 16 on their own.
template <int BITS>
constexpr int kI16Sums = 32767 / (2 * 127 * ((1 << BITS) - 1));

// Codes 4t .. 4t+3 (upper: 16+4t ..) of the 8 rows of half r of a 4-, 5- or 6-bit panel group (the
// high bits' layout: cpu_kernels.h).
template <int BITS>
inline __m256i half_codes_256(const uint8_t* gp, int t, int r, bool upper) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + t * 64 + r * 32));
  const __m256i c = upper ? _mm256_and_si256(_mm256_srli_epi16(z, 4), low4) : _mm256_and_si256(z, low4);
  if constexpr (BITS == 5) {  // bit 4: bit t (upper: 4 + t) of the plane's bytes (cpu_kernels.h)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 256 + r * 32));
    return _mm256_or_si256(c, bit_to_256(h, t + (upper ? 4 : 0), 4));
  } else if constexpr (BITS == 6) {  // bits 4 and 5: bits 2t, 2t + 1 of the lower (upper) pairs' bytes
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 256 + (upper ? 64 : 0) + r * 32));
    return _mm256_or_si256(c, pair_to_256(h, t));
  }
  return c;
}

// One group of a panel's 4- to 6-bit codes unpacked to one byte each (see unpack_buffer).
#define RUVLLM_PANEL_UNPACK 1
template <int BITS>
inline void unpack_group(const uint8_t* gp, uint8_t* out) {
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int r = 0; r < 2; ++r)
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + (4 * h + t) * 64 + r * 32), half_codes_256<BITS>(gp, t, r, h == 1));
}

// Codes 4t .. 4t+3 (h = 1: 16+4t ..) of the 8 rows of half r of group g: from the unpacked panel
// (UN), or unpacked from the group's bytes gp.
template <int BITS, bool UN>
inline __m256i unpacked_or_codes(const uint8_t* un, const uint8_t* gp, int64_t g, int t, int r, int h) {
  if constexpr (UN) return _mm256_load_si256(reinterpret_cast<const __m256i*>(un + g * 512 + (4 * h + t) * 64 + r * 32));
  else return half_codes_256<BITS>(gp, t, r, h == 1);
}

// The integer dot product of 4 dwords of codes (c) with the activation dwords xd[0..3], added to acc.
// SPLIT (one activation row, no other chain to interleave): with vpdpbusd, two chains of two summed
// instead of one of four (integer sums, so the same result).
template <int BITS, bool SPLIT = false>
inline __m256i dots4_256(const __m256i* c, const int32_t* xd, __m256i acc) {
#ifdef RUVLLM_DPBUSD256
  if constexpr (SPLIT) {
    __m256i b = RUVLLM_DPBUSD256(_mm256_setzero_si256(), c[1], _mm256_set1_epi32(xd[1]));
    acc = RUVLLM_DPBUSD256(acc, c[0], _mm256_set1_epi32(xd[0]));
    b = RUVLLM_DPBUSD256(b, c[3], _mm256_set1_epi32(xd[3]));
    acc = RUVLLM_DPBUSD256(acc, c[2], _mm256_set1_epi32(xd[2]));
    return _mm256_add_epi32(acc, b);
  }
  for (int t = 0; t < 4; ++t) acc = RUVLLM_DPBUSD256(acc, c[t], _mm256_set1_epi32(xd[t]));
#else
  constexpr int F = kI16Sums<BITS>;
  static_assert(F >= 2, "pair sums of these codes do not fit int16 twice");
  __m256i a16 = _mm256_setzero_si256();
  for (int t = 0; t < 4; ++t) {
    const __m256i d = _mm256_maddubs_epi16(c[t], _mm256_set1_epi32(xd[t]));
    a16 = t % F == 0 ? d : _mm256_add_epi16(a16, d);
    if (t % F == F - 1 || t == 3) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(a16, _mm256_set1_epi16(1)));
  }
#endif
  return acc;
}

// Plain groups: the codes of each half group unpacked once for the block's activation rows, whose
// two half sums meet in one int32 accumulator per row before the group's float multiply-adds.
template <int BITS, int MB, bool UN>
void panel_block_256(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m0, const uint8_t* un) {
  const int64_t G = x.G, K = x.K;
  constexpr int64_t GB = BITS == 4 ? 16 : BITS == 5 ? 20 : 24;
  const uint8_t* base = w.q + p * 16 * G * GB;
  const uint16_t* dp = w.d + p * 16 * G;
  const uint16_t* mp = w.mn != nullptr ? w.mn + p * 16 * G : nullptr;
  for (int r = 0; r < 2; ++r) {
    __m256 facc[MB];
    for (int m = 0; m < MB; ++m) facc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* gp = base + g * GB * 16;
      if (!UN && r == 0) prefetch_ahead<GB * 16>(gp);  // the second half reads the lines the first brought in
      __m256i acc[MB];
      for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        __m256i c[4];
        for (int t = 0; t < 4; ++t) c[t] = unpacked_or_codes<BITS, UN>(un, gp, g, t, r, h);
        for (int m = 0; m < MB; ++m)
          acc[m] = dots4_256<BITS>(c, reinterpret_cast<const int32_t*>(x.q + (m0 + m) * K + g * 32) + 4 * h, acc[m]);
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + g * 16 + r * 8)));
      const __m256 mv = mp != nullptr
                            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp + g * 16 + r * 8)))
                            : _mm256_mul_ps(dv, _mm256_set1_ps(ruvllm::symmetric_zero(BITS)));
      for (int m = 0; m < MB; ++m) {
        const __m256 s = _mm256_mul_ps(dv, _mm256_set1_ps(x.dx[(m0 + m) * x.Gp + g]));
        facc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), s, facc[m]);
        facc[m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.sx[(m0 + m) * x.Gp + g]), facc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) _mm256_storeu_ps(w.y + (m0 + m) * w.N + p * 16 + r * 8, facc[m]);
  }
}

// k-quants: per half group, the 8 rows' codes are unpacked once (four registers) and then reused by
// every activation row, whose integer dot product goes straight into its float accumulator (only
// those stay live across groups, so MB can be 6).
template <int BITS, int MB, bool UN>
void kpanel_block_256(const GroupActs& x, const KMatrix& w, int64_t p, int64_t m0, const uint8_t* un) {
  const int64_t G = x.G, K = x.K, SB = K / 256;
  constexpr int64_t GB = BITS == 4 ? 16 : BITS == 5 ? 20 : 24;
  const uint8_t* base = w.q + p * 16 * G * GB;
  for (int r = 0; r < 2; ++r) {
    __m256 facc[MB];
    for (int m = 0; m < MB; ++m) facc[m] = _mm256_setzero_ps();
    __m256 Dv = _mm256_setzero_ps(), Dmv = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* gp = base + g * GB * 16;
      if (!UN && r == 0) prefetch_ahead<GB * 16>(gp);
      if (g % 8 == 0) {  // a super-block's factors, once for its 8 groups
        Dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.D + (p * SB + g / 8) * 16 + r * 8)));
        Dmv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.Dm + (p * SB + g / 8) * 16 + r * 8)));
      }
      for (int h = 0; h < 2; ++h) {
        __m256i c[4];
        for (int t = 0; t < 4; ++t) c[t] = unpacked_or_codes<BITS, UN>(un, gp, g, t, r, h);
        const int64_t k = (p * 2 * G + 2 * g + h) * 16 + r * 8;
        const __m256 scv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + k))));
        const __m256 mnv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.mn + k))));
        const __m256 dh = _mm256_mul_ps(Dv, scv), mh = _mm256_mul_ps(Dmv, mnv);
        for (int m = 0; m < MB; ++m) {
          const int32_t* xd = reinterpret_cast<const int32_t*>(x.q + (m0 + m) * K + g * 32) + 4 * h;
          const __m256i acc = dots4_256<BITS>(c, xd, _mm256_setzero_si256());
          const __m256 s = _mm256_mul_ps(dh, _mm256_set1_ps(x.dx[(m0 + m) * x.Gp + g]));
          facc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), s, facc[m]);
          facc[m] = _mm256_fnmadd_ps(mh, _mm256_set1_ps(x.sx16[(m0 + m) * 2 * x.Gp + 2 * g + h]), facc[m]);
        }
      }
    }
    for (int m = 0; m < MB; ++m) _mm256_storeu_ps(w.y + (m0 + m) * w.N + p * 16 + r * 8, facc[m]);
  }
}

// One activation row (decode): both halves of 8 rows in the same pass over the groups. Each half's
// float accumulator is a chain of dependent multiply-adds (four a group for k-quants: 16 cycles of
// latency where the rest of a group's work takes about as long), so two independent chains let one
// half's arithmetic run under the other's latency. Each output's operations and their order are
// those of the two-pass kernels above.
template <int BITS, bool UN>
void panel_one_256(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m0, const uint8_t* un) {
  const int64_t G = x.G, K = x.K;
  constexpr int64_t GB = BITS == 4 ? 16 : BITS == 5 ? 20 : 24;
  const uint8_t* base = w.q + p * 16 * G * GB;
  const uint16_t* dp = w.d + p * 16 * G;
  const uint16_t* mp = w.mn != nullptr ? w.mn + p * 16 * G : nullptr;
  __m256 facc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = base + g * GB * 16;
    if (!UN) prefetch_ahead<GB * 16>(gp);
    const int32_t* xd = reinterpret_cast<const int32_t*>(x.q + m0 * K + g * 32);
    const __m256 dx = _mm256_set1_ps(x.dx[m0 * x.Gp + g]), sx = _mm256_set1_ps(x.sx[m0 * x.Gp + g]);
    for (int r = 0; r < 2; ++r) {
      __m256i acc = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        __m256i c[4];
        for (int t = 0; t < 4; ++t) c[t] = unpacked_or_codes<BITS, UN>(un, gp, g, t, r, h);
        acc = dots4_256<BITS, true>(c, xd + 4 * h, acc);
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + g * 16 + r * 8)));
      const __m256 mv = mp != nullptr
                            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp + g * 16 + r * 8)))
                            : _mm256_mul_ps(dv, _mm256_set1_ps(ruvllm::symmetric_zero(BITS)));
      facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(dv, dx), facc[r]);
      facc[r] = _mm256_fmadd_ps(mv, sx, facc[r]);
    }
  }
  for (int r = 0; r < 2; ++r) _mm256_storeu_ps(w.y + m0 * w.N + p * 16 + r * 8, facc[r]);
}

template <int BITS, bool UN>
void kpanel_one_256(const GroupActs& x, const KMatrix& w, int64_t p, int64_t m0, const uint8_t* un) {
  const int64_t G = x.G, K = x.K, SB = K / 256;
  constexpr int64_t GB = BITS == 4 ? 16 : BITS == 5 ? 20 : 24;
  const uint8_t* base = w.q + p * 16 * G * GB;
  __m256 facc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 Dv[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, Dmv[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = base + g * GB * 16;
    if (!UN) prefetch_ahead<GB * 16>(gp);
    if (g % 8 == 0) {
      for (int r = 0; r < 2; ++r) {
        Dv[r] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.D + (p * SB + g / 8) * 16 + r * 8)));
        Dmv[r] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.Dm + (p * SB + g / 8) * 16 + r * 8)));
      }
    }
    const float dx = x.dx[m0 * x.Gp + g];
    for (int h = 0; h < 2; ++h) {
      const int32_t* xd = reinterpret_cast<const int32_t*>(x.q + m0 * K + g * 32) + 4 * h;
      const __m256 sx = _mm256_set1_ps(x.sx16[m0 * 2 * x.Gp + 2 * g + h]);
      for (int r = 0; r < 2; ++r) {
        __m256i c[4];
        for (int t = 0; t < 4; ++t) c[t] = unpacked_or_codes<BITS, UN>(un, gp, g, t, r, h);
        const int64_t k = (p * 2 * G + 2 * g + h) * 16 + r * 8;
        const __m256 scv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + k))));
        const __m256 mnv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.mn + k))));
        const __m256 dh = _mm256_mul_ps(Dv[r], scv), mh = _mm256_mul_ps(Dmv[r], mnv);
        const __m256i acc = dots4_256<BITS, true>(c, xd, _mm256_setzero_si256());
        const __m256 sc = _mm256_mul_ps(dh, _mm256_set1_ps(dx));
        facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), sc, facc[r]);
        facc[r] = _mm256_fnmadd_ps(mh, sx, facc[r]);
      }
    }
  }
  for (int r = 0; r < 2; ++r) _mm256_storeu_ps(w.y + m0 * w.N + p * 16 + r * 8, facc[r]);
}

template <int BITS, int MB>
void panel_block(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m0, const uint8_t* un) {
  if constexpr (BITS == 8)
    panel_block_8<MB>(x, w, p, m0);
  else if constexpr (MB == 1)
    un != nullptr ? panel_one_256<BITS, true>(x, w, p, m0, un) : panel_one_256<BITS, false>(x, w, p, m0, un);
  else if (un != nullptr)
    panel_block_256<BITS, MB, true>(x, w, p, m0, un);
  else
    panel_block_256<BITS, MB, false>(x, w, p, m0, un);
}
#define RUVLLM_PANEL_MB 4

template <int BITS, int MB>
void kpanel_block(const GroupActs& x, const KMatrix& w, int64_t p, int64_t m0, const uint8_t* un) {
  if constexpr (BITS == 8)
    kpanel_block_8<MB>(x, w, p, m0);
  else if constexpr (MB == 1)
    un != nullptr ? kpanel_one_256<BITS, true>(x, w, p, m0, un) : kpanel_one_256<BITS, false>(x, w, p, m0, un);
  else if (un != nullptr)
    kpanel_block_256<BITS, MB, true>(x, w, p, m0, un);
  else
    kpanel_block_256<BITS, MB, false>(x, w, p, m0, un);
}
#define RUVLLM_KPANEL_MB 6

// Activation quantization, 8 lanes at a time (see the AVX-512 one).
void quantize_groups_vec(const float* x, int64_t M, int64_t K, const GroupActsOut& o) {
  const int64_t G = K / 32;
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * 32;
      __m256 v[4];
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xg + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.0f;
      int8_t* qg = o.q + m * K + g * 32;
      if (!(amax > 0.f)) {
        memset(qg, 0, 32);
        store_group(o, m, g, d, 0, 0);
        continue;
      }
      const __m256 dv = _mm256_set1_ps(d);
      __m256i iv[4];
      for (int i = 0; i < 4; ++i)
        iv[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
            _mm256_round_ps(_mm256_div_ps(v[i], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi));
      const __m256i packed = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg), packed);
      store_group(o, m, g, d, hsum_epi32(_mm256_add_epi32(iv[0], iv[1])), hsum_epi32(_mm256_add_epi32(iv[2], iv[3])));
    }
  }
}

#else
// aarch64's baseline has NEON, so there the scalar variant (the reference) is told apart by its name.
#define RUVLLM_SCALAR_VARIANT_scalar 1
#if defined(__aarch64__) && defined(__ARM_NEON) && !RUVLLM_CAT(RUVLLM_SCALAR_VARIANT_, RUVLLM_VARIANT)
#include "cpu_kernels_neon.inc"
#else
void quantize_groups_vec(const float* x, int64_t M, int64_t K, const GroupActsOut& o) {
  quantize_groups_scalar(x, M, K, o);
}
void w8a8_vec(const RowActs& x, const RowMatrix& w, int64_t n0, int64_t n1) { w8a8_scalar(x, w, n0, n1); }
void group_vec(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1) { group_scalar(x, w, n0, n1); }
#endif
#endif

#if defined(RUVLLM_PANEL_MB) && defined(RUVLLM_KPANEL_MB)
// One block of MB activation rows against one panel, plain or k-quant (un: the panel's codes
// unpacked, where the variant does that; see unpack_buffer).
#ifdef RUVLLM_PANEL_UNPACK
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

template <int BITS, int MB>
void block(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m, const uint8_t* un) {
  panel_block<BITS, MB>(x, w, p, m, un);
}
template <int BITS, int MB>
void block(const GroupActs& x, const KMatrix& w, int64_t p, int64_t m, const uint8_t* un) {
  kpanel_block<BITS, MB>(x, w, p, m, un);
}
#else
template <int BITS>
const uint8_t* unpack_panel(const uint8_t*, int64_t, int64_t) { return nullptr; }
template <int BITS, int MB>
void block(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m, const uint8_t*) { panel_block<BITS, MB>(x, w, p, m); }
template <int BITS, int MB>
void block(const GroupActs& x, const KMatrix& w, int64_t p, int64_t m, const uint8_t*) { kpanel_block<BITS, MB>(x, w, p, m); }
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
    const uint8_t* un = x.M > MBMAX ? unpack_panel<BITS>(w.q, x.G, p) : nullptr;
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

const KernelTable kTable = {RUVLLM_STR(RUVLLM_VARIANT), quantize_groups_vec, w8a8_vec, group_vec, panel_vec,
                            kpanel_vec, decode_one, decode_part, prefill_tile, lora_rows};

}  // namespace

extern "C" const ruvllm::KernelTable* RUVLLM_CAT(ruvllm_kernels_, RUVLLM_VARIANT)() { return &kTable; }
