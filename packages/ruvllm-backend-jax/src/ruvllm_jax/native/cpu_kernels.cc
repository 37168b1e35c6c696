// ruvllm CPU kernels for XLA:CPU, called from jitted steps through the XLA FFI.
//
// Built on first use by ruvllm_jax.native with the machine's C++ compiler (-O3 -march=native), so
// the vector paths below are the ones the running CPU supports; a portable scalar path computes the
// same integers everywhere else.
//
// ruvllm_w8a8: y_i = x @ W_i.T for a group of int8 weight matrices W_i that share one input x
// (q/k/v, or gate/up). x [M, K] float32 is multiplied by the group's per-input-channel smoothing
// factors, quantized to int8 once per row (scale = row max / 127, round half to even, clip +-127),
// and multiplied in int32 against each W_i (int8, one float32 scale per output channel). The weights
// may be stacked over layers ([L, N, K]); the layer operand picks one without copying it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

struct Activations {
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
};

struct Matrix {
  const int8_t* w;      // [N, K]
  const float* scale;   // [N]
  float* y;             // [M, N]
  int64_t N;
};

inline void scalar_rows(const Activations& x, const Matrix& w, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w.w + n * x.K;
    for (int64_t m = 0; m < x.M; ++m) {
      const int8_t* xr = x.q.data() + m * x.Kp;
      int32_t s = 0;
      for (int64_t k = 0; k < x.K; ++k) s += static_cast<int32_t>(xr[k]) * static_cast<int32_t>(wr[k]);
      w.y[m * w.N + n] = (static_cast<float>(s) * x.scale[m]) * w.scale[n];
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// vpdpbusd multiplies unsigned by signed bytes: with a = q + 128, sum(a * w) = sum(q * w) +
// 128 * sum(w); the row sum of w comes from one more vpdpbusd against ones per weight load, shared
// by the MB activation rows of the block.
template <int MB>
inline void block4(const Activations& x, const Matrix& w, int64_t n, int64_t m0) {
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
    for (int m = 0; m < MB; ++m) a[m] = _mm512_loadu_si512(x.a.data() + (m0 + m) * x.Kp + c * 64);
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

inline void rows(const Activations& x, const Matrix& w, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t m = 0;
    for (; m + 4 <= x.M; m += 4) block4<4>(x, w, n, m);
    switch (x.M - m) {
      case 3: block4<3>(x, w, n, m); break;
      case 2: block4<2>(x, w, n, m); break;
      case 1: block4<1>(x, w, n, m); break;
      default: break;
    }
  }
  scalar_rows(x, w, n, n1);
}
constexpr const char* kPath = "avx512-vnni";
#else
inline void rows(const Activations& x, const Matrix& w, int64_t n0, int64_t n1) { scalar_rows(x, w, n0, n1); }
constexpr const char* kPath = "scalar";
#endif

// A small pool of worker threads of our own. XLA's intra-op pool wakes a sleeping thread for each
// task, which costs tens of microseconds; a decode step makes ~120 kernel calls, each a few hundred
// microseconds of work, so that latency would be a large part of the step. These workers spin for a
// short while after each job (RUVLLM_JAX_NATIVE_SPIN_US, default 50) and then sleep, so they are
// hot during a step and idle between requests.
class Pool {
 public:
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

  // Calls fn(part) for part in [0, threads()), part 0 on the calling thread.
  template <typename F>
  void run(F&& fn) {
    if (workers_.empty()) { fn(0); return; }
    std::lock_guard<std::mutex> serial(run_mutex_);  // one job at a time (XLA may call concurrently)
    std::function<void(int)> job = fn;
    job_ = &job;
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0);
    while (pending_.load(std::memory_order_acquire) != 0) cpu_relax();
    job_ = nullptr;
  }

 private:
  Pool() {
    const char* env = std::getenv("RUVLLM_JAX_NATIVE_THREADS");
    int n = env ? std::atoi(env) : static_cast<int>(std::thread::hardware_concurrency());
    if (n < 1) n = 1;
    if (n > 64) n = 64;
    const char* spin = std::getenv("RUVLLM_JAX_NATIVE_SPIN_US");
    spin_us_ = spin ? std::atoi(spin) : 50;
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
    for (auto& t : workers_) t.detach();
  }

  void loop(int part) {
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
      (*job_)(part);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::function<void(int)>* volatile job_ = nullptr;
  int spin_us_ = 50;
  pid_t pid_ = getpid();
};

// rows(..) over every matrix, each split into equal runs of 4-row blocks across the pool's threads.
void run_split(const Activations& x, const std::vector<Matrix>& mats) {
  int64_t total = 0;
  for (const auto& m : mats) total += m.N;
  Pool& pool = Pool::get();
  const int parts = total * x.K < (int64_t{1} << 16) ? 1 : pool.threads();
  if (parts == 1) {
    for (const auto& m : mats) rows(x, m, 0, m.N);
    return;
  }
  pool.run([&](int part) {
    for (const auto& m : mats) {
      const int64_t blocks = (m.N + 3) / 4;
      const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
      rows(x, m, std::min(m.N, b0 * 4), std::min(m.N, b1 * 4));
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// ruvllm_wxa8: weights in groups of 32 along the input (GGUF Q4_0 / Q4_1 / Q8_0 blocks), activations
// quantized to int8 per group of 32 (llama.cpp's Q8_1 scheme). A weight is d * q + m with q an
// unsigned 4-bit or 8-bit code and d, m float16 per (row, group); an activation group is dx * xq with
// dx = max|x| / 127, and sx = dx * sum(xq). Then
//   y[m, n] = sum_g d[n, g] * dx[m, g] * sum_j q[n, g, j] * xq[m, g, j] + sum_g m[n, g] * sx[m, g].
// 4-bit codes are packed two per byte, GGUF order: byte j of a group holds code j (low nibble) and
// code j + 16 (high nibble). 8-bit codes are signed values + 128 (so Q8_0 has m = -128 d).

struct GroupActs {
  int64_t M = 0, K = 0, G = 0, Gp = 0;
  std::vector<int8_t> q;     // [M, K] natural order
  std::vector<int8_t> q4;    // [M, K] in the 4-bit kernel's order (per pair of groups, see below)
  std::vector<float> dx, sx; // [M, Gp], zero padded to a multiple of 16 groups

  // with_q4: also lay the codes out for the row-major 4-bit kernel (panel matrices do not need it).
  void quantize(const float* x, int64_t rows, int64_t cols, bool with_q4) {
    M = rows;
    K = cols;
    G = cols / 32;
    Gp = (G + 15) / 16 * 16;
    q.assign(M * K, 0);
    if (with_q4) q4.assign(M * K, 0);
    dx.assign(M * Gp, 0.f);
    sx.assign(M * Gp, 0.f);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x + m * K + g * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(xg[j]));
        const float d = amax / 127.0f;
        int32_t sum = 0;
        int8_t* qg = q.data() + m * K + g * 32;
        for (int j = 0; j < 32; ++j) {
          float r = amax > 0.f ? std::nearbyint(xg[j] / d) : 0.f;
          r = std::fmin(std::fmax(r, -127.f), 127.f);
          qg[j] = static_cast<int8_t>(r);
          sum += qg[j];
        }
        dx[m * Gp + g] = d;
        sx[m * Gp + g] = d * static_cast<float>(sum);
      }
      // 4-bit order, per pair of groups (a, b): a[0:16] b[0:16] a[16:32] b[16:32], matching how one
      // 32-byte load of packed codes unpacks (low nibbles of a and b, then their high nibbles).
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
};

struct GroupMatrix {
  const uint8_t* q;        // [N, K / 2] (4-bit) or [N, K] (8-bit)
  const uint16_t* d;       // [N, G] float16 bits
  const uint16_t* mn;      // [N, G] float16 bits
  float* y;                // [M, N]
  int64_t N;
  int bits;
  bool panel;              // codes and scales in the 16-row panel layout (see panel_rows)
};

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t f;
  if (exp == 0) {
    if (man == 0) {
      f = sign;
    } else {  // subnormal
      float v = std::ldexp(static_cast<float>(man), -24);
      std::memcpy(&f, &v, 4);
      f |= sign;
    }
  } else if (exp == 31) {
    f = sign | 0x7F800000u | (man << 13);
  } else {
    f = sign | ((exp + 112) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

inline void group_scalar_rows(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1) {
  const int64_t K = x.K, G = x.G;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < x.M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t p = 0;
        const int8_t* xq = x.q.data() + m * K + g * 32;
        for (int j = 0; j < 32; ++j) {
          int32_t code;
          if (w.bits == 4) {
            const uint8_t byte = w.q[n * (K / 2) + g * 16 + (j & 15)];
            code = j < 16 ? (byte & 0x0F) : (byte >> 4);
          } else {
            code = w.q[n * K + g * 32 + j];
          }
          p += code * static_cast<int32_t>(xq[j]);
        }
        acc += half_to_float(w.d[n * G + g]) * x.dx[m * x.Gp + g] * static_cast<float>(p) +
               half_to_float(w.mn[n * G + g]) * x.sx[m * x.Gp + g];
      }
      w.y[m * w.N + n] = acc;
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
// Two weight rows (R) by MB activation rows; per chunk of 16 groups the scale products d * dx are
// formed once, then every pair of groups is one vpdpbusd per (row, activation row), its 16 int32
// lanes converted and scaled by the lanes' groups' factors (a permute of the chunk's products).
template <int BITS, int MB>
inline void group_block2(const GroupActs& x, const GroupMatrix& w, int64_t n, int64_t m0) {
  constexpr int R = 2;
  const int64_t K = x.K, G = x.G;
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  const int8_t* xbase = BITS == 4 ? x.q4.data() : x.q.data();
  __m512 facc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) facc[r][m] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t c = 0; c < G; c += 16) {
    const int64_t gc = std::min<int64_t>(16, G - c);
    const __mmask16 gm = static_cast<__mmask16>((1u << gc) - 1u);
    __m512 sc[R][MB];
    for (int r = 0; r < R; ++r) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, w.d + (n + r) * G + c));
      const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, w.mn + (n + r) * G + c));
      for (int m = 0; m < MB; ++m) {
        const __m512 dxv = _mm512_loadu_ps(x.dx.data() + (m0 + m) * x.Gp + c);
        const __m512 sxv = _mm512_loadu_ps(x.sx.data() + (m0 + m) * x.Gp + c);
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
inline void group_rows_vec(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1) {
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
  group_scalar_rows(x, w, n, n1);
}

inline void group_rows(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1) {
  if (x.G % 2 != 0) return group_scalar_rows(x, w, n0, n1);
  if (w.bits == 4) return group_rows_vec<4>(x, w, n0, n1);
  return group_rows_vec<8>(x, w, n0, n1);
}
#else
inline void group_rows(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1) {
  group_scalar_rows(x, w, n0, n1);
}
#endif

// Panel layout (16 output rows at a time; set up at load by ruvllm_jax.quant.to_panels): for panel p
// and group g, the group's code bytes of the 16 rows are stored as gb / 4 vectors of 16 dwords, dword
// r of vector t holding bytes 4t .. 4t+3 of row r's group (gb = 16 bytes for 4-bit, 32 for 8-bit);
// scales and offsets as 16 consecutive float16 per (panel, group). One vpdpbusd then forms four
// products for each of the 16 rows against a broadcast dword of the activations, and each output is
// a sequential sum over groups: the same float operations for a row whatever else is in the batch.
inline int64_t panel_byte(int64_t n, int64_t g, int64_t jb, int64_t G, int bits) {
  const int64_t gb = bits == 4 ? 16 : 32;
  return (n / 16) * 16 * G * gb + g * gb * 16 + (jb / 4) * 64 + (n % 16) * 4 + jb % 4;
}

inline void panel_scalar(const GroupActs& x, const GroupMatrix& w, int64_t p0, int64_t p1) {
  const int64_t G = x.G;
  for (int64_t n = p0 * 16; n < p1 * 16; ++n) {
    for (int64_t m = 0; m < x.M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t p = 0;
        const int8_t* xq = x.q.data() + m * x.K + g * 32;
        for (int j = 0; j < 32; ++j) {
          int32_t code;
          if (w.bits == 4) {
            const uint8_t byte = w.q[panel_byte(n, g, j & 15, G, 4)];
            code = j < 16 ? (byte & 0x0F) : (byte >> 4);
          } else {
            code = w.q[panel_byte(n, g, j, G, 8)];
          }
          p += code * static_cast<int32_t>(xq[j]);
        }
        const int64_t si = (n / 16) * 16 * G + g * 16 + n % 16;
        acc = std::fma(static_cast<float>(p), half_to_float(w.d[si]) * x.dx[m * x.Gp + g], acc);
        acc = std::fma(half_to_float(w.mn[si]), x.sx[m * x.Gp + g], acc);
      }
      w.y[m * w.N + n] = acc;
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
template <int BITS, int MB>
inline void panel_block(const GroupActs& x, const GroupMatrix& w, int64_t p, int64_t m0) {
  const int64_t G = x.G, K = x.K;
  constexpr int64_t GB = BITS == 4 ? 16 : 32;  // code bytes per row and group
  const uint8_t* base = w.q + p * 16 * G * GB;
  const uint16_t* dp = w.d + p * 16 * G;
  const uint16_t* mp = w.mn + p * 16 * G;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 facc[MB];
  for (int m = 0; m < MB; ++m) facc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = base + g * GB * 16;
    __m512i wv[8];
    if (BITS == 4) {
      for (int t = 0; t < 4; ++t) {
        const __m512i z = _mm512_loadu_si512(gp + t * 64);
        wv[t] = _mm512_and_si512(z, low4);                          // codes 4t .. 4t+3
        wv[4 + t] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);  // codes 16+4t .. 16+4t+3
      }
    } else {
      for (int t = 0; t < 8; ++t) wv[t] = _mm512_loadu_si512(gp + t * 64);
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dp + g * 16)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mp + g * 16)));
    // The activation rows interleaved: MB independent accumulation chains keep the dot-product
    // units busy (one chain of 8 dependent vpdpbusd would wait on their latency).
    __m512i acc[MB];
    const int32_t* xd[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_setzero_si512();
      xd[m] = reinterpret_cast<const int32_t*>(x.q.data() + (m0 + m) * K + g * 32);
    }
    for (int t = 0; t < 8; ++t)
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], wv[t], _mm512_set1_epi32(xd[m][t]));
    for (int m = 0; m < MB; ++m) {
      const __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(x.dx[(m0 + m) * x.Gp + g]));
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), s, facc[m]);
      facc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.sx[(m0 + m) * x.Gp + g]), facc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(w.y + (m0 + m) * w.N + p * 16, facc[m]);
}

template <int BITS>
inline void panel_rows_vec(const GroupActs& x, const GroupMatrix& w, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    int64_t m = 0;
    for (; m + 8 <= x.M; m += 8) panel_block<BITS, 8>(x, w, p, m);
    switch (x.M - m) {
      case 7: panel_block<BITS, 7>(x, w, p, m); break;
      case 6: panel_block<BITS, 6>(x, w, p, m); break;
      case 5: panel_block<BITS, 5>(x, w, p, m); break;
      case 4: panel_block<BITS, 4>(x, w, p, m); break;
      case 3: panel_block<BITS, 3>(x, w, p, m); break;
      case 2: panel_block<BITS, 2>(x, w, p, m); break;
      case 1: panel_block<BITS, 1>(x, w, p, m); break;
      default: break;
    }
  }
}

inline void panel_rows(const GroupActs& x, const GroupMatrix& w, int64_t p0, int64_t p1) {
  if (w.bits == 4) return panel_rows_vec<4>(x, w, p0, p1);
  return panel_rows_vec<8>(x, w, p0, p1);
}
#else
inline void panel_rows(const GroupActs& x, const GroupMatrix& w, int64_t p0, int64_t p1) {
  panel_scalar(x, w, p0, p1);
}
#endif

void run_group_split(const GroupActs& x, const std::vector<GroupMatrix>& mats) {
  int64_t work = 0;
  for (const auto& m : mats) work += m.N * x.K * x.M;
  Pool& pool = Pool::get();
  const int parts = work < (int64_t{1} << 16) ? 1 : pool.threads();
  auto run_part = [&](int part) {
    for (const auto& m : mats) {
      if (m.panel) {
        const int64_t panels = m.N / 16;
        panel_rows(x, m, panels * part / parts, panels * (part + 1) / parts);
        continue;
      }
      const int64_t blocks = (m.N + 1) / 2;
      const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
      group_rows(x, m, std::min(m.N, b0 * 2), std::min(m.N, b1 * 2));
    }
  };
  if (parts == 1) {
    run_part(0);
    return;
  }
  pool.run(run_part);
}

ffi::Error WxA8Common(bool panel, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
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
    const auto qd = q->dimensions();
    if (qd.size() < 2) return ffi::Error::InvalidArgument("ruvllm_wxa8: codes must be [.., out, bytes]");
    const int64_t N = qd[qd.size() - 2];
    int bits;
    if (qd.back() == K / 2) bits = 4;
    else if (qd.back() == K) bits = 8;
    else return ffi::Error::InvalidArgument("ruvllm_wxa8: code bytes per row are neither K / 2 nor K");
    const int64_t row_bytes = qd.back();
    const int64_t L = static_cast<int64_t>(q->element_count()) / (N * row_bytes);
    if (l < 0 || l >= L) return ffi::Error::InvalidArgument("ruvllm_wxa8: layer index out of range");
    if (static_cast<int64_t>(d->element_count()) != L * N * G || static_cast<int64_t>(mn->element_count()) != L * N * G)
      return ffi::Error::InvalidArgument("ruvllm_wxa8: one scale and offset per group of 32 expected");
    if (static_cast<int64_t>((*y)->element_count()) != M * N)
      return ffi::Error::InvalidArgument("ruvllm_wxa8: output shape mismatch");
    if (panel && N % 16 != 0)
      return ffi::Error::InvalidArgument("ruvllm_wxa8: the panel layout needs a multiple of 16 output rows");
    mats.push_back(GroupMatrix{q->typed_data<uint8_t>() + l * N * row_bytes,
                               reinterpret_cast<const uint16_t*>(d->untyped_data()) + l * N * G,
                               reinterpret_cast<const uint16_t*>(mn->untyped_data()) + l * N * G,
                               (*y)->typed_data<float>(), N, bits, panel});
  }
  thread_local GroupActs acts;
  bool row_major_4bit = false;
  for (const auto& m : mats) row_major_4bit |= !m.panel && m.bits == 4;
  acts.quantize(x.typed_data(), M, K, row_major_4bit);
  run_group_split(acts, mats);
  return ffi::Error::Success();
}

ffi::Error WxA8Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs weights,
                    ffi::RemainingRets outs) {
  return WxA8Common(false, x, layer, weights, outs);
}

ffi::Error WxA8PanelImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs weights,
                         ffi::RemainingRets outs) {
  return WxA8Common(true, x, layer, weights, outs);
}

ffi::Error W8A8Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                    ffi::Buffer<ffi::F32> in_scale, ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("ruvllm_w8a8: x must be [rows, features]");
  const int64_t M = xd[0], K = xd[1];
  const int64_t l = layer.typed_data()[0];
  if (weights.size() != 2 * outs.size() || outs.size() == 0)
    return ffi::Error::InvalidArgument("ruvllm_w8a8: expected (weight, scale) pairs, one per output");
  if (in_scale.element_count() != 0 && in_scale.dimensions().back() != K)
    return ffi::Error::InvalidArgument("ruvllm_w8a8: smoothing factors do not match the input features");
  std::vector<Matrix> mats;
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
    mats.push_back(Matrix{wq->typed_data<int8_t>() + l * N * K, ws->typed_data<float>() + l * N,
                          (*y)->typed_data<float>(), N});
  }
  const float* is = nullptr;
  if (in_scale.element_count() != 0) {
    const int64_t L = static_cast<int64_t>(in_scale.element_count()) / K;
    if (l >= L) return ffi::Error::InvalidArgument("ruvllm_w8a8: smoothing layer index out of range");
    is = in_scale.typed_data() + l * K;
  }
  thread_local Activations acts;
  acts.quantize(x.typed_data(), is, M, K);
  run_split(acts, mats);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------
// ruvllm_paged_decode: attention of one new token per sequence over its paged cache, read in place.
// q [S, H, D]; k, v caches [L, NB, BS, KVH, D] (float32); tables [S, Bd]; context [S] (keys 0 ..
// context-1 count; 0 gives zeros). Heads h use kv head h / (H / KVH). Block ids are clamped to the
// cache, as XLA's gather clamps them.
struct DecodeJob {
  const float *q, *k, *v;
  const int32_t *tables, *context;
  float* out;
  int64_t S, H, D, NB, BS, KVH, Bd, layer;
  float scale;
};

void decode_one(const DecodeJob& j, int64_t s, int64_t g, std::vector<float>& p) {
  const int64_t group = j.H / j.KVH;
  const int64_t ctx = std::max<int64_t>(0, std::min<int64_t>(j.context[s], j.Bd * j.BS));
  float* out = j.out + (s * j.H + g * group) * j.D;
  std::fill(out, out + group * j.D, 0.f);
  if (ctx == 0) return;
  p.resize(group * ctx);
  const float* q = j.q + (s * j.H + g * group) * j.D;
  auto row = [&](const float* cache, int64_t t) {
    int64_t blk = j.tables[s * j.Bd + t / j.BS];
    blk = std::min<int64_t>(std::max<int64_t>(blk, 0), j.NB - 1);
    return cache + (((j.layer * j.NB + blk) * j.BS + t % j.BS) * j.KVH + g) * j.D;
  };
  for (int64_t t = 0; t < ctx; ++t) {
    const float* kr = row(j.k, t);
    for (int64_t hh = 0; hh < group; ++hh) {
      const float* qh = q + hh * j.D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < j.D; ++d) acc += qh[d] * kr[d];
      p[hh * ctx + t] = acc * j.scale;
    }
  }
  for (int64_t hh = 0; hh < group; ++hh) {
    float* ph = p.data() + hh * ctx;
    float mx = ph[0];
    for (int64_t t = 1; t < ctx; ++t) mx = std::max(mx, ph[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) {
      ph[t] = std::exp(ph[t] - mx);
      sum += ph[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < ctx; ++t) ph[t] *= inv;
  }
  for (int64_t t = 0; t < ctx; ++t) {
    const float* vr = row(j.v, t);
    for (int64_t hh = 0; hh < group; ++hh) {
      const float w = p[hh * ctx + t];
      float* oh = out + hh * j.D;
#pragma omp simd
      for (int64_t d = 0; d < j.D; ++d) oh[d] += w * vr[d];
    }
  }
}

ffi::Error PagedDecodeImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> tables,
                           ffi::Buffer<ffi::S32> context, ffi::ResultBuffer<ffi::F32> out) {
  const auto kd = k.dimensions();
  const auto td = tables.dimensions();
  if (kd.size() != 5 || v.dimensions().size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("ruvllm_paged_decode: caches must be [L, NB, BS, KVH, D], tables [S, Bd]");
  for (int i = 0; i < 5; ++i)
    if (kd[i] != v.dimensions()[i]) return ffi::Error::InvalidArgument("ruvllm_paged_decode: K and V caches differ");
  DecodeJob j{};
  j.q = q.typed_data();
  j.k = k.typed_data();
  j.v = v.typed_data();
  j.tables = tables.typed_data();
  j.context = context.typed_data();
  j.out = out->typed_data();
  j.NB = kd[1];
  j.BS = kd[2];
  j.KVH = kd[3];
  j.D = kd[4];
  j.S = td[0];
  j.Bd = td[1];
  j.layer = layer.typed_data()[0];
  if (j.layer < 0 || j.layer >= kd[0]) return ffi::Error::InvalidArgument("ruvllm_paged_decode: layer out of range");
  if (static_cast<int64_t>(context.element_count()) != j.S)
    return ffi::Error::InvalidArgument("ruvllm_paged_decode: one context length per sequence expected");
  const int64_t qn = static_cast<int64_t>(q.element_count());
  if (j.S == 0 || qn % (j.S * j.D) != 0) return ffi::Error::InvalidArgument("ruvllm_paged_decode: q shape mismatch");
  j.H = qn / (j.S * j.D);
  if (j.H % j.KVH != 0) return ffi::Error::InvalidArgument("ruvllm_paged_decode: heads not a multiple of kv heads");
  j.scale = 1.0f / std::sqrt(static_cast<float>(j.D));
  const int64_t tasks = j.S * j.KVH;
  int64_t work = 0;
  for (int64_t s = 0; s < j.S; ++s) work += std::max<int64_t>(0, j.context[s]) * j.H * j.D;
  Pool& pool = Pool::get();
  const int parts = work < (int64_t{1} << 17) ? 1 : pool.threads();
  if (parts == 1) {
    thread_local std::vector<float> p;
    for (int64_t t = 0; t < tasks; ++t) decode_one(j, t / j.KVH, t % j.KVH, p);
    return ffi::Error::Success();
  }
  pool.run([&](int part) {
    thread_local std::vector<float> p;
    for (int64_t t = part; t < tasks; t += parts) decode_one(j, t / j.KVH, t % j.KVH, p);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmWxA8, WxA8Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmWxA8Panel, WxA8PanelImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" const char* ruvllm_cpu_kernels_path() { return kPath; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(RuvllmW8A8, W8A8Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
