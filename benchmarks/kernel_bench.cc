// Panel kernels of several builds of cpu_kernels_variant.cc timed in one process, interleaved.
//
// Built by bench_kernels.py: each build is the variant source (this tree's or another commit's)
// compiled with one ISA's flags and -DRUVLLM_VARIANT=<label>; this file is compiled with
// -DRUVLLM_TABLES="X(label1) X(label2) ..." and linked with them. Interleaving the builds call by call
// keeps a shared VM's drift (other tenants, clock) out of their ratios, which separate processes do
// not: on the 2-core VMs here two runs of one binary differ by 10-20%.
//
// Usage: kernel_bench BITS N K M KQUANT REPS ROUNDS
//   one matrix of N x K codes of BITS bits against M activation rows; KQUANT 0: GroupMatrix factors,
//   1: k-quant factors per 16 with mins, 2: per 32 with mins (Q4_K / Q5_K as the file has them),
//   3: symmetric per 16 (Q6_K as the file has it);
//   prints one line per build: the median over ROUNDS of the mean time of REPS calls, in us.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu_kernels.h"

#ifndef RUVLLM_TABLES
#error "compile with -DRUVLLM_TABLES=\"X(label) ...\""
#endif
#define X(sym) RUVLLM_DECLARE_VARIANT(sym);
RUVLLM_TABLES
#undef X

namespace {

uint64_t g_state = 88172645463325252ull;
uint64_t next() {
  g_state ^= g_state << 13;
  g_state ^= g_state >> 7;
  g_state ^= g_state << 17;
  return g_state;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s BITS N K M KQUANT REPS ROUNDS\n", argv[0]);
    return 2;
  }
  const int bits = std::atoi(argv[1]);
  const int64_t N = std::atoll(argv[2]), K = std::atoll(argv[3]), M = std::atoll(argv[4]);
  const int kform = std::atoi(argv[5]);
  const bool kq = kform != 0;
  const int reps = std::atoi(argv[6]), rounds = std::atoi(argv[7]);
  if (N % 16 || K % 32 || (kq && K % 256) || M < 1 || reps < 1 || rounds < 1 || kform < 0 || kform > 3) {
    std::fprintf(stderr, "N must be a multiple of 16, K of 32 (256 for k-quants)\n");
    return 2;
  }
#define ENTRY(sym) {#sym, ruvllm_kernels_##sym()},
  struct Build {
    const char* label;
    const ruvllm::KernelTable* table;
  };
#define X ENTRY
  const std::vector<Build> builds = {RUVLLM_TABLES};
#undef X
  const int64_t G = K / 32, Gp = (G + 15) / 16 * 16, gb = ruvllm::group_bytes(bits);
  std::vector<uint8_t> q(N * G * gb);
  for (auto& b : q) b = static_cast<uint8_t>(next());
  std::vector<uint16_t> d(N * G);
  for (auto& h : d) h = static_cast<uint16_t>(0x2000 + (next() & 0x3ff));  // float16 in [2^-7, 2^-6)
  std::vector<float> x(M * K);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(next() % 2001) - 1000) / 1000.f;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * Gp), sx(M * Gp), sx16(M * 2 * Gp);
  std::vector<int32_t> isum(M * Gp), isum16(M * 2 * Gp);
  builds[0].table->quantize_groups(x.data(), M, K,
                                   {xq.data(), dx.data(), sx.data(), sx16.data(), isum.data(), isum16.data(), Gp});
  const ruvllm::GroupActs acts{xq.data(), nullptr, dx.data(), sx.data(), isum.data(), isum16.data(), sx16.data(),
                               M, K, G, Gp};
  std::vector<float> y(M * N);
  const ruvllm::GroupMatrix plain{q.data(), d.data(), nullptr, y.data(), N, bits, true};
  const int64_t SB = std::max<int64_t>(K / 256, 1);
  std::vector<uint16_t> D(N * SB), Dm(N * SB);
  for (auto& h : D) h = static_cast<uint16_t>(0x2000 + (next() & 0x3ff));
  for (auto& h : Dm) h = static_cast<uint16_t>(0x2000 + (next() & 0x3ff));
  std::vector<int8_t> sc(N * K / 16), mn(N * K / 16);
  for (auto& v : sc) v = static_cast<int8_t>(next() % 64);
  for (auto& v : mn) v = static_cast<int8_t>(next() % 64);
  const bool sym = kform == 3;
  const ruvllm::KMatrix kmat{q.data(), D.data(), sym ? nullptr : Dm.data(), sc.data(), sym ? nullptr : mn.data(),
                             y.data(), N, bits, kform == 2 ? 32 : 16};
  const int64_t panels = N / 16;
  std::vector<std::vector<double>> times(builds.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t b = 0; b < builds.size(); ++b) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) {
        if (kq)
          builds[b].table->kpanel_rows(acts, kmat, 0, panels);
        else
          builds[b].table->panel_rows(acts, plain, 0, panels);
      }
      times[b].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps);
    }
  }
  for (size_t b = 0; b < builds.size(); ++b) {
    std::sort(times[b].begin(), times[b].end());
    std::printf("%s %.3f\n", builds[b].label, times[b][times[b].size() / 2] * 1e6);
  }
  return 0;
}
