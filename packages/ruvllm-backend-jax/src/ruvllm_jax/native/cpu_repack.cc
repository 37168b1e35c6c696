// GGUF k-quant blocks (Q4_K, Q5_K, Q6_K) repacked straight into the form the k-quant panel kernels
// read (cpu_kernels.h, KMatrix): the same bytes ruvllm_jax's NumPy conversion gives
// (gguf_blocks.wxa8_from_gguf_blocks, kernel_form or sixteen_form with common_format's widening,
// quant.to_panels), made in one pass over the file's blocks instead of a dozen whole-matrix NumPy
// passes. Loading an 8B Q4_K_M file spent about a minute in those passes; here it is about as long as
// reading the bytes.
//
// Every weight keeps the file's value: codes are moved, never recomputed, and the factors are the
// file's float16 bits (in the 16-wide form, Q6_K's offset 32 d is d with its exponent raised by 5:
// exact, or refused when it would overflow float16).

#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"
#include "cpu_pool.h"

namespace {

enum GgmlType : int { kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

constexpr int64_t kSuper = 256;

int64_t block_bytes(int type) { return type == kQ4_K ? 144 : type == kQ5_K ? 176 : type == kQ6_K ? 210 : 0; }

uint16_t half_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

bool half_finite(uint16_t h) { return (h & 0x7C00) != 0x7C00; }

// 32 * h in float16, exact (a power of two), or false where it overflows.
bool half_times_32(uint16_t h, uint16_t* out) {
  const uint16_t sign = h & 0x8000, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  if (e != 0) {
    if (e + 5 >= 31) return false;
    *out = static_cast<uint16_t>(sign | ((e + 5) << 10) | m);
    return true;
  }
  if (m < 32) {  // still subnormal: m 2^-24 * 32 = (32 m) 2^-24
    *out = static_cast<uint16_t>(sign | (m << 5));
    return true;
  }
  int p = 9;  // m 2^-19 with m's top bit at p (5 .. 9): exponent field p - 4, mantissa m's lower bits
  while (!(m >> p)) --p;
  *out = static_cast<uint16_t>(sign | ((p - 4) << 10) | ((m << (10 - p)) & 0x3FF));
  return true;
}

// The 8 six-bit scales and mins of a Q4_K / Q5_K block's 12 scale bytes.
void scales_mins(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[4 + j] & 0x3F;
    sc[4 + j] = static_cast<uint8_t>((s[8 + j] & 0x0F) | ((s[j] >> 6) << 4));
    mn[4 + j] = static_cast<uint8_t>((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
  }
}

// The 256 codes of one block in value order (0 .. 63).
void block_codes(int type, const uint8_t* b, uint8_t* c) {
  if (type == kQ6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int v = 0; v < 256; ++v) {
      const int h = v / 128, i = v % 128;
      const int low = (ql[64 * h + i % 64] >> (4 * (i / 64))) & 0x0F;
      const int high = (qh[32 * h + i % 32] >> (2 * (i / 32))) & 0x03;
      c[v] = static_cast<uint8_t>(low | (high << 4));
    }
    return;
  }
  const uint8_t* qs = b + (type == kQ4_K ? 16 : 48);
  for (int v = 0; v < 256; ++v) {
    const int r = v / 64, i = v % 64;
    c[v] = (qs[32 * r + i % 32] >> (4 * (i / 32))) & 0x0F;
  }
  if (type == kQ5_K) {
    const uint8_t* qh = b + 16;
    for (int v = 0; v < 256; ++v) c[v] |= static_cast<uint8_t>(((qh[v % 32] >> (v / 32)) & 1) << 4);
  }
}

// A group's code bytes in the `bits`-wide form (cpu_kernels.h, code_at) written at their panel
// place: dword t of the group's bytes to run t, slot r (row n % 16) of panel n / 16.
void put_bytes(const uint8_t* out, int bits, int64_t n, int64_t g, int64_t G, uint8_t* q) {
  const int64_t gb = ruvllm::group_bytes(bits);
  uint8_t* at = q + (n / 16) * 16 * G * gb + g * gb * 16 + (n % 16) * 4;
  for (int64_t t = 0; t < gb / 4; ++t) std::memcpy(at + 64 * t, out + 4 * t, 4);
}

// Group g's 32 codes of row n (value order, 0 .. 63) in the `bits`-wide form at their panel place.
void put_group(const uint8_t* c, int bits, int64_t n, int64_t g, int64_t G, uint8_t* q) {
  uint8_t out[24];
  for (int j = 0; j < 16; ++j) out[j] = static_cast<uint8_t>((c[j] & 0x0F) | ((c[16 + j] & 0x0F) << 4));
  if (bits == 5) {
    for (int k = 0; k < 4; ++k) {
      uint8_t byte = 0;
      for (int i = 0; i < 8; ++i) byte |= static_cast<uint8_t>(((c[4 * i + k] >> 4) & 1) << i);
      out[16 + k] = byte;
    }
  } else if (bits == 6) {
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k) {
        uint8_t byte = 0;
        for (int t = 0; t < 4; ++t) byte |= static_cast<uint8_t>(((c[16 * h + 4 * t + k] >> 4) & 3) << (2 * t));
        out[16 + 4 * h + k] = byte;
      }
  }
  put_bytes(out, bits, n, g, G, q);
}

// Q4_K's codes kept 4-bit: the file's run of 32 bytes holds group 2 r in its low nibbles and group
// 2 r + 1 in its high ones; the form packs codes j and 16 + j of a group in one byte.
void put_q4_k_block(const uint8_t* qs, int64_t n, int64_t g0, int64_t G, uint8_t* q) {
  uint8_t lo[16], hi[16];
  for (int r = 0; r < 4; ++r) {
    const uint8_t* run = qs + 32 * r;
    for (int j = 0; j < 16; ++j) {
      lo[j] = static_cast<uint8_t>((run[j] & 0x0F) | ((run[16 + j] & 0x0F) << 4));
      hi[j] = static_cast<uint8_t>((run[j] >> 4) | (run[16 + j] & 0xF0));
    }
    put_bytes(lo, 4, n, g0 + 2 * r, G, q);
    put_bytes(hi, 4, n, g0 + 2 * r + 1, G, q);
  }
}

}  // namespace

// Repacks one matrix of N rows of K values (src: N rows of K / 256 blocks of `type`) into a panel
// k-quant form (cpu_kernels.h, KMatrix): q [N / 16, K / 32, gb, 16]-ordered panel bytes, D (and Dm)
// float16 bits [N / 16, K / 256, 16], sc (and mn) int8 [N / 16, K / sub, 16].
// own != 0: the type's own form, `bits` its width: Q4_K / Q5_K with sub 32 (their 6-bit scales and
//   mins), Q6_K symmetric with sub 16 (Dm and mn not written; they may be null): the file's bytes.
// own == 0: the 16-wide form with `bits`-wide codes (no narrower than the type's own: 4 for Q4_K, 5
//   for Q5_K, 6 for Q6_K), Dm and mn written, sub 16, which every k-quant shares (one weight's layers
//   in different types).
// Returns 0; 1 for a non-finite float16 factor and 2 for a Q6_K factor whose 32-fold overflows
// float16 in the 16-wide form (bad_row / bad_block name the first such block), 3 for arguments it
// does not take (a type it does not repack, N not a multiple of 16, K not of 256, bits narrower than
// the type's or wider than 6, or another width than the type's own for its own form).
extern "C" int ruvllm_repack_kquant(const uint8_t* src, int64_t N, int64_t K, int type, int bits, int own_form,
                                    uint8_t* q, uint16_t* D, uint16_t* Dm, int8_t* sc, int8_t* mn, int64_t* bad_row,
                                    int64_t* bad_block) {
  const int own = type == kQ4_K ? 4 : type == kQ5_K ? 5 : type == kQ6_K ? 6 : 0;
  if (own == 0 || N % 16 != 0 || K % kSuper != 0 || N <= 0 || bits < own || bits > 6 || (own_form && bits != own))
    return 3;
  const int64_t bb = block_bytes(type), SB = K / kSuper, G = K / 32, S16 = K / 16;
  // The factors first, all of them: a bad one is refused before anything is written.
  for (int64_t n = 0; n < N; ++n)
    for (int64_t s = 0; s < SB; ++s) {
      const uint8_t* b = src + (n * SB + s) * bb;
      const uint16_t d = half_at(b + (type == kQ6_K ? 208 : 0));
      uint16_t unused;
      int why = 0;
      if (!half_finite(d) || (type != kQ6_K && !half_finite(half_at(b + 2))))
        why = 1;
      else if (type == kQ6_K && !own_form && !half_times_32(d, &unused))
        why = 2;
      if (why) {
        *bad_row = n;
        *bad_block = s;
        return why;
      }
    }
  const int64_t panels = N / 16;
  const int parts = static_cast<int>(std::min<int64_t>(panels, ruvllm::Pool::get().threads()));
  ruvllm::Pool::get().run(
      [&](int part) {
        uint8_t c[kSuper];
        for (int64_t P = panels * part / parts; P < panels * (part + 1) / parts; ++P)
          for (int64_t r = 0; r < 16; ++r) {
            const int64_t n = P * 16 + r;
            for (int64_t s = 0; s < SB; ++s) {
              const uint8_t* b = src + (n * SB + s) * bb;
              if (type == kQ4_K && bits == 4) {
                put_q4_k_block(b + 16, n, s * 8, G, q);
              } else {
                block_codes(type, b, c);
                for (int64_t g = 0; g < 8; ++g) put_group(c + 32 * g, bits, n, s * 8 + g, G, q);
              }
              const int64_t f = (P * SB + s) * 16 + r;
              if (type == kQ6_K) {
                D[f] = half_at(b + 208);
                if (!own_form) half_times_32(D[f], &Dm[f]);
                for (int j = 0; j < 16; ++j) {
                  const int64_t k = (P * S16 + s * 16 + j) * 16 + r;
                  sc[k] = static_cast<int8_t>(b[192 + j]);
                  if (!own_form) mn[k] = sc[k];
                }
              } else {
                D[f] = half_at(b);
                Dm[f] = half_at(b + 2);
                uint8_t s6[8], m6[8];
                scales_mins(b + 4, s6, m6);
                if (own_form) {
                  for (int j = 0; j < 8; ++j) {
                    const int64_t k = (P * G + s * 8 + j) * 16 + r;
                    sc[k] = static_cast<int8_t>(s6[j]);
                    mn[k] = static_cast<int8_t>(m6[j]);
                  }
                } else {
                  for (int j = 0; j < 16; ++j) {
                    const int64_t k = (P * S16 + s * 16 + j) * 16 + r;
                    sc[k] = static_cast<int8_t>(s6[j / 2]);
                    mn[k] = static_cast<int8_t>(m6[j / 2]);
                  }
                }
              }
            }
          }
      },
      parts);
  return 0;
}
