// Every ISA variant of ruvllm's CPU kernels against the scalar one, without XLA or Python.
//
// Linked with the variant objects of one architecture (cpu_kernels_variant.cc compiled once per
// variant with its flags from variants.py; tests/test_cpu_kernels_cross.py builds it natively and for
// aarch64 under qemu). Builds its inputs with a fixed PRNG, quantizes activations as cpu_acts.h does
// (written out here), and checks each variant the CPU supports:
//   quantize_groups, w8a8_rows, panel_rows, kpanel_rows  bit for bit (the same integers, then the
//                                                         same float operations in the same order);
//   group_rows, decode                                   within float rounding (other summation order);
//   decode_part                                          two key ranges merged = decode, within rounding;
//   decode, prefill over float16 / bfloat16 caches       bit for bit what the variant gives over the
//                                                        same values in float32.
// Prints one line per (variant, kernel): PASS, FAIL (with the first mismatch), SKIP (the CPU lacks the
// variant's instructions) or MISSING (not linked); exits 1 on any FAIL.
// `kernel_check --list` prints the variants this CPU runs, comma-separated.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#include "cpu_kernels.h"

using ruvllm::KernelTable;

#if defined(__x86_64__)
#define VARIANTS(X) X(scalar) X(avx2) X(avxvnni) X(avxvnni_evex) X(avx512vnni)
#elif defined(__aarch64__)
#define VARIANTS(X) X(scalar) X(neon) X(neon_dotprod) X(neon_i8mm)
#else
#error "no kernel variants for this architecture"
#endif
// Weak: a variant whose object is not linked (a compiler without its flags) reads MISSING.
#define DECLARE_WEAK(sym) extern "C" const KernelTable* ruvllm_kernels_##sym() __attribute__((weak));
VARIANTS(DECLARE_WEAK)

namespace {

// -- which variants this CPU runs (cpu_isa.cc's detect_features) ------------------------------------

bool cpu_runs(const std::string& v) {
  if (v == "scalar") return true;
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29), avx = c & (1u << 28);
  if (!osxsave || !avx || !fma || !f16c || __get_cpuid_max(0, nullptr) < 7) return false;
  unsigned xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool ymm = (xlo & 0x6u) == 0x6u, zmm = (xlo & 0xE6u) == 0xE6u;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = ymm && (b & (1u << 5));
  const bool avx512vnni = avx2 && zmm && (b & (1u << 16)) && (b & (1u << 30)) && (b & (1u << 31)) && (c & (1u << 11));
  __cpuid_count(7, 1, a, b, c, d);
  const bool avxvnni = avx2 && (a & (1u << 4));
  if (v == "avx2") return avx2;
  if (v == "avxvnni") return avxvnni;
  return avx512vnni;  // avxvnni_evex, avx512vnni
#else
  if (v == "neon") return true;
#if defined(__linux__)
  const bool dot = getauxval(AT_HWCAP) & (1ul << 20);                 // HWCAP_ASIMDDP
  const bool i8mm = dot && (getauxval(AT_HWCAP2) & (1ul << 13));      // HWCAP2_I8MM
  return v == "neon_dotprod" ? dot : i8mm;
#else
  return false;
#endif
#endif
}

// -- inputs --------------------------------------------------------------------------------------------

struct Rng {  // splitmix64
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t range(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
  float uniform() { return static_cast<float>(next() >> 40) / static_cast<float>(1 << 24); }
  float normal() { return uniform() + uniform() + uniform() + uniform() - 2.f; }  // close enough
};

// Float16 bits: mostly normal values of magnitude 2^-8 .. 2^3, some subnormal, some zero.
uint16_t rand_half(Rng& r) {
  const uint16_t sign = static_cast<uint16_t>(r.range(0, 1) << 15);
  const uint16_t man = static_cast<uint16_t>(r.range(0, 1023));
  const int64_t kind = r.range(0, 31);
  if (kind == 0) return sign;
  if (kind == 1) return sign | man;
  return static_cast<uint16_t>(sign | (r.range(7, 18) << 10) | man);
}

// Activations: scaled normals, an all-zero group, one code at +-127 with the rest small, and with
// enough rows a group of +-max codes only (the largest products the integer paths must hold) and one
// of ties (x / dx = k + 1/2: rounding to even).
std::vector<float> activations(Rng& r, int64_t M, int64_t K) {
  std::vector<float> x(M * K);
  const float scale = 0.1f + 30.f * r.uniform();
  for (auto& v : x) v = r.normal() * scale;
  for (int j = 0; j < 32; ++j) x[j] = 0.f;
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(x[(M - 1) * K + k]));
  x[(M - 1) * K + 3] = 127.f * amax;
  if (M >= 2)
    for (int j = 0; j < 32; ++j) x[K + j] = (r.range(0, 1) ? 1.f : -1.f) * scale;
  if (M >= 3)
    for (int j = 0; j < 32; ++j) x[2 * K + j] = j < 31 ? static_cast<float>(j) - 15.5f : 127.f;  // dx = 1
  return x;
}

// cpu_acts.h's RowActsBuf::quantize.
struct RowActsBuf {
  int64_t M = 0, K = 0, Kp = 0;
  std::vector<int8_t> q;
  std::vector<uint8_t> a;
  std::vector<float> scale;

  void quantize(const float* x, int64_t rows, int64_t cols) {
    M = rows;
    K = cols;
    Kp = (cols + 63) / 64 * 64;
    q.assign(M * Kp, 0);
    a.assign(M * Kp, 128);
    scale.assign(M, 1.0f);
    for (int64_t m = 0; m < M; ++m) {
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(x[m * K + k]));
      const float sc = amax > 0.f ? amax / 127.0f : 1.0f;
      scale[m] = sc;
      for (int64_t k = 0; k < K; ++k) {
        float v = std::nearbyint(x[m * K + k] / sc);
        v = std::fmin(std::fmax(v, -127.f), 127.f);
        q[m * Kp + k] = static_cast<int8_t>(v);
        a[m * Kp + k] = static_cast<uint8_t>(q[m * Kp + k] + 128);
      }
    }
  }
  ruvllm::RowActs view() const { return {q.data(), a.data(), scale.data(), M, K, Kp}; }
};

// cpu_acts.h's GroupActsBuf::quantize (the scalar quantize_groups), q4 included.
struct GroupActsBuf {
  int64_t M = 0, K = 0, G = 0, Gp = 0;
  std::vector<int8_t> q, q4;
  std::vector<float> dx, sx, sx16;
  std::vector<int32_t> isum, isum16;

  void quantize(const float* x, int64_t rows, int64_t cols) {
    M = rows;
    K = cols;
    G = cols / 32;
    Gp = (G + 15) / 16 * 16;
    q.assign(M * K, 0);
    q4.assign(M * K, 0);
    dx.assign(M * Gp, 0.f);
    sx.assign(M * Gp, 0.f);
    isum.assign(M * Gp, 0);
    isum16.assign(M * 2 * Gp, 0);
    sx16.assign(M * 2 * Gp, 0.f);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x + m * K + g * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(xg[j]));
        const float d = amax / 127.0f;
        int32_t half[2] = {0, 0};
        int8_t* qg = q.data() + m * K + g * 32;
        for (int j = 0; j < 32; ++j) {
          float v = amax > 0.f ? std::nearbyint(xg[j] / d) : 0.f;
          v = std::fmin(std::fmax(v, -127.f), 127.f);
          qg[j] = static_cast<int8_t>(v);
          half[j / 16] += qg[j];
        }
        dx[m * Gp + g] = d;
        sx[m * Gp + g] = d * static_cast<float>(half[0] + half[1]);
        isum[m * Gp + g] = half[0] + half[1];
        for (int h = 0; h < 2; ++h) {
          isum16[m * 2 * Gp + 2 * g + h] = half[h];
          sx16[m * 2 * Gp + 2 * g + h] = d * static_cast<float>(half[h]);
        }
      }
      // The row-major 4-bit kernel's order: per pair of groups a[0:16] b[0:16] a[16:32] b[16:32].
      for (int64_t p = 0; p + 1 < G; p += 2) {
        const int8_t* a = q.data() + m * K + p * 32;
        int8_t* o = q4.data() + m * K + p * 32;
        std::memcpy(o, a, 16);
        std::memcpy(o + 16, a + 32, 16);
        std::memcpy(o + 32, a + 16, 16);
        std::memcpy(o + 48, a + 48, 16);
      }
    }
  }
  ruvllm::GroupActs view() const {
    return {q.data(), q4.data(), dx.data(), sx.data(), isum.data(), isum16.data(), sx16.data(), M, K, G, Gp};
  }
};

// Codes [N, K] over all of 0 .. 2^bits - 1; row 0's first group at the top of the range and row 1's
// at 0 (with +-max activations, the largest products).
std::vector<uint8_t> codes(Rng& r, int64_t N, int64_t K, int bits) {
  std::vector<uint8_t> c(N * K);
  const int top = (1 << bits) - 1;
  for (auto& v : c) v = static_cast<uint8_t>(r.range(0, top));
  for (int j = 0; j < 32; ++j) {
    c[j] = static_cast<uint8_t>(top);
    if (N > 1) c[K + j] = 0;
  }
  return c;
}

// Row-major storage (cpu_kernels.h): per group, 4-bit byte j holds codes j (low nibble) and 16 + j
// (high nibble); 5-bit adds 4 bytes of the codes' bits 4, code j's at bit j / 4 of byte j % 4; 6-bit
// adds 8 bytes of their bits 4-5, code j's at bits 2 ((j % 16) / 4) and the next of byte
// 4 (j / 16) + j % 4; 8-bit is a byte per code.
std::vector<uint8_t> row_major(const std::vector<uint8_t>& c, int64_t N, int64_t K, int bits) {
  if (bits == 8) return c;
  const int64_t G = K / 32, gb = ruvllm::group_bytes(bits);
  std::vector<uint8_t> q(N * G * gb);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* cg = c.data() + n * K + g * 32;
      uint8_t* qg = q.data() + (n * G + g) * gb;
      for (int j = 0; j < 16; ++j) qg[j] = static_cast<uint8_t>((cg[j] & 15) | ((cg[16 + j] & 15) << 4));
      for (int j = 0; j < 32; ++j) {
        if (bits == 5) qg[16 + j % 4] |= static_cast<uint8_t>(((cg[j] >> 4) & 1) << (j / 4));
        if (bits == 6)
          qg[16 + 4 * (j / 16) + j % 4] |= static_cast<uint8_t>(((cg[j] >> 4) & 3) << (2 * ((j % 16) / 4)));
      }
    }
  return q;
}

// Panel layout (cpu_kernels.h, panel_byte) of the same bytes.
std::vector<uint8_t> panels(const std::vector<uint8_t>& c, int64_t N, int64_t K, int bits) {
  const std::vector<uint8_t> rm = row_major(c, N, K, bits);
  const int64_t G = K / 32, gb = ruvllm::group_bytes(bits);
  std::vector<uint8_t> q(rm.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t jb = 0; jb < gb; ++jb) q[ruvllm::panel_byte(n, g, jb, G, bits)] = rm[(n * G + g) * gb + jb];
  return q;
}

// The layouts above against the header's own reading of them.
bool layouts_agree(const std::vector<uint8_t>& c, int64_t N, int64_t K, int bits) {
  const std::vector<uint8_t> rm = row_major(c, N, K, bits), pn = panels(c, N, K, bits);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / 32;
      const int j = static_cast<int>(k % 32);
      if (ruvllm::code_at(rm.data(), bits, false, n, g, j, K / 32) != c[n * K + k]) return false;
      if (N % 16 == 0 && ruvllm::code_at(pn.data(), bits, true, n, g, j, K / 32) != c[n * K + k]) return false;
    }
  return true;
}

std::vector<uint16_t> halves(Rng& r, int64_t n) {
  std::vector<uint16_t> h(n);
  for (auto& v : h) v = rand_half(r);
  return h;
}

// -- comparison ----------------------------------------------------------------------------------------

const char* const kKernels[] = {"quantize_groups", "w8a8_rows", "group_rows", "panel_rows",
                                "kpanel_rows",     "decode",    "prefill",    "lora_rows"};
constexpr int kNumKernels = sizeof(kKernels) / sizeof(kKernels[0]);
enum { kQuantize, kW8A8, kGroup, kPanel, kKPanel, kDecode, kPrefill, kLora };

struct Outcome {
  int cases = 0, failed = 0;
  std::string first;
};

struct Variant {
  const char* name;
  const KernelTable* (*table)();
  bool runs;
  bool ref;  // scalar: the reference of every kernel but quantize_groups
  Outcome out[kNumKernels];
};

// The first element where got differs from want (bit for bit, or with tol >= 0 beyond
// tol * (|want| + max|want|)), or "".
template <typename T>
std::string mismatch(const std::vector<T>& got, const std::vector<T>& want, double tol = -1) {
  double peak = 0;
  for (const T& w : want) peak = std::fmax(peak, std::fabs(static_cast<double>(w)));
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got[i], w = want[i];
    const bool ok = tol < 0 ? std::memcmp(&got[i], &want[i], sizeof(T)) == 0
                            : std::fabs(g - w) <= tol * (std::fabs(w) + peak);
    if (!ok) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "[%zu]: got %.9g (%a), want %.9g (%a)", i, g, g, w, w);
      return buf;
    }
  }
  return "";
}

void record(Outcome& o, const std::string& what, const std::string& bad) {
  ++o.cases;
  if (!bad.empty() && o.failed++ == 0) o.first = what + " " + bad;
}

const int64_t kRows[] = {1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 19};

std::string shape(const char* kind, int64_t M, int64_t N, int64_t K, int bits = 0) {
  char buf[96];
  if (bits)
    std::snprintf(buf, sizeof buf, "%s %d-bit %lldx%lldx%lld", kind, bits, static_cast<long long>(M),
                  static_cast<long long>(N), static_cast<long long>(K));
  else
    std::snprintf(buf, sizeof buf, "%s %lldx%lldx%lld", kind, static_cast<long long>(M), static_cast<long long>(N),
                  static_cast<long long>(K));
  return buf;
}

// -- the kernels -----------------------------------------------------------------------------------

void check_quantize(Rng& r, std::vector<Variant>& vs) {
  for (int64_t K : {32, 96, 1536}) {
    for (int64_t M : kRows) {
      const std::vector<float> x = activations(r, M, K);
      GroupActsBuf want;
      want.quantize(x.data(), M, K);
      for (auto& v : vs) {
        if (!v.runs) continue;
        // Padding groups as the caller left them (zeros, as want's); the rest must be overwritten.
        GroupActsBuf got = want;
        const int64_t Gp = want.Gp;
        std::memset(got.q.data(), 0x5A, got.q.size());
        for (int64_t m = 0; m < M; ++m)
          for (int64_t g = 0; g < want.G; ++g) {
            const int64_t i = m * Gp + g, h = m * 2 * Gp + 2 * g;
            got.dx[i] = got.sx[i] = got.sx16[h] = got.sx16[h + 1] = NAN;
            got.isum[i] = got.isum16[h] = got.isum16[h + 1] = -1;
          }
        v.table()->quantize_groups(x.data(), M, K, {got.q.data(), got.dx.data(), got.sx.data(), got.sx16.data(),
                                                    got.isum.data(), got.isum16.data(), Gp});
        std::string bad = mismatch(got.q, want.q);
        if (bad.empty()) bad = mismatch(got.dx, want.dx);
        if (bad.empty()) bad = mismatch(got.sx, want.sx);
        if (bad.empty()) bad = mismatch(got.isum, want.isum);
        if (bad.empty()) bad = mismatch(got.sx16, want.sx16);
        if (bad.empty()) bad = mismatch(got.isum16, want.isum16);
        record(v.out[kQuantize], shape("activations", M, 1, K), bad);
      }
    }
  }
}

void check_w8a8(Rng& r, const KernelTable* ref, std::vector<Variant>& vs) {
  for (int64_t K : {32, 100, 576, 1536, 1537}) {
    for (int64_t N : {64, 30, 7}) {
      std::vector<int8_t> w(N * K);
      for (auto& v : w) v = static_cast<int8_t>(r.range(-127, 127));
      for (int64_t k = 0; k < K; ++k) w[k] = static_cast<int8_t>(k % 2 ? 127 : -127);
      std::vector<float> ws(N);
      for (auto& v : ws) v = (0.5f + r.uniform()) / 127.f;
      for (int64_t M : kRows) {
        std::vector<float> x = activations(r, M, K);
        RowActsBuf a;
        a.quantize(x.data(), M, K);
        std::vector<float> want(M * N, NAN);
        ref->w8a8_rows(a.view(), {w.data(), ws.data(), want.data(), N}, 0, N);
        const int64_t split = 4 * ((N / 4 + 1) / 2);  // as the thread split: runs of 4-row blocks
        for (auto& v : vs) {
          if (!v.runs || v.ref) continue;
          std::vector<float> got(M * N, NAN);
          v.table()->w8a8_rows(a.view(), {w.data(), ws.data(), got.data(), N}, 0, split);
          v.table()->w8a8_rows(a.view(), {w.data(), ws.data(), got.data(), N}, split, N);
          record(v.out[kW8A8], shape("w8a8", M, N, K), mismatch(got, want));
        }
      }
    }
  }
}

void check_group(Rng& r, const KernelTable* ref, std::vector<Variant>& vs) {
  for (int bits : {4, 5, 6, 8}) {
    for (int64_t K : {32, 96, 160, 1536}) {
      for (int64_t N : {7, 33, 50}) {  // not multiples of 16: row-major
        const int64_t G = K / 32;
        const std::vector<uint8_t> q = row_major(codes(r, N, K, bits), N, K, bits);
        const std::vector<uint16_t> d = halves(r, N * G), mn = halves(r, N * G);
        for (int64_t M : kRows) {
          std::vector<float> x = activations(r, M, K);
          GroupActsBuf a;
          a.quantize(x.data(), M, K);
          for (const uint16_t* m : {mn.data(), static_cast<const uint16_t*>(nullptr)}) {  // null: symmetric
            std::vector<float> want(M * N, NAN);
            ref->group_rows(a.view(), {q.data(), d.data(), m, want.data(), N, bits, false}, 0, N);
            for (auto& v : vs) {
              if (!v.runs || v.ref) continue;
              std::vector<float> got(M * N, NAN);
              v.table()->group_rows(a.view(), {q.data(), d.data(), m, got.data(), N, bits, false}, 0, N / 2);
              v.table()->group_rows(a.view(), {q.data(), d.data(), m, got.data(), N, bits, false}, N / 2, N);
              record(v.out[kGroup], shape(m ? "row-major" : "row-major-sym", M, N, K, bits), mismatch(got, want, 1e-5));
            }
          }
        }
      }
    }
  }
}

void check_panel(Rng& r, const KernelTable* ref, std::vector<Variant>& vs) {
  for (int bits : {4, 5, 6, 8}) {
    for (int64_t K : {32, 96, 576, 1536}) {
      for (int64_t N : {16, 48}) {
        const int64_t G = K / 32, P = N / 16;
        const std::vector<uint8_t> q = panels(codes(r, N, K, bits), N, K, bits);
        const std::vector<uint16_t> d = halves(r, N * G), mn = halves(r, N * G);  // [N / 16, G, 16]
        for (int64_t M : kRows) {
          std::vector<float> x = activations(r, M, K);
          GroupActsBuf a;
          a.quantize(x.data(), M, K);
          for (const uint16_t* m : {mn.data(), static_cast<const uint16_t*>(nullptr)}) {  // null: symmetric
            std::vector<float> want(M * N, NAN);
            ref->panel_rows(a.view(), {q.data(), d.data(), m, want.data(), N, bits, true}, 0, P);
            for (auto& v : vs) {
              if (!v.runs || v.ref) continue;
              std::vector<float> got(M * N, NAN);
              v.table()->panel_rows(a.view(), {q.data(), d.data(), m, got.data(), N, bits, true}, 0, P / 2);
              v.table()->panel_rows(a.view(), {q.data(), d.data(), m, got.data(), N, bits, true}, P / 2, P);
              record(v.out[kPanel], shape(m ? "panel" : "panel-sym", M, N, K, bits), mismatch(got, want));
            }
          }
        }
      }
    }
  }
}

// Each k-quant form (cpu_kernels.h, KMatrix): 16-wide with Dm and mn, sc / mn per 32, symmetric.
void check_kpanel(Rng& r, const KernelTable* ref, std::vector<Variant>& vs) {
  const char* names[] = {"k-quant panel", "k-quant panel sub32", "k-quant panel symmetric"};
  for (int form = 0; form < 3; ++form) {
    for (int bits : {4, 5, 6, 8}) {
      for (int64_t K : {256, 1536}) {
        for (int64_t N : {16, 48}) {
          const int64_t G = K / 32, P = N / 16, SB = K / 256;
          const int sub = form == 1 ? 32 : 16;
          const std::vector<uint8_t> q = panels(codes(r, N, K, bits), N, K, bits);
          const std::vector<uint16_t> D = halves(r, N * SB), Dm = halves(r, N * SB);
          std::vector<int8_t> sc(N * (K / sub));
          std::vector<int8_t> mn(N * (K / sub));
          for (auto& v : sc) v = static_cast<int8_t>(r.range(-128, 127));
          for (auto& v : mn) v = static_cast<int8_t>(r.range(-128, 127));
          ruvllm::KMatrix km{q.data(), D.data(), form == 2 ? nullptr : Dm.data(), sc.data(),
                             form == 2 ? nullptr : mn.data(), nullptr, N, bits, sub};
          for (int64_t M : kRows) {
            std::vector<float> x = activations(r, M, K);
            GroupActsBuf a;
            a.quantize(x.data(), M, K);
            std::vector<float> want(M * N, NAN);
            km.y = want.data();
            ref->kpanel_rows(a.view(), km, 0, P);
            for (auto& v : vs) {
              if (!v.runs || v.ref) continue;
              std::vector<float> got(M * N, NAN);
              km.y = got.data();
              v.table()->kpanel_rows(a.view(), km, 0, P / 2);
              v.table()->kpanel_rows(a.view(), km, P / 2, P);
              record(v.out[kKPanel], shape(names[form], M, N, K, bits), mismatch(got, want));
            }
          }
        }
      }
    }
  }
}

void check_decode(Rng& r, const KernelTable* ref, std::vector<Variant>& vs) {
  // first: each sequence's first key (a sliding window raises it above 0).
  struct Config { int64_t L, NB, BS, H, KVH, D, Bd; std::vector<int32_t> context, first; };
  const Config configs[] = {{2, 10, 4, 9, 3, 64, 5, {1, 5, 19, 0}, {0, 2, 11, 0}},
                            {1, 6, 16, 4, 4, 40, 3, {33, 7, 48}, {0, 0, 20}}};
  for (const Config& c : configs) {
    const int64_t S = static_cast<int64_t>(c.context.size());
    std::vector<float> k(c.L * c.NB * c.BS * c.KVH * c.D), vv(k.size()), q(S * c.H * c.D);
    for (auto& v : k) v = r.normal();
    for (auto& v : vv) v = r.normal();
    for (auto& v : q) v = r.normal();
    std::vector<int32_t> tables(S * c.Bd);
    for (auto& t : tables) t = static_cast<int32_t>(r.range(0, c.NB - 1));
    std::vector<float> scratch(c.H / c.KVH * c.Bd * c.BS + 1);
    auto run = [&](const KernelTable* t, std::vector<float>& out) {
      ruvllm::DecodeJob j{q.data(), k.data(), vv.data(), tables.data(), c.context.data(), c.first.data(),
                          out.data(),
                          S, c.H, c.D, c.NB, c.BS, c.KVH, c.Bd, c.L - 1, 1.f / std::sqrt(static_cast<float>(c.D))};
      for (int64_t s = 0; s < S; ++s)
        for (int64_t g = 0; g < c.KVH; ++g) t->decode(j, s, g, scratch.data());
    };
    std::vector<float> want(q.size(), NAN);
    run(ref, want);
    // decode_part: each task's keys in two ranges, merged here as the FFI handler merges them (the
    // larger m rescales the other range's weights), against the reference's whole-range decode.
    const int64_t group = c.H / c.KVH;
    auto run_split = [&](const KernelTable* t, std::vector<float>& out) {
      ruvllm::DecodeJob j{q.data(), k.data(), vv.data(), tables.data(), c.context.data(), c.first.data(),
                          out.data(),
                          S, c.H, c.D, c.NB, c.BS, c.KVH, c.Bd, c.L - 1, 1.f / std::sqrt(static_cast<float>(c.D))};
      std::vector<float> o[2], st[2];
      for (int i = 0; i < 2; ++i) o[i].assign(group * c.D, NAN), st[i].assign(2 * group, NAN);
      for (int64_t s = 0; s < S; ++s) {
        const int64_t end = std::max<int64_t>(0, std::min<int64_t>(c.context[s], c.Bd * c.BS));
        const int64_t t0 = std::max<int64_t>(0, std::min<int64_t>(c.first[s], end)), mid = t0 + (end - t0) / 3;
        for (int64_t g = 0; g < c.KVH; ++g) {
          t->decode_part(j, s, g, t0, mid, scratch.data(), o[0].data(), st[0].data());
          t->decode_part(j, s, g, mid, end, scratch.data(), o[1].data(), st[1].data());
          for (int64_t hh = 0; hh < group; ++hh) {
            const float m = std::fmax(st[0][hh], st[1][hh]);
            float w[2], l = 0.f;
            for (int i = 0; i < 2; ++i) {
              w[i] = st[i][group + hh] > 0.f ? std::exp(st[i][hh] - m) : 0.f;
              l += w[i] * st[i][group + hh];
            }
            float* dst = out.data() + (s * c.H + g * group + hh) * c.D;
            for (int64_t d = 0; d < c.D; ++d)
              dst[d] = l > 0.f ? (w[0] * o[0][hh * c.D + d] + w[1] * o[1][hh * c.D + d]) / l : 0.f;
          }
        }
      }
    };
    for (auto& v : vs) {
      if (!v.runs) continue;
      std::vector<float> got(q.size(), NAN);
      if (!v.ref) {
        run(v.table(), got);
        record(v.out[kDecode], shape("decode", S, c.H, c.D), mismatch(got, want, 1e-5));
      }
      std::fill(got.begin(), got.end(), NAN);
      run_split(v.table(), got);
      record(v.out[kDecode], shape("decode_part", S, c.H, c.D), mismatch(got, want, 1e-5));
    }
  }
}

void check_prefill(Rng& r, const KernelTable* ref, std::vector<Variant>& vs) {
  // Tiles of queries of one sequence: ragged contexts, a sliding-window first key, padding (0).
  struct Config { int64_t L, NB, BS, H, KVH, D, Bd; std::vector<int32_t> seq, context, first; };
  const Config configs[] = {{2, 10, 4, 9, 3, 64, 6, {0, 0, 0, 0, 1, 1}, {3, 4, 5, 6, 19, 0}, {0, 0, 2, 0, 11, 0}},
                            {1, 8, 16, 4, 1, 40, 3, {0, 0, 0}, {33, 34, 35}, {0, 20, 0}},
                            {1, 6, 4, 8, 8, 16, 5, {0, 0}, {1, 2}, {0, 0}}};
  for (const Config& c : configs) {
    const int64_t N = static_cast<int64_t>(c.seq.size()), S = c.seq.back() + 1;
    std::vector<float> k(c.L * c.NB * c.BS * c.KVH * c.D), vv(k.size()), q(N * c.H * c.D);
    for (auto& v : k) v = r.normal();
    for (auto& v : vv) v = r.normal();
    for (auto& v : q) v = r.normal();
    std::vector<int32_t> tables(S * c.Bd);
    for (auto& t : tables) t = static_cast<int32_t>(r.range(0, c.NB - 1));
    const int64_t rows = N * (c.H / c.KVH);
    std::vector<float> scratch(ruvllm::prefill_scratch(rows, c.Bd * c.BS, c.D));
    auto run = [&](const KernelTable* t, std::vector<float>& out) {
      ruvllm::PrefillJob j{q.data(), k.data(), vv.data(), tables.data(), c.seq.data(), c.context.data(),
                           c.first.data(), out.data(), N, S, c.H, c.D, c.NB, c.BS, c.KVH, c.Bd, c.L - 1,
                           1.f / std::sqrt(static_cast<float>(c.D))};
      // One tile per run of the same sequence, as the handler forms them.
      for (int64_t i = 0; i < N;) {
        int64_t e = i + 1;
        while (e < N && c.seq[e] == c.seq[i]) ++e;
        for (int64_t g = 0; g < c.KVH; ++g) t->prefill(j, i, e, g, scratch.data());
        i = e;
      }
    };
    std::vector<float> want(q.size(), NAN);
    run(ref, want);
    for (auto& v : vs) {
      if (!v.runs || v.ref) continue;
      std::vector<float> got(q.size(), NAN);
      run(v.table(), got);
      record(v.out[kPrefill], shape("prefill", N, c.H, c.D), mismatch(got, want, 1e-5));
    }
  }
}

// Float16 bits to float: exact (rand_half makes no infinities or NaNs).
float widen_half(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24) : std::ldexp(static_cast<float>(1024 + m), e - 25);
  return (h & 0x8000) ? -v : v;
}

// 16-bit caches (cpu_kernels.h, KvType): each variant's decode (whole and in two ranges) and prefill
// over float16 and bfloat16 caches equal, bit for bit, the same variant over float32 caches holding
// the same values (rows are widened exactly, then the float32 arithmetic runs). D = 36 leaves a tail
// after 8-wide conversions.
void check_attention16(Rng& r, std::vector<Variant>& vs) {
  const int64_t L = 2, NB = 10, BS = 4, H = 6, KVH = 2, D = 36, Bd = 5, S = 3;
  const std::vector<int32_t> context = {1, 9, 20}, first = {0, 2, 0};
  const std::vector<int32_t> seq = {0, 1, 1, 2, 2, 2}, pcontext = {1, 8, 9, 18, 19, 20}, pfirst = {0, 0, 3, 0, 0, 0};
  const int64_t n = L * NB * BS * KVH * D, N = static_cast<int64_t>(seq.size());
  std::vector<int32_t> tables(S * Bd);
  for (auto& t : tables) t = static_cast<int32_t>(r.range(0, NB - 1));
  std::vector<float> q(S * H * D), qp(N * H * D);
  for (auto& v : q) v = r.normal();
  for (auto& v : qp) v = r.normal();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  for (int kv : {ruvllm::kKvF16, ruvllm::kKvBF16}) {
    std::vector<uint16_t> k16(n), v16(n);
    std::vector<float> k(n), vv(n);
    for (int64_t i = 0; i < n; ++i) {
      for (auto [h, f] : {std::pair<uint16_t*, float*>{&k16[i], &k[i]}, {&v16[i], &vv[i]}}) {
        if (kv == ruvllm::kKvF16) {
          *h = rand_half(r);
          *f = widen_half(*h);
        } else {
          float x = r.normal();
          uint32_t bits;
          std::memcpy(&bits, &x, 4);
          *h = static_cast<uint16_t>(bits >> 16);
          bits = static_cast<uint32_t>(*h) << 16;
          std::memcpy(f, &bits, 4);
        }
      }
    }
    const char* name = kv == ruvllm::kKvF16 ? "float16" : "bfloat16";
    for (auto& v : vs) {
      if (!v.runs || v.ref) continue;
      const KernelTable* t = v.table();
      std::vector<float> want(q.size(), NAN), got(q.size(), NAN), scratch(H / KVH * Bd * BS + 1);
      for (bool half : {false, true}) {
        ruvllm::DecodeJob j{q.data(), k.data(), vv.data(), tables.data(), context.data(), first.data(),
                            (half ? got : want).data(), S, H, D, NB, BS, KVH, Bd, L - 1, scale};
        if (half) j.k = j.v = nullptr, j.k16 = k16.data(), j.v16 = v16.data(), j.kv = kv;
        for (int64_t s = 0; s < S; ++s)
          for (int64_t g = 0; g < KVH; ++g) t->decode(j, s, g, scratch.data());
      }
      record(v.out[kDecode], std::string("decode over ") + name, mismatch(got, want));
      const int64_t group = H / KVH, end = context[2], mid = 7;
      std::vector<float> o[2], st[2];
      for (bool half : {false, true}) {
        ruvllm::DecodeJob j{q.data(), k.data(), vv.data(), tables.data(), context.data(), first.data(),
                            nullptr, S, H, D, NB, BS, KVH, Bd, L - 1, scale};
        if (half) j.k = j.v = nullptr, j.k16 = k16.data(), j.v16 = v16.data(), j.kv = kv;
        o[half].assign(2 * group * D, NAN);
        st[half].assign(4 * group, NAN);
        t->decode_part(j, 2, 1, 0, mid, scratch.data(), o[half].data(), st[half].data());
        t->decode_part(j, 2, 1, mid, end, scratch.data(), o[half].data() + group * D, st[half].data() + 2 * group);
      }
      record(v.out[kDecode], std::string("decode_part over ") + name, mismatch(o[1], o[0]) + mismatch(st[1], st[0]));
      std::vector<float> pwant(qp.size(), NAN), pgot(qp.size(), NAN);
      std::vector<float> pscratch(ruvllm::prefill_scratch(N * group, Bd * BS, D));
      for (bool half : {false, true}) {
        ruvllm::PrefillJob j{qp.data(), k.data(), vv.data(), tables.data(), seq.data(), pcontext.data(),
                             pfirst.data(), (half ? pgot : pwant).data(), N, S, H, D, NB, BS, KVH, Bd, 0, scale};
        if (half) j.k = j.v = nullptr, j.k16 = k16.data(), j.v16 = v16.data(), j.kv = kv;
        for (int64_t i = 0; i < N;) {
          int64_t e = i + 1;
          while (e < N && seq[e] == seq[i]) ++e;
          for (int64_t g = 0; g < KVH; ++g) t->prefill(j, i, e, g, pscratch.data());
          i = e;
        }
      }
      record(v.out[kPrefill], std::string("prefill over ") + name, mismatch(pgot, pwant));
    }
  }
}

void check_lora(Rng& r, const KernelTable* ref, std::vector<Variant>& vs) {
  // Tokens with their own slots (-1: none) against stacked, side-by-side factors.
  struct Config { int64_t L, S, R, IN, OUT; std::vector<int32_t> slot; };
  const Config configs[] = {{2, 3, 4, 64, 64, {0, 2, -1, 1, 1}}, {1, 2, 16, 37, 19, {1, 0, 1}}};
  for (const Config& c : configs) {
    const int64_t T = static_cast<int64_t>(c.slot.size()), SR = c.S * c.R;
    std::vector<float> x(T * c.IN), a(c.L * SR * c.IN), bt(c.L * SR * c.OUT);
    for (auto& v : x) v = r.normal();
    for (auto& v : a) v = r.normal();
    for (auto& v : bt) v = r.normal();
    auto run = [&](const KernelTable* t, std::vector<float>& out) {
      ruvllm::LoraJob j{x.data(), a.data(), bt.data(), c.slot.data(), out.data(), T, c.IN, c.OUT, SR, c.R, c.L - 1};
      t->lora_rows(j, 0, T);
    };
    std::vector<float> want(T * c.OUT, NAN);
    run(ref, want);
    for (auto& v : vs) {
      if (!v.runs || v.ref) continue;
      std::vector<float> got(T * c.OUT, NAN);
      run(v.table(), got);
      record(v.out[kLora], shape("lora", T, c.IN, c.OUT), mismatch(got, want, 1e-5));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Variant> vs;
#define ADD_VARIANT(sym) \
  vs.push_back({#sym, ruvllm_kernels_##sym, ruvllm_kernels_##sym != nullptr && cpu_runs(#sym), vs.empty(), {}});
  VARIANTS(ADD_VARIANT)
  if (argc > 1 && std::strcmp(argv[1], "--list") == 0) {
    std::string names;
    for (const auto& v : vs)
      if (v.runs) names += (names.empty() ? "" : ",") + std::string(v.name);
    std::printf("%s\n", names.c_str());
    return 0;
  }
  if (!vs[0].runs) {
    std::printf("scalar variant not linked\n");
    return 2;
  }
  Rng rng{20240611};
  for (int bits : {4, 5, 6, 8})
    if (!layouts_agree(codes(rng, 32, 96, bits), 32, 96, bits)) {
      std::printf("harness: its %d-bit layouts differ from cpu_kernels.h's code_at\n", bits);
      return 2;
    }
  const KernelTable* ref = vs[0].table();
  check_quantize(rng, vs);
  check_w8a8(rng, ref, vs);
  check_group(rng, ref, vs);
  check_panel(rng, ref, vs);
  check_kpanel(rng, ref, vs);
  check_decode(rng, ref, vs);
  check_prefill(rng, ref, vs);
  check_attention16(rng, vs);
  check_lora(rng, ref, vs);

  bool failed = false;
  for (const auto& v : vs) {
    for (int k = 0; k < kNumKernels; ++k) {
      if (v.ref && k != kQuantize) continue;
      const Outcome& o = v.out[k];
      if (v.table == nullptr) {
        std::printf("%-14s %-16s MISSING (not linked)\n", v.name, kKernels[k]);
      } else if (!v.runs) {
        std::printf("%-14s %-16s SKIP (this CPU lacks its instructions)\n", v.name, kKernels[k]);
      } else if (o.failed == 0) {
        std::printf("%-14s %-16s PASS (%d cases)\n", v.name, kKernels[k], o.cases);
      } else {
        failed = true;
        std::printf("%-14s %-16s FAIL (%d of %d cases; first: %s)\n", v.name, kKernels[k], o.failed, o.cases,
                    o.first.c_str());
      }
    }
  }
  return failed ? 1 : 0;
}
