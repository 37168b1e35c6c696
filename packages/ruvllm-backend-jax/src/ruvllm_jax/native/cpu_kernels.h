// ruvllm CPU kernels: the types every ISA variant shares and the table a variant exports.
//
// cpu_kernels_variant.cc is compiled once per ISA variant (scalar, avx2, avxvnni, avx512vnni on
// x86-64; neon, neon-dotprod, neon-i8mm on aarch64), each time with its own -m flags and
// RUVLLM_VARIANT set to the variant's symbol name; cpu_isa.cc (built for the baseline ISA) scores
// the CPU's features once and the handlers (cpu_ffi.cc) call the best variant's table. Everything here is plain data: a
// variant translation unit instantiates no std templates and defines its functions with internal
// linkage, so no code built for a wider ISA can be picked by the linker for a narrower one.
#ifndef RUVLLM_CPU_KERNELS_H_
#define RUVLLM_CPU_KERNELS_H_

#include <stdint.h>

namespace ruvllm {

// w8a8: activations quantized to int8 once per row (scale = row max / 127); weights int8 with one
// float32 scale per output channel.
struct RowActs {
  const int8_t* q;      // [M, Kp], zero padded to Kp (a multiple of 64)
  const uint8_t* a;     // [M, Kp], q + 128 (padding 128): the unsigned operand of vpdpbusd
  const float* scale;   // [M]
  int64_t M, K, Kp;
};

struct RowMatrix {
  const int8_t* w;      // [N, K], values in [-127, 127]
  const float* scale;   // [N]
  float* y;             // [M, N]
  int64_t N;
};

// wxa8: weights in groups of 32 along the input (GGUF blocks), activations quantized to int8 per
// group of 32 (dx = max|x| / 127). A weight is d * code + m with an unsigned 4-, 5- or 8-bit code.
// Code bytes per row and group (gb): 4-bit 16 (byte j: code j low nibble, code j + 16 high nibble),
// 8-bit 32 (one per code), 5-bit 20 (the 4-bit layout of the low 4 bits, then a 4-byte plane of the
// codes' bit 4: bit i of plane byte k is code 4i + k's), 6-bit 24 (the 4-bit layout of the low 4
// bits, then 4 bytes of the bit pairs 4-5 of codes 0..15 and 4 of codes 16..31: bits 2t, 2t + 1 of
// pair byte k are those of code 4t + k, or 16 + 4t + k). A plane or pair byte k holds the bits of
// the codes in nibble bytes k, 4 + k, 8 + k, 12 + k, so a vector of 4-byte slices of nibble bytes
// (codes 4t .. 4t+3, or 16+4t ..) and the same slices of the high bytes line up byte for byte: the
// slice's high bits are bit t (or 4 + t) of each plane byte, or bits 2t, 2t + 1 of each pair byte,
// one shift and one mask.
//   y[m, n] = sum_g (p[m, n, g] * (d[n, g] * dx[m, g]) + m[n, g] * sx[m, g]),  p = codes . xq
// the integer dot p exact in int32, then the two float multiply-adds per group in that order, so
// every variant's panel kernel gives the same float32 result, bit for bit.
struct GroupActs {
  const int8_t* q;      // [M, K] natural order
  const int8_t* q4;     // [M, K] in the row-major 4-bit kernel's order (see cpu_acts.h), or null
  const float* dx;      // [M, Gp] (Gp: G padded to a multiple of 16 groups, zeros)
  const float* sx;      // [M, Gp] dx * sum of the group's codes
  const int32_t* isum;  // [M, Gp] sum of the group's codes
  const int32_t* isum16;  // [M, 2 Gp] sum of each half group's codes (k-quants)
  const float* sx16;    // [M, 2 Gp] dx * isum16
  int64_t M, K, G, Gp;
};

// Symmetric formats (GGUF Q4_0, Q5_0, and Q8_0 as code = q + 128) store no offsets: mn is null and
// m = -2^(bits - 1) * d, formed in float32 from the float16 d (exact: a power of two times a float16),
// the same value the stored float16 offset had, so the results are unchanged and 2 bytes per group
// (1/18 of Q8_0's bytes, 1/12 of Q5_0's) are not read.
struct GroupMatrix {
  const uint8_t* q;     // [N, G * gb], row-major or panel layout
  const uint16_t* d;    // [N, G] float16 bits
  const uint16_t* mn;   // [N, G] float16 bits, or null: symmetric (see above)
  float* y;             // [M, N]
  int64_t N;
  int bits;
  bool panel;
};

// k-quants (GGUF Q4_K, Q5_K, Q6_K, and Q2_K / Q3_K; ruvllm_jax.gguf_blocks.kernel_form), always in the
// panel layout: codes as for GroupMatrix (4-bit packed or one byte each) and two-level factors per
// half group h (16 weights):
//   w = (D * sc[h]) * code - (Dm * mn[h])
// with D, Dm float16 per super-block of 256 inputs and sc, mn int8 per 16 or per 32 inputs (`sub`).
// Three forms, each holding the file's values:
// * sub 32 (Q4_K / Q5_K as the file has them): D = d, Dm = dmin, sc / mn the 6-bit scale and min of
//   each sub-block of 32, read for both of its half groups;
// * symmetric (Dm and mn null; Q6_K as the file has it, sub 16): Dm = 2^(bits - 1) D formed in
//   float32 (exact) and mn = sc, so w = D sc (code - 32): the file's bytes, nothing more;
// * sub 16 with both (Q2_K, Q3_K, and layers of one weight stored in different types, brought to one
//   form: gguf_blocks.common_format).
// Every product is exact in float32, so the weights are the file's values. Per group g, the sub 16
// forms do per half h: acc = fma(p_h, (D * sc_h) * dx, acc); acc = fma(-(Dm * mn_h), sx16_h, acc);
// the sub 32 form, whose halves share sc and mn, does the group at once: acc = fma(p_0 + p_1, (D * sc)
// * dx, acc); acc = fma(-(Dm * mn), sx, acc) (half the float operations per integer dot: 1.2x at 8
// and more activation rows on a Zen 4). The same weights in a sub 16 form give the same values to
// float32 rounding, not the same bits.
// Panel layout of the factors: [N / 16, columns, 16] (for each panel and column, its 16 rows).
struct KMatrix {
  const uint8_t* q;     // panel layout, as GroupMatrix
  const uint16_t* D;    // [N / 16, K / 256, 16] float16 bits
  const uint16_t* Dm;   // [N / 16, K / 256, 16] float16 bits, or null: symmetric
  const int8_t* sc;     // [N / 16, K / sub, 16]
  const int8_t* mn;     // [N / 16, K / sub, 16], or null: symmetric (mn = sc)
  float* y;             // [M, N]
  int64_t N;
  int bits;
  int sub = 16;         // inputs per sc / mn: 16 or 32
};

// Where the 16 rows' sc (and mn) of panel p, group g, half group h start.
static inline int64_t ksub_at(const KMatrix& w, int64_t p, int64_t G, int64_t g, int h) {
  return w.sub == 32 ? (p * G + g) * 16 : (p * 2 * G + 2 * g + h) * 16;
}
// The mins a k-quant's kernels read: mn, or sc for a symmetric one.
static inline const int8_t* kmins(const KMatrix& w) { return w.mn != nullptr ? w.mn : w.sc; }
// Dm / D of a symmetric k-quant with `bits`-wide codes: its zero point.
static inline float ksym_zero(int bits) { return static_cast<float>(1 << (bits - 1)); }

// Element type of a paged K/V cache: float32 (k, v), or float16 / bfloat16 (k16, v16), whose rows
// the kernels widen to float32 as they read them (exact), so a 16-bit cache attends as a float32
// cache holding the same values would, with the same arithmetic.
enum KvType : int { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2 };

// Longest row (head dimension) of a 16-bit cache the kernels widen (on the stack).
constexpr int64_t kMaxWidenedRow = 1024;

// Attention of one new token per sequence over its paged cache, read in place: keys at positions
// first[s] .. context[s] - 1 (first > 0 under a sliding window), scores times scale.
struct DecodeJob {
  const float *q, *k, *v;
  const int32_t *tables, *context, *first;
  float* out;
  int64_t S, H, D, NB, BS, KVH, Bd, layer;
  float scale;
  const uint16_t* k16 = nullptr;  // kv != kKvF32: the caches' 16-bit elements (k, v unused)
  const uint16_t* v16 = nullptr;
  int kv = kKvF32;
};

// Attention of several new tokens per sequence (prompt chunks) over the paged cache (see DecodeJob
// for its element types), read in place. Query i (q [N, H, D]) belongs to sequence seq[i] (a row of
// tables [S, Bd]) and sees keys first[i] .. context[i] - 1 (context[i] = its position + 1, clipped; 0
// for padding, which gets zeros). A task is one tile of consecutive queries of one sequence and one kv head: each key and
// value row is loaded once for all the tile's queries and heads.
struct PrefillJob {
  const float *q, *k, *v;
  const int32_t *tables, *seq, *context, *first;
  float* out;
  int64_t N, S, H, D, NB, BS, KVH, Bd, layer;
  float scale;
  const uint16_t* k16 = nullptr;  // as DecodeJob
  const uint16_t* v16 = nullptr;
  int kv = kKvF32;
};

// LoRA updates of a step whose tokens use different adapters: y[t] = B_s (A_s x[t]) for token t's
// slot s (-1: none, y[t] = 0), the slots' factors side by side along the rank: a [L, S * R, IN] and
// bt [L, S * R, OUT] (B transposed, its scale folded in), at `layer`. Each token costs R * (IN + OUT)
// multiply-adds whatever the number of adapters in the step.
struct LoraJob {
  const float *x, *a, *bt;
  const int32_t* slot;
  float* y;
  int64_t T, IN, OUT, SR, R, layer;
};

// Largest rank the LoRA kernel takes (its per-token scratch lives on the stack).
constexpr int64_t kLoraMaxRank = 512;

// Query rows (tile queries x heads per kv head) one prefill task handles at most.
constexpr int64_t kPrefillRows = 48;

// Floats of scratch a prefill task needs for tiles of `rows` query rows over `keys` keys.
static inline int64_t prefill_scratch(int64_t rows, int64_t keys, int64_t D) {
  const int64_t rp = (rows + 15) / 16 * 16;
  return rp * (D + keys + D + 4);
}

// Activations quantized per group of 32 (rows of K = 32 G): codes, dx, sx, isum ([M, Gp]) and the
// half-group isum16, sx16 ([M, 2 Gp]); padding groups are left as the caller set them. Per group:
// dx = max|x| / 127, code = nearbyint(x / dx) clipped to +-127 (zeros for an all-zero group), the
// same values whatever the variant.
struct GroupActsOut {
  int8_t* q;
  float *dx, *sx, *sx16;
  int32_t *isum, *isum16;
  int64_t Gp;
};

// GGUF blocks read as stored (ruvllm_experts_stored: a mixture of experts' matrices left in the file's
// memory map), row-major, each row its blocks in order: Q8_0 34 bytes per 32 inputs (float16 d, 32
// int8 codes), Q4_K 144 per 256 (float16 d and dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks
// of 32, 128 bytes of 4-bit codes), Q6_K 210 per 256 (128 bytes of low nibbles, 64 of high bit pairs,
// 16 int8 scales for sub-blocks of 16, float16 d), MXFP4 17 per 32 (an E8M0 scale byte, 16 bytes of
// 4-bit E2M1 codes: byte j's low nibble is value j, its high nibble value 16 + j). Activations are int8 per block of the type's size
// (32: llama.cpp's q8_0; 256: q8_K), dx = max|x| / 127, code = nearbyint(x / dx). Each block's dot is an
// exact int32 sum, then one float step per block, in block order (so a row's result is the same
// whatever the other rows and whatever the variant):
//   Q8_0: acc += (float)s * (d * dx),                 s = sum codes . xq
//   Q4_K: acc += dx * (d * (float)s1 - dmin * (float)s2),  s1 = sum_j sc_j p_j, s2 = sum_j mn_j xs_j
//   Q6_K: acc += dx * (d * (float)s),                 s = sum_j sc_j (p_j - 32 xs_j)
//   MXFP4: acc += (float)s * (h * dx), s = sum 2 e2m1(code) . xq (doubled values, integers), h = 2^(e - 128)
// (p_j: sub-block j's codes . xq, xs_j: the sum of its xq).
enum StoredType : int { kStoredQ8_0 = 8, kStoredQ4_K = 12, kStoredQ6_K = 14, kStoredMXFP4 = 39 };  // ggml's ids

static inline int64_t stored_block_values(int type) { return type == kStoredQ8_0 || type == kStoredMXFP4 ? 32 : 256; }
static inline int64_t stored_block_bytes(int type) {
  return type == kStoredQ8_0    ? 34
         : type == kStoredQ4_K  ? 144
         : type == kStoredQ6_K  ? 210
         : type == kStoredMXFP4 ? 17
                                : 0;
}

struct StoredActs {
  const int8_t* q;    // [M, K] codes
  const float* dx;    // [M, K / block]
  int64_t M, K;
  const int32_t* xs;  // [M, K / 16] the codes' sums per 16 (k-quants' mins and offsets), else null
};

struct StoredMatrix {
  const uint8_t* w;   // [N, row_bytes]: the file's rows of blocks
  int64_t row_bytes;
  int type;           // StoredType
  float* y;           // row m at y + m * ldy
  int64_t ldy;
};

struct KernelTable {
  const char* name;
  void (*quantize_groups)(const float* x, int64_t M, int64_t K, const GroupActsOut& out);
  // y[:, n0:n1] of one w8a8 matrix.
  void (*w8a8_rows)(const RowActs& x, const RowMatrix& w, int64_t n0, int64_t n1);
  // y[:, n0:n1] of one row-major wxa8 matrix.
  void (*group_rows)(const GroupActs& x, const GroupMatrix& w, int64_t n0, int64_t n1);
  // y[:, 16 p0 : 16 p1] of one panel-layout wxa8 matrix.
  void (*panel_rows)(const GroupActs& x, const GroupMatrix& w, int64_t p0, int64_t p1);
  // y[:, 16 p0 : 16 p1] of one k-quant matrix.
  void (*kpanel_rows)(const GroupActs& x, const KMatrix& w, int64_t p0, int64_t p1);
  // Sequence s, kv head g; scratch holds at least (H / KVH) * context[s] floats.
  void (*decode)(const DecodeJob& j, int64_t s, int64_t g, float* scratch);
  // Keys a .. b - 1 of sequence s, kv head g, unnormalised: o [H / KVH, D] the exp(score - m)-weighted
  // sum of values, stats [2 H / KVH] each head's m (the largest score) then l (the sum of the weights);
  // scratch holds (H / KVH) * (b - a) floats. Ranges of one task merge into its attention (what a
  // sequence with fewer kv heads than threads splits into).
  void (*decode_part)(const DecodeJob& j, int64_t s, int64_t g, int64_t a, int64_t b, float* scratch, float* o,
                      float* stats);
  // Queries q0 .. q1 - 1 (one sequence, (q1 - q0) * H / KVH <= kPrefillRows), kv head g; scratch
  // holds prefill_scratch(rows, keys they see, D) floats.
  void (*prefill)(const PrefillJob& j, int64_t q0, int64_t q1, int64_t g, float* scratch);
  // Tokens t0 .. t1 - 1 of a LoRA update.
  void (*lora_rows)(const LoraJob& j, int64_t t0, int64_t t1);
  // y[:, n0:n1] of one matrix of GGUF blocks as stored (StoredMatrix); x quantized for its block size.
  void (*stored_rows)(const StoredActs& x, const StoredMatrix& w, int64_t n0, int64_t n1);
  // y[t, n] = x[t, :K] . w[n, :K] for every row t < T and n0 <= n < n1 (float32, y's rows N long), each
  // in one fixed order (16 lane sums, then a fixed tree): the same bits on every variant and batch.
  void (*float_rows)(const float* x, const float* w, float* y, int64_t T, int64_t N, int64_t K, int64_t n0,
                     int64_t n1);
};

// The factor m = zero * d of a symmetric group (GroupMatrix.mn null).
static inline float symmetric_zero(int bits) { return -static_cast<float>(1 << (bits - 1)); }

static inline int64_t group_bytes(int bits) { return bits == 4 ? 16 : bits == 5 ? 20 : bits == 6 ? 24 : 32; }

// Byte jb (0..gb-1) of row n, group g in the 16-row panel layout: for panel n / 16 and group g, the
// 16 rows' code bytes are gb / 4 runs of 16 dwords, dword r of run t holding bytes 4t .. 4t+3 of
// row r's group. Scales: 16 per (panel, group).
static inline int64_t panel_byte(int64_t n, int64_t g, int64_t jb, int64_t G, int bits) {
  const int64_t gb = group_bytes(bits);
  return (n / 16) * 16 * G * gb + g * gb * 16 + (jb / 4) * 64 + (n % 16) * 4 + jb % 4;
}

// Code j (0..31) of row n, group g, read byte by byte (the scalar loops' view of every layout).
static inline int32_t code_at(const uint8_t* q, int bits, bool panel, int64_t n, int64_t g, int j, int64_t G) {
  const int64_t gb = group_bytes(bits);
  auto byte = [&](int64_t jb) { return q[panel ? panel_byte(n, g, jb, G, bits) : (n * G + g) * gb + jb]; };
  if (bits == 8) return byte(j);
  const uint8_t b = byte(j & 15);
  const int32_t low = j < 16 ? (b & 0x0F) : (b >> 4);
  if (bits == 4) return low;
  if (bits == 5) return low | (((byte(16 + j % 4) >> (j / 4)) & 1) << 4);
  return low | (((byte(16 + 4 * (j / 16) + j % 4) >> (2 * ((j % 16) / 4))) & 3) << 4);
}

}  // namespace ruvllm

#define RUVLLM_DECLARE_VARIANT(sym) extern "C" const ruvllm::KernelTable* ruvllm_kernels_##sym()

#endif  // RUVLLM_CPU_KERNELS_H_
