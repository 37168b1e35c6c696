// ruvllm CPU kernels: the CPU's features and the choice of ISA variant (see cpu_isa.h). Built for the
// baseline ISA of the target architecture, like the rest of the library outside the variants.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__aarch64__)
#include <sys/auxv.h>
#endif

#include "cpu_isa.h"

using ruvllm::KernelTable;

// Every variant the build may hold; those it did not compile (another architecture) are null.
#define RUVLLM_VARIANTS(X) \
  X(scalar) X(avx2) X(avxvnni) X(avxvnni_evex) X(avx512vnni) X(neon) X(neon_dotprod) X(neon_i8mm)
#define RUVLLM_WEAK_DECL(sym) extern "C" const KernelTable* ruvllm_kernels_##sym() __attribute__((weak));
RUVLLM_VARIANTS(RUVLLM_WEAK_DECL)

namespace {

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

bool usable(const Variant& v, unsigned f) { return v.table != nullptr && (v.needs & f) == v.needs; }

}  // namespace

const KernelTable* ruvllm::kernels() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  return t != nullptr ? t : ruvllm_kernels_scalar();
}

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
extern "C" const char* ruvllm_isa_build() { return ruvllm::kernels()->name; }
