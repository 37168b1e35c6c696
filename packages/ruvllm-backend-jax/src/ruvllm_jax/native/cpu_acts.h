// ruvllm CPU kernels: a call's activations quantized once for all its matrices, in buffers the
// handlers own (cpu_ffi.cc); the kernels see cpu_kernels.h's views of them (RowActs, GroupActs).
#ifndef RUVLLM_CPU_ACTS_H_
#define RUVLLM_CPU_ACTS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "cpu_kernels.h"

#pragma GCC visibility push(hidden)  // the library's own: only its extern "C" entry points are exported
namespace ruvllm {

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

  RowActs view() const { return {q.data(), a.data(), scale.data(), M, K, Kp}; }
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

  GroupActs view() const {
    return {q.data(), with_q4 ? q4.data() : nullptr, dx.data(), sx.data(), isum.data(), isum16.data(),
            sx16.data(), M, K, G, Gp};
  }
};

}  // namespace ruvllm
#pragma GCC visibility pop

#endif  // RUVLLM_CPU_ACTS_H_
