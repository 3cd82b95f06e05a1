// Group-quantized matmuls for small batches: y[m, n] = sum_k x[m, k] * w[n, k], where
// w[n, k] = q[n, k] * scales[n, k / g] (+ zeros[n, k / g]). x float32 or bfloat16 [M, K] (unit
// column stride, any row stride); scales / zeros float32 [N, K / g], contiguous; y [M, N] in x's
// dtype (any row stride), float32 accumulation. Two weight formats, contiguous:
//
// * int8 (kvs_int8_group_matmul): q int8 [N, K], one signed code per byte.
// * int4 (kvs_int4_group_matmul): unsigned 4-bit codes 0..15 packed two per byte, uint8
//   [N, K / 2] (K even): byte j of row n holds code k = 2j in its low nibble and k = 2j + 1 in
//   its high nibble. Half the bytes of int8 codes: decode is memory-bound, so this is what
//   Q4_0 / Q4_1 weights want.
//
// Either format may instead be kept in VNNI blocks (16 rows interleaved; see "AVX-512 VNNI path"
// below), which only the avx512-vnni path reads; everything from here to that section is about
// weights kept in rows.
//
// Code paths, picked at run time by CPU features: AVX-512 (F/BW/VL/DQ), AVX2 + FMA, and a
// portable scalar path (any g dividing K). A vector path works on steps of kStep codes and needs
// g % kStep == 0, else the next path that fits runs: int8 steps are 16 (AVX-512) / 8 (AVX2)
// codes, int4 steps 32 / 16. All dequantize each weight once per tile of x rows (q * scale +
// zero: one fma on the vector paths; zeros folded into the weight, so no extra per-group term)
// and accumulate x * w in float32, one lane-wise sum per output, reduced at the end; the order
// of the additions of one output depends only on K and the path, never on M, N, the tiling or
// the thread count (so a row's result does not depend on its batch).
//
// Widening the codes: int8 with vpmovsxbd straight from memory. int4 with vpmovzxbd from memory
// too (one byte, two codes, per int32 lane; on Zen 3 this costs about what the int8 widening
// does, where nibble shuffles cost ~25% more per weight), then the low nibbles (the step's even
// codes) and the high nibbles (its odd codes) as two vectors, with no lane reordering: the x
// rows are copied once per call with each step's columns reordered to match (prepare_x: its even
// columns, then its odd ones). bf16 x is widened to float32 in that same copy (M x K is small).
//
// Tiles: AVX-512, 4 weight rows x up to 4 x rows (16 accumulators; each weight vector widened once
// for 4 rows of x, each x vector loaded once for 4 weight rows). AVX2, 2 weight rows x 4 x rows for
// M > 1 (8 accumulators, with the 4 scales / zeros and the codes in the other 8 ymm registers; ~30%
// faster at M = 4..16 than 4 weight rows x 2 x rows, whose 20 live vectors spill), 4 weight rows x
// 1 x row for M = 1 (int4: row by row within each group). AVX-512 with M >= 12: 4 weight rows at a
// time are dequantized once into a float32 panel that every 4-row x tile then reads (see
// kPanelMinRows; same additions, same results). Weight rows are prefetched into L2 a few
// KB ahead (without it the int8 kernel runs ~3x slower from DRAM). N is split into contiguous
// chunks handed to OpenMP threads dynamically (each streams its chunk in order); each output is
// computed by one thread, so results do not depend on the thread count. Plain C ABI, no torch
// headers; built with -O3 -fopenmp and no -march (target attributes + runtime dispatch).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QMM_X86 1
#include <immintrin.h>
#define QMM_INLINE inline __attribute__((always_inline))
#define QMM_UNROLL _Pragma("GCC unroll 16")
#define QMM_INLINE_LAMBDA __attribute__((always_inline))
#else
#define QMM_X86 0
#endif

#ifndef QMM_PANEL_MB
#define QMM_PANEL_MB 4
#endif
#ifndef QMM_PANEL_NB
#define QMM_PANEL_NB 4
#endif
namespace qmm {

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half -> float, every value (subnormals, infinities, NaN payloads) as numpy converts it.
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | man << 13;
  } else if (exp != 0) {
    bits = sign | (exp + 112) << 23 | man << 13;
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: shift the mantissa up to its leading 1
    int e = 0;
    while (!(man & 0x400)) {
      man <<= 1;
      ++e;
    }
    bits = sign | uint32_t(113 - e) << 23 | (man & 0x3FF) << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

struct Problem {
  const float* x;  // float32 rows: x itself, or its prepared copy (bf16 widened, int4 reordered)
  int64_t x_s0;
  const uint8_t* q;  // weight codes, q_s0 bytes per row (the format decides how they are packed)
  int64_t q_s0;
  const float* scales;
  const float* zeros;  // null: none
  int64_t M, N, K, g, G;  // G = K / g groups per row
  void* y;
  int64_t y_s0;
  bool y_bf16;
  // The avx512-vnni path's x: int16 X [M][K], the step d of each (row, group) [M][G], and
  // d * sum_k X_k [M][G] (for the zeros term).
  const int16_t* xq = nullptr;
  const float* xd = nullptr;
  const float* xz = nullptr;
  // VNNI blocks with compact or float16 scales (kLayoutCompact / kLayoutHalf, below): scales /
  // zeros then point at bytes, cs_bytes of them per 16-row block. zero_mul != 0 (float16 scales
  // only): no zeros array, each group's zero is its scale times zero_mul (Q4_0: -8).
  int layout = 0;
  int64_t sub = 0, cs_bytes = 0;
  float zero_mul = 0.f;
};

// Weight layouts group_matmul takes: rows, VNNI blocks, or VNNI blocks with compact scales.
// Compact scales are for weights whose group scales (and zeros) are a float32 base per
// super-block of 256 weights times a small integer per group, as the K-quants and IQ4_XS store
// them (d * sc: a float16 times at most 8 bits, exact in float32). Per 16-row block: int8 codes
// [G][16] then float16 bases [G / sub][16] (d as the file has it), sub = 256 / g groups a
// super-block; zeros alike. The
// kernels form base * code in float32, the very value the full layout stores, so both layouts
// give the same bits; they read ~0.08 bytes per weight of scales and zeros where the full layout
// reads 0.25 (g = 32), and at batch 1 decode is bound by the bytes it reads.
//
// Float16 scales (kLayoutHalf) are for the formats whose scale is one float16 per group of 32 (Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0): per 16-row block, float16 [G][16], zeros alike or (Q4_0, whose zero is
// -8 d) none: zero_mul. Exact too (the file's float16 widened; -8 d exact in float32). Scales
// read then are 0.0625 bytes per weight against 0.125 (Q4_0: 0.25 with its zeros).
enum : int { kLayoutRows = 0, kLayoutBlocks = 1, kLayoutCompact = 2, kLayoutHalf = 3 };
constexpr int64_t kSuperBlock = 256;
static inline int64_t compact_block_bytes(int64_t G, int64_t sub) { return 16 * G + 32 * (G / sub); }
static inline int64_t half_block_bytes(int64_t G) { return 32 * G; }
// Scale (or zero) of row r, group gi of a block of scale bytes in compact or float16 layout.
static inline float scale_at(int layout, const uint8_t* block, int64_t G, int64_t sub, int64_t gi, int r) {
  uint16_t h;
  if (layout == kLayoutHalf) {
    std::memcpy(&h, block + (gi * 16 + r) * 2, 2);
    return f16_to_f32(h);
  }
  std::memcpy(&h, block + 16 * G + ((gi / sub) * 16 + r) * 2, 2);
  return float(int8_t(block[gi * 16 + r])) * f16_to_f32(h);
}

// Weight formats: how many bytes `codes` codes take, and code k of a row (scalar path);
// nibble(i): the code a 4-bit field i stands for. kRowPaths: whether weights in rows have vector
// paths (NL4 runs on VNNI blocks only).
struct I8 {
  static constexpr int64_t kCodesPerByte = 1;
  static constexpr bool kRowPaths = true, kTable = false;
  static constexpr int64_t bytes(int64_t codes) { return codes; }
  static inline float code(const uint8_t* row, int64_t k) { return float(int8_t(row[k])); }
  static inline int nibble(int i) { return i; }
};
struct U4 {
  static constexpr int64_t kCodesPerByte = 2;
  static constexpr bool kRowPaths = true, kTable = false;
  static constexpr int64_t bytes(int64_t codes) { return codes / 2; }
  static inline float code(const uint8_t* row, int64_t k) { return float((row[k >> 1] >> ((k & 1) << 2)) & 15); }
  static inline int nibble(int i) { return i; }
};
// IQ4_NL / IQ4_XS: 4-bit indices, packed as U4 packs its codes, into ggml's non-linear table
// (kvalues_iq4nl); the code is the table's int8 value, so the weights, the int32 group sums and
// every float op after them are those of the same weight with its values widened to int8 codes
// (I8), at half the bytes. Only the avx512-vnni path reads it (a lookup per code pair: vpermw).
constexpr int8_t kNl4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
struct NL4 {
  static constexpr int64_t kCodesPerByte = 2;
  static constexpr bool kRowPaths = false, kTable = true;
  static constexpr int64_t bytes(int64_t codes) { return codes / 2; }
  static inline float code(const uint8_t* row, int64_t k) {
    return float(kNl4Values[(row[k >> 1] >> ((k & 1) << 2)) & 15]);
  }
  static inline int nibble(int i) { return kNl4Values[i]; }
};
// Q6_K's 6-bit codes (-32..31) kept at the file's bits, in VNNI blocks only: per 16-row block its
// 4-bit low planes as U4 lays out codes (K / 8 lines), then its 2-bit high planes (K / 16 lines,
// one per 16 codes: in a lane, code 2m of those 16 at bits 2m, code 2m + 1 at bits 16 + 2m). The
// kernel forms each pair (low | high << 4) - 32, the int8 codes' int16 pair, so the int32 group
// sums and everything after them are the int8 kernel's (I8) on the same weight: the same bits, at
// 0.75 bytes per code. Groups of 16k codes.
struct I6 {
  static constexpr int64_t kCodesPerByte = 1;
  static constexpr bool kRowPaths = false, kTable = false;
  static constexpr int64_t bytes(int64_t codes) { return codes / 2 + codes / 4; }
  static inline int nibble(int i) { return i; }
  // Code k of row r (0..15) of a block whose bytes start at qb (K codes per row).
  static inline int code_in_block(const uint8_t* qb, int64_t K, int r, int64_t k) {
    uint32_t lo, hi;
    std::memcpy(&lo, qb + (k / 8) * 64 + 4 * r, 4);
    std::memcpy(&hi, qb + (K / 8) * 64 + (k / 16) * 64 + 4 * r, 4);
    const int i = int(k % 8), m = int(k % 16);
    const int l = (lo >> ((i & 1) * 16 + 4 * (i / 2))) & 15;
    const int h = (hi >> ((m & 1) * 16 + 2 * (m / 2))) & 3;
    return (l | h << 4) - 32;
  }
};
// Q5_0 / Q5_1 / Q5_K's 5-bit codes kept at the file's bits, in VNNI blocks only: per 16-row block
// the 4-bit low planes as U4 lays out codes (K / 8 lines), then a 1-bit high plane (K / 32 lines,
// one per 4 low lines: in a lane, of the 32 codes of low lines 4u .. 4u + 3, code 2p of line
// 4u + t at bit 4t + p and code 2p + 1 at bit 16 + 4t + p). Unsigned (Q5_1, Q5_K: 0..31): the
// code is low | high << 4; SIGNED (Q5_0: -16..15): the high bit is its two's complement sign,
// the code low - 16 high. Either way the kernel forms the int8 codes' int16 pair, so the int32
// group sums and everything after them are the int8 kernel's (I8) on the same weight: the same
// bits, at 0.625 bytes per code. K a multiple of 32.
template <bool SIGNED>
struct I5T {
  static constexpr int64_t kCodesPerByte = 1;
  static constexpr bool kRowPaths = false, kTable = false;
  static constexpr int64_t bytes(int64_t codes) { return codes / 2 + codes / 8; }
  static inline int nibble(int i) { return i; }
  // Code k of row r (0..15) of a block whose bytes start at qb (K codes per row).
  static inline int code_in_block(const uint8_t* qb, int64_t K, int r, int64_t k) {
    uint32_t lo, hi;
    std::memcpy(&lo, qb + (k / 8) * 64 + 4 * r, 4);
    std::memcpy(&hi, qb + (K / 8) * 64 + (k / 32) * 64 + 4 * r, 4);
    const int i = int(k % 8), t = int(k % 32) / 8;
    const int l = (lo >> ((i & 1) * 16 + 4 * (i / 2))) & 15;
    const int h = (hi >> ((i & 1) * 16 + 4 * t + i / 2)) & 1;
    return SIGNED ? l - 16 * h : l | h << 4;
  }
};
using I5 = I5T<false>;
using I5S = I5T<true>;
// How many high bits per code a format keeps in a second plane after its 4-bit low plane (I6:
// 2, I5 / I5S: 1; 0: the format is one plane).
template <class F> constexpr int kHighBits = 0;
template <> constexpr int kHighBits<I6> = 2;
template <> constexpr int kHighBits<I5> = 1;
template <> constexpr int kHighBits<I5S> = 1;

// A 4-bit lane of VNNI blocks (codes 2p at bits 4p, 2p + 1 at bits 16 + 4p) as the row layout's
// 4 bytes (code i at bits 4i): the lane's even nibbles and odd nibbles interleaved again.
static inline uint32_t u4_lane_to_row(uint32_t v) {
  uint32_t out = 0;
  for (int p = 0; p < 4; ++p) out |= ((v >> (4 * p)) & 15u) << (8 * p) | ((v >> (16 + 4 * p)) & 15u) << (8 * p + 4);
  return out;
}

static inline void store(const Problem& P, int64_t m, int64_t n, float v) {
  if (P.y_bf16)
    static_cast<uint16_t*>(P.y)[m * P.y_s0 + n] = f32_to_bf16(v);
  else
    static_cast<float*>(P.y)[m * P.y_s0 + n] = v;
}

// ------------------------------------------------------------------------------------------
// Portable scalar path: any K, any group size dividing K. Weight rows [n0, n1).
template <class F>
static void rows_scalar(const Problem& P, int64_t n0, int64_t n1) {
  constexpr int MB = 4;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = P.q + n * P.q_s0;
    const float* sr = P.scales + n * P.G;
    const float* zr = P.zeros ? P.zeros + n * P.G : nullptr;
    for (int64_t m0 = 0; m0 < P.M; m0 += MB) {
      const int mb = int(std::min<int64_t>(MB, P.M - m0));
      float acc[MB] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t gi = 0; gi < P.G; ++gi) {
        const float s = sr[gi], z = zr ? zr[gi] : 0.f;
        for (int64_t k = gi * P.g; k < (gi + 1) * P.g; ++k) {
          const float w = F::code(qr, k) * s + z;
          for (int i = 0; i < mb; ++i) acc[i] += P.x[(m0 + i) * P.x_s0 + k] * w;
        }
      }
      for (int i = 0; i < mb; ++i) store(P, m0 + i, n, acc[i]);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Vector paths. Each tile: NB weight rows n0 .. n0 + NB - 1 against MB x rows m0 .. m0 + MB - 1,
// accumulators acc[MB][NB]; per chunk of lanes, each weight vector is loaded, widened
// (code -> int32 -> float) and dequantized (q * scale + zero, one fma) once and used for MB rows.
#if QMM_X86
// QMM_ASSUME_CPU: tests only, for running these paths through SIMDe emulation on a CPU without
// them (target attributes off, CPU checks answer yes).
#ifdef QMM_ASSUME_CPU
#define QMM_AVX512
#define QMM_AVX2
static bool cpu_has_avx512() { return true; }
static bool cpu_has_avx2() { return true; }
#else
#define QMM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define QMM_AVX2 __attribute__((target("avx2,fma")))
static bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("fma");
  return ok;
}
static bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
#endif

// How far ahead (in weight rows) to prefetch: about 4.5 KB at K = 576 (the int4 rows are half as
// long, so twice as many rows). Without it the int8 kernel runs ~3x slower from DRAM; 8 rows
// (int8) stream ~5-10% faster than 16 or 32 at M = 1 on Zen 3.
template <class F> constexpr int64_t prefetch_rows();
template <> constexpr int64_t prefetch_rows<I8>() { return 8; }
template <> constexpr int64_t prefetch_rows<U4>() { return 16; }

// One step of a vector path for format F: load(row, k) widens the codes k .. k + kStep - 1 of a
// weight row (k a multiple of kStep) to int32 lanes; vec(raw, v), v < kVecs, gives vector v as
// floats, to be multiplied by the prepared x at k + v * lanes. int8: one lane per code, in
// order. int4: one lane per byte (two codes); vector 0 = the low nibbles (the step's even
// codes), vector 1 = the high nibbles (its odd codes), matching prepare_x's column order.
template <class F> struct Avx512;
template <> struct Avx512<I8> {
  static constexpr int64_t kStep = 16, kVecs = 1;
  QMM_AVX512 static QMM_INLINE __m512i load(const uint8_t* row, int64_t k) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
  }
  QMM_AVX512 static QMM_INLINE __m512 vec(__m512i raw, int) { return _mm512_cvtepi32_ps(raw); }
};
template <> struct Avx512<U4> {
  static constexpr int64_t kStep = 32, kVecs = 2;
  QMM_AVX512 static QMM_INLINE __m512i load(const uint8_t* row, int64_t k) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
  }
  QMM_AVX512 static QMM_INLINE __m512 vec(__m512i raw, int v) {
    return _mm512_cvtepi32_ps(v == 0 ? _mm512_and_si512(raw, _mm512_set1_epi32(15)) : _mm512_srli_epi32(raw, 4));
  }
};
template <class F> struct Avx2;
template <> struct Avx2<I8> {
  static constexpr int64_t kStep = 8, kVecs = 1;
  QMM_AVX2 static QMM_INLINE __m256i load(const uint8_t* row, int64_t k) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)));
  }
  template <bool = false>
  QMM_AVX2 static QMM_INLINE __m256 vec(__m256i raw, int) { return _mm256_cvtepi32_ps(raw); }
};
template <> struct Avx2<U4> {
  static constexpr int64_t kStep = 16, kVecs = 2;
  QMM_AVX2 static QMM_INLINE __m256i load(const uint8_t* row, int64_t k) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2)));
  }
  // SHIFTS: the low nibbles by two shifts instead of an and with a mask register (the same
  // values; faster where the tile needs every ymm register for accumulators, M > 1, slower at
  // M = 1).
  template <bool SHIFTS = false>
  QMM_AVX2 static QMM_INLINE __m256 vec(__m256i raw, int v) {
    if (v != 0) return _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4));
    return _mm256_cvtepi32_ps(SHIFTS ? _mm256_srli_epi32(_mm256_slli_epi32(raw, 28), 28)
                                     : _mm256_and_si256(raw, _mm256_set1_epi32(15)));
  }
};

// AVX-512, g % kStep == 0: 16 lanes, tiles of up to 4 x rows by 4 weight rows (16 accumulators).
template <class F, int MB, int NB, bool ZEROS>
QMM_AVX512 static QMM_INLINE void tile_avx512(const Problem& P, int64_t m0, int64_t n0) {
  using V = Avx512<F>;
  __m512 acc[MB][NB];
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    QMM_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  const uint8_t* qr = P.q + n0 * P.q_s0;
  const float* sr = P.scales + n0 * P.G;
  const float* zr = ZEROS ? P.zeros + n0 * P.G : nullptr;
  const float* xr = P.x + m0 * P.x_s0;
  const int64_t steps = P.g / V::kStep;
  // The weight rows PF rows ahead, NB groups' bytes per group (all of them over the pass): the
  // tiles are contiguous, so this streams the weight into L2 ahead of use.
  const int64_t gb = F::bytes(P.g);
  const char* pf = reinterpret_cast<const char*>(qr) + prefetch_rows<F>() * P.q_s0;
  for (int64_t gi = 0; gi < P.G; ++gi) {
    for (int64_t b = 0; b < NB * gb; b += 64) _mm_prefetch(pf + gi * NB * gb + b, _MM_HINT_T1);
    __m512 s[NB], z[NB];
    QMM_UNROLL for (int j = 0; j < NB; ++j) {
      s[j] = _mm512_set1_ps(sr[j * P.G + gi]);
      z[j] = ZEROS ? _mm512_set1_ps(zr[j * P.G + gi]) : _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < steps; ++c) {
      const int64_t k = gi * P.g + c * V::kStep;
      __m512i raw[NB];
      QMM_UNROLL for (int j = 0; j < NB; ++j) raw[j] = V::load(qr + j * P.q_s0, k);
      QMM_UNROLL for (int v = 0; v < V::kVecs; ++v) {
        __m512 w[NB];
        QMM_UNROLL for (int j = 0; j < NB; ++j) {
          const __m512 qf = V::vec(raw[j], v);
          w[j] = ZEROS ? _mm512_fmadd_ps(qf, s[j], z[j]) : _mm512_mul_ps(qf, s[j]);
        }
        QMM_UNROLL for (int i = 0; i < MB; ++i) {
          const __m512 xv = _mm512_loadu_ps(xr + i * P.x_s0 + k + 16 * v);
          QMM_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
        }
      }
    }
  }
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    QMM_UNROLL for (int j = 0; j < NB; ++j) store(P, m0 + i, n0 + j, _mm512_reduce_add_ps(acc[i][j]));
  }
}

template <class F, int NB, bool ZEROS>
QMM_AVX512 static void ntile_avx512(const Problem& P, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= P.M; m0 += 4) tile_avx512<F, 4, NB, ZEROS>(P, m0, n0);
  switch (P.M - m0) {
    case 3: tile_avx512<F, 3, NB, ZEROS>(P, m0, n0); break;
    case 2: tile_avx512<F, 2, NB, ZEROS>(P, m0, n0); break;
    case 1: tile_avx512<F, 1, NB, ZEROS>(P, m0, n0); break;
    default: break;
  }
}

// Many x rows (M >= kPanelMinRows): each tile above would widen and scale every weight vector
// again for each 4 x rows, which makes the kernel compute-bound at ~half the float32 FMA rate.
// Instead NB weight rows are dequantized once into a panel (the same ops, so the same float32
// values, in the order the tile reads them: for int4 each step's low-nibble vector, then its
// high-nibble one, matching prepare_x), and then every x tile multiplies the panel. Each
// accumulator sees the same fmadds in the same order as in tile_avx512, and the same final
// reduction, so the result is bit for bit the same as the path above: which path runs depends on
// M, but a row's numbers do not.
constexpr int64_t kPanelMinRows = 12;

template <class F, int NB, bool ZEROS>
QMM_AVX512 static QMM_INLINE void fill_panel_avx512(const Problem& P, int64_t n0, float* panel) {
  using V = Avx512<F>;
  const int64_t steps = P.g / V::kStep;
  QMM_UNROLL for (int j = 0; j < NB; ++j) {
    const uint8_t* qr = P.q + (n0 + j) * P.q_s0;
    float* out = panel + j * P.K;
    for (int64_t gi = 0; gi < P.G; ++gi) {
      const __m512 s = _mm512_set1_ps(P.scales[(n0 + j) * P.G + gi]);
      const __m512 z = ZEROS ? _mm512_set1_ps(P.zeros[(n0 + j) * P.G + gi]) : _mm512_setzero_ps();
      for (int64_t c = 0; c < steps; ++c) {
        const int64_t k = gi * P.g + c * V::kStep;
        const __m512i raw = V::load(qr, k);
        QMM_UNROLL for (int v = 0; v < V::kVecs; ++v) {
          const __m512 qf = V::vec(raw, v);
          _mm512_storeu_ps(out + k + 16 * v, ZEROS ? _mm512_fmadd_ps(qf, s, z) : _mm512_mul_ps(qf, s));
        }
      }
    }
  }
}

template <int MB, int NB>
QMM_AVX512 static QMM_INLINE void panel_tile_avx512(const Problem& P, const float* panel, int64_t m0, int64_t n0) {
  __m512 acc[MB][NB];
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    QMM_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  const float* xr = P.x + m0 * P.x_s0;
  for (int64_t k = 0; k < P.K; k += 16) {
    __m512 w[NB];
    QMM_UNROLL for (int j = 0; j < NB; ++j) w[j] = _mm512_loadu_ps(panel + j * P.K + k);
    QMM_UNROLL for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(xr + i * P.x_s0 + k);
      QMM_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
    }
  }
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    QMM_UNROLL for (int j = 0; j < NB; ++j) store(P, m0 + i, n0 + j, _mm512_reduce_add_ps(acc[i][j]));
  }
}

template <int NB>
QMM_AVX512 static void panel_rows_avx512(const Problem& P, const float* panel, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + QMM_PANEL_MB <= P.M; m0 += QMM_PANEL_MB) panel_tile_avx512<QMM_PANEL_MB, NB>(P, panel, m0, n0);
  for (; m0 < P.M; ++m0) panel_tile_avx512<1, NB>(P, panel, m0, n0);
}

template <class F, bool ZEROS>
QMM_AVX512 static void rows_avx512_t(const Problem& P, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (P.M >= kPanelMinRows && P.K % 16 == 0) {
    std::vector<float> panel(size_t(QMM_PANEL_NB * P.K));
    for (; n + QMM_PANEL_NB <= n1; n += QMM_PANEL_NB) {
      fill_panel_avx512<F, QMM_PANEL_NB, ZEROS>(P, n, panel.data());
      panel_rows_avx512<QMM_PANEL_NB>(P, panel.data(), n);
    }
    for (; n < n1; ++n) {
      fill_panel_avx512<F, 1, ZEROS>(P, n, panel.data());
      panel_rows_avx512<1>(P, panel.data(), n);
    }
    return;
  }
  for (; n + 4 <= n1; n += 4) ntile_avx512<F, 4, ZEROS>(P, n);
  for (; n < n1; ++n) ntile_avx512<F, 1, ZEROS>(P, n);
}

template <class F>
static void rows_avx512(const Problem& P, int64_t n0, int64_t n1) {
  if (P.zeros)
    rows_avx512_t<F, true>(P, n0, n1);
  else
    rows_avx512_t<F, false>(P, n0, n1);
}

// AVX2 + FMA, g % kStep == 0: 8 lanes (tiles as described at the top of this file).
QMM_AVX2 static QMM_INLINE float hsum256(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// CH: steps per group when known at compile time (g = CH * kStep: the common g = 32 gets a
// fully unrolled group, ~5% faster), else 0 (g / kStep at run time). The order of the additions
// into each accumulator is the same for every MB, NB and CH.
template <class F, int MB, int NB, bool ZEROS, int CH>
QMM_AVX2 static QMM_INLINE void tile_avx2(const Problem& P, int64_t m0, int64_t n0) {
  using V = Avx2<F>;
  __m256 acc[MB][NB];
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    QMM_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  const uint8_t* qr = P.q + n0 * P.q_s0;
  const float* sr = P.scales + n0 * P.G;
  const float* zr = ZEROS ? P.zeros + n0 * P.G : nullptr;
  const float* xr = P.x + m0 * P.x_s0;
  const int64_t g = CH ? CH * V::kStep : P.g;
  const int64_t gb = F::bytes(g);  // as in tile_avx512
  const char* pf = reinterpret_cast<const char*>(qr) + prefetch_rows<F>() * P.q_s0;
  for (int64_t gi = 0; gi < P.G; ++gi) {
    for (int64_t b = 0; b < NB * gb; b += 64) _mm_prefetch(pf + gi * NB * gb + b, _MM_HINT_T1);
    __m256 s[NB], z[NB];
    QMM_UNROLL for (int j = 0; j < NB; ++j) {
      s[j] = _mm256_set1_ps(sr[j * P.G + gi]);
      z[j] = ZEROS ? _mm256_set1_ps(zr[j * P.G + gi]) : _mm256_setzero_ps();
    }
    auto step = [&](int64_t k) QMM_AVX2 QMM_INLINE_LAMBDA {
      __m256i raw[NB];
      QMM_UNROLL for (int j = 0; j < NB; ++j) raw[j] = V::load(qr + j * P.q_s0, k);
      QMM_UNROLL for (int v = 0; v < V::kVecs; ++v) {
        __m256 w[NB];
        QMM_UNROLL for (int j = 0; j < NB; ++j) {
          const __m256 qf = V::template vec<(MB > 1)>(raw[j], v);
          w[j] = ZEROS ? _mm256_fmadd_ps(qf, s[j], z[j]) : _mm256_mul_ps(qf, s[j]);
        }
        QMM_UNROLL for (int i = 0; i < MB; ++i) {
          const __m256 xv = _mm256_loadu_ps(xr + i * P.x_s0 + k + 8 * v);
          QMM_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
        }
      }
    };
    if constexpr (CH > 0) {
      QMM_UNROLL for (int c = 0; c < CH; ++c) step(gi * g + c * V::kStep);
    } else {
      for (int64_t c = 0; c < g / V::kStep; ++c) step(gi * g + c * V::kStep);
    }
  }
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    QMM_UNROLL for (int j = 0; j < NB; ++j) store(P, m0 + i, n0 + j, hsum256(acc[i][j]));
  }
}

// M = 1: one x row against NB weight rows, row by row within each group (each row's scale and
// zero and codes are live only while that row is worked on; the x vectors come from L1). Per
// output the same additions in the same order as tile_avx2, so the same result.
template <class F, int NB, bool ZEROS, int CH>
QMM_AVX2 static QMM_INLINE void tile1_avx2(const Problem& P, int64_t n0) {
  using V = Avx2<F>;
  __m256 acc[NB];
  QMM_UNROLL for (int j = 0; j < NB; ++j) acc[j] = _mm256_setzero_ps();
  const uint8_t* qr = P.q + n0 * P.q_s0;
  const float* sr = P.scales + n0 * P.G;
  const float* zr = ZEROS ? P.zeros + n0 * P.G : nullptr;
  const int64_t g = CH ? CH * V::kStep : P.g;
  const int64_t gb = F::bytes(g);
  const char* pf = reinterpret_cast<const char*>(qr) + prefetch_rows<F>() * P.q_s0;
  for (int64_t gi = 0; gi < P.G; ++gi) {
    for (int64_t b = 0; b < NB * gb; b += 64) _mm_prefetch(pf + gi * NB * gb + b, _MM_HINT_T1);
    QMM_UNROLL for (int j = 0; j < NB; ++j) {
      const __m256 s = _mm256_set1_ps(sr[j * P.G + gi]);
      const __m256 z = ZEROS ? _mm256_set1_ps(zr[j * P.G + gi]) : _mm256_setzero_ps();
      auto step = [&](int64_t k) QMM_AVX2 QMM_INLINE_LAMBDA {
        const __m256i raw = V::load(qr + j * P.q_s0, k);
        QMM_UNROLL for (int v = 0; v < V::kVecs; ++v) {
          const __m256 qf = V::vec(raw, v);
          const __m256 w = ZEROS ? _mm256_fmadd_ps(qf, s, z) : _mm256_mul_ps(qf, s);
          acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(P.x + k + 8 * v), w, acc[j]);
        }
      };
      if constexpr (CH > 0) {
        QMM_UNROLL for (int c = 0; c < CH; ++c) step(gi * g + c * V::kStep);
      } else {
        for (int64_t c = 0; c < g / V::kStep; ++c) step(gi * g + c * V::kStep);
      }
    }
  }
  QMM_UNROLL for (int j = 0; j < NB; ++j) store(P, 0, n0 + j, hsum256(acc[j]));
}

// x rows m0 .. m0 + r - 1 (r <= MB) against weight rows n0 .. n0 + NB - 1.
template <class F, int MB, int NB, bool ZEROS, int CH>
QMM_AVX2 static QMM_INLINE void mtail_avx2(const Problem& P, int64_t m0, int64_t r, int64_t n0) {
  if constexpr (MB > 1) {
    if (r < MB) return mtail_avx2<F, MB - 1, NB, ZEROS, CH>(P, m0, r, n0);
  }
  tile_avx2<F, MB, NB, ZEROS, CH>(P, m0, n0);
}

template <class F, int NB, bool ZEROS, int CH>
QMM_AVX2 static void ntile_avx2(const Problem& P, int64_t n0) {
  constexpr int MB = 4;
  int64_t m0 = 0;
  for (; m0 + MB <= P.M; m0 += MB) tile_avx2<F, MB, NB, ZEROS, CH>(P, m0, n0);
  if (m0 < P.M) mtail_avx2<F, MB, NB, ZEROS, CH>(P, m0, P.M - m0, n0);
}

template <class F, bool ZEROS, int CH>
QMM_AVX2 static void rows_avx2_t(const Problem& P, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (P.M == 1) {
    // int4 runs ~20% faster row by row (tile1_avx2), int8 ~10% faster all 4 rows at once.
    if constexpr (F::kCodesPerByte == 2) {
      for (; n + 4 <= n1; n += 4) tile1_avx2<F, 4, ZEROS, CH>(P, n);
      for (; n < n1; ++n) tile1_avx2<F, 1, ZEROS, CH>(P, n);
    } else {
      for (; n + 4 <= n1; n += 4) tile_avx2<F, 1, 4, ZEROS, CH>(P, 0, n);
      for (; n < n1; ++n) tile_avx2<F, 1, 1, ZEROS, CH>(P, 0, n);
    }
    return;
  }
  for (; n + 2 <= n1; n += 2) ntile_avx2<F, 2, ZEROS, CH>(P, n);
  for (; n < n1; ++n) ntile_avx2<F, 1, ZEROS, CH>(P, n);
}

template <class F, bool ZEROS>
static void rows_avx2_z(const Problem& P, int64_t n0, int64_t n1) {
  constexpr int64_t step = Avx2<F>::kStep;
  if (P.g == 32)  // every GGUF format but Q6_K (16, which takes the loop)
    rows_avx2_t<F, ZEROS, 32 / step>(P, n0, n1);
  else
    rows_avx2_t<F, ZEROS, 0>(P, n0, n1);
}

template <class F>
static void rows_avx2(const Problem& P, int64_t n0, int64_t n1) {
  if (P.zeros)
    rows_avx2_z<F, true>(P, n0, n1);
  else
    rows_avx2_z<F, false>(P, n0, n1);
}

// ------------------------------------------------------------------------------------------
// AVX-512 VNNI path ("avx512-vnni"), for both formats, any M, on weights kept in VNNI blocks
// (below): x is rounded once per call to int16 per row and group (X = round(x * 32767 / max|x|)
// over the group, step d = max|x| / 32767: 15 bits below the group's largest value, where
// bfloat16 keeps 8 below each value's own leading bit), and each group's sum_k X_k * q_k runs in
// int32 with vpdpwssd (two int16 products per lane, 32 per instruction against the float32 FMA's
// 16), exactly. Only the per-group epilogue is float32:
//   acc = fma(float(I_g), scale_g * d_g, acc);  acc = fma(zero_g, d_g * float(sum_k X_k), acc)
// in group order: the same ops for every tiling, M, N and thread count, so a row's result does
// not depend on its batch. Lanes run over 16 output rows (so scales are a vector, d a broadcast).
//
// VNNI blocks: rows in blocks of 16 (the last one zero padded), each block's bytes as 64-byte
// lines of 4 bytes from each of its 16 rows (line c, lane r = bytes 4c .. 4c + 3 of row r): q
// [N16 / 16][Kb / 4][16][4] for Kb bytes per row (K / 2 for int4, K for int8); scales and zeros
// likewise [N16 / 16][G][16]. One aligned load then gives a code pair of 16 rows per vpdpwssd
// operand after one byte shuffle (+ a shift and a mask, for nibbles): no per-call transposition.
// Needs g % 8 == 0 (whole lines per group) and g <= 256 (int32 group sums cannot overflow:
// 256 * 128 * 32767 < 2^31). SIMDe builds (QMM_ASSUME_CPU) leave the path out.
// (GCC >= 9 / clang >= 7 for the avx512vnni target and an assembler that knows vpdpwssd.)
#if !defined(QMM_ASSUME_CPU) && ((defined(__clang__) && __clang_major__ >= 7) || (!defined(__clang__) && __GNUC__ >= 9))
#define QMM_HAS_VNNI 1
#define QMM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
static bool cpu_has_vnni() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return ok;
}

// How far ahead of the line it reads (bytes) vnni_tile asks for the weight stream to be loaded
// into L1. Decode reads every weight once, so the kernel's speed is how fast one core pulls its
// stream from memory: one prefetch per 64-byte line at a fixed distance kept a core at ~35 GB/s
// where one burst of prefetches per 16-row block into L2 reached 15-18 (2048x8192 int4, one
// thread; 4 KB ahead: ~33, 16 KB: ~35).
constexpr int64_t kVnniPrefetchBytes = 8192;

// Code pair p of a line (4 bytes of each of 16 rows) as int16 pairs (code 2j | code 2j + 1 << 16)
// per lane. int4: a lane's 8 codes are stored with pair p's two codes at bits 4p and 16 + 4p
// (the even codes in its low half, the odd ones in its high half: `to_vnni_blocks` arranges
// them), so a pair is one shift and one mask (2 ops per vpdpwssd, not 3: decode at batch 1 is as
// much instruction- as bandwidth-bound). int8: bytes 2p and 2p + 1 put in the high bytes of the
// two words, then an arithmetic shift sign-extends them.
template <class F> struct VnniCodes;
template <> struct VnniCodes<U4> {
  static constexpr int kPairsPerLine = 4;
  static void control(int p, int8_t* ctl) {  // every lane: the shift count 4p
    for (int i = 0; i < 64; i += 4) {
      ctl[i] = int8_t(4 * p); ctl[i + 1] = 0; ctl[i + 2] = 0; ctl[i + 3] = 0;
    }
  }
  QMM_VNNI static QMM_INLINE __m512i pair(__m512i line, __m512i ctl) {
    return _mm512_and_si512(_mm512_srlv_epi32(line, ctl), _mm512_set1_epi32(0x000F000F));
  }
};

// I6: the low plane's pair as U4's; the high plane's line of the 16 codes this line's 8 are in,
// shifted (high_line) so that pair p's two 2-bit fields sit at bits 2p and 16 + 2p, then rotated
// to bits 4..5 and 20..21 (a rotation, not a shift: for p < 2 they move up). Then low | high
// minus 32 in each int16 word.
template <> struct VnniCodes<I6> {
  static constexpr int kPairsPerLine = 4;
  static void control(int p, int8_t* ctl) { VnniCodes<U4>::control(p, ctl); }
  QMM_VNNI static QMM_INLINE __m512i high_line(const uint8_t* qb, int64_t K, int64_t c) {
    const __m512i h = _mm512_loadu_si512(qb + (K / 8) * 64 + (c / 2) * 64);
    return (c & 1) ? _mm512_srli_epi32(h, 8) : h;
  }
  QMM_VNNI static QMM_INLINE __m512i pair(__m512i line, __m512i ctl, __m512i high, int p) {
    const __m512i lo = _mm512_and_si512(_mm512_srlv_epi32(line, ctl), _mm512_set1_epi32(0x000F000F));
    const __m512i hi = _mm512_and_si512(_mm512_rorv_epi32(high, _mm512_set1_epi32((2 * p + 28) & 31)),
                                        _mm512_set1_epi32(0x00300030));
    return _mm512_sub_epi16(_mm512_or_si512(lo, hi), _mm512_set1_epi16(32));
  }
};

// I5 / I5S: the low plane's pair as U4's; the high plane's line of the 32 codes this line's 8 are
// in, shifted right by 4t for the line's place t in its 4 (high_line), so that pair p's two bits
// sit at bits p and 16 + p, then rotated to bits 4 and 20 (a rotation, as for I6). Then low | high
// (unsigned codes) or low - high (Q5_0's signed ones: the bit is the sign, worth -16) in each
// int16 word.
template <bool SIGNED> struct VnniCodes<I5T<SIGNED>> {
  static constexpr int kPairsPerLine = 4;
  static void control(int p, int8_t* ctl) { VnniCodes<U4>::control(p, ctl); }
  QMM_VNNI static QMM_INLINE __m512i high_line(const uint8_t* qb, int64_t K, int64_t c) {
    const __m512i h = _mm512_loadu_si512(qb + (K / 8) * 64 + (c / 4) * 64);
    return _mm512_srl_epi32(h, _mm_cvtsi32_si128(int(4 * (c & 3))));
  }
  QMM_VNNI static QMM_INLINE __m512i pair(__m512i line, __m512i ctl, __m512i high, int p) {
    const __m512i lo = _mm512_and_si512(_mm512_srlv_epi32(line, ctl), _mm512_set1_epi32(0x000F000F));
    const __m512i hi = _mm512_and_si512(_mm512_rorv_epi32(high, _mm512_set1_epi32((p + 28) & 31)),
                                        _mm512_set1_epi32(0x00100010));
    return SIGNED ? _mm512_sub_epi16(lo, hi) : _mm512_or_si512(lo, hi);
  }
};

// A format's code pair p of line c of a block (qb): every format but the two-plane ones (I6, I5,
// I5S) reads the line alone.
template <class F>
QMM_VNNI static QMM_INLINE __m512i high_line_of(const uint8_t* qb, int64_t K, int64_t c) {
  if constexpr (kHighBits<F> != 0) return VnniCodes<F>::high_line(qb, K, c);
  return _mm512_setzero_si512();
}
template <class F>
QMM_VNNI static QMM_INLINE __m512i pair_of(__m512i line, const __m512i* ctl, __m512i high, int p) {
  if constexpr (kHighBits<F> != 0) return VnniCodes<F>::pair(line, ctl[p], high, p);
  else return VnniCodes<F>::pair(line, ctl[p]);
}

// NL4: U4's pair (the two indices at bits 0..3 of each int16 word after the shift), then each
// word looked up in the table (vpermw: 32 int16 entries indexed by a word's low 5 bits; the
// table is repeated, so the fifth bit, the next index's lowest, needs no mask): the sign-extended
// int8 value I8's pair gives for the same weight.
template <> struct VnniCodes<NL4> {
  static constexpr int kPairsPerLine = 4;
  static void control(int p, int8_t* ctl) { VnniCodes<U4>::control(p, ctl); }
  QMM_VNNI static QMM_INLINE __m512i table() {
    return _mm512_set_epi16(113, 89, 69, 53, 38, 25, 13, 1, -10, -22, -35, -49, -65, -83, -104, -127,
                            113, 89, 69, 53, 38, 25, 13, 1, -10, -22, -35, -49, -65, -83, -104, -127);
  }
  QMM_VNNI static QMM_INLINE __m512i pair(__m512i line, __m512i ctl) {
    return _mm512_permutexvar_epi16(_mm512_srlv_epi32(line, ctl), table());
  }
};

template <> struct VnniCodes<I8> {
  static constexpr int kPairsPerLine = 2;
  static void control(int p, int8_t* ctl) {
    for (int i = 0; i < 64; i += 4) {
      const int8_t b = int8_t((i & 15) + 2 * p);
      ctl[i] = -128; ctl[i + 1] = b; ctl[i + 2] = -128; ctl[i + 3] = int8_t(b + 1);
    }
  }
  QMM_VNNI static QMM_INLINE __m512i pair(__m512i line, __m512i ctl) {
    return _mm512_srai_epi16(_mm512_shuffle_epi8(line, ctl), 8);
  }
};

// acc += pairwise int16 products of a and b (vpdpwssd). In asm: GCC's intrinsic made it copy
// every accumulator between registers once per instruction.
QMM_VNNI static QMM_INLINE __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// The 16 scales (or zeros) of group gi of a block in compact layout (`block` its bytes).
QMM_VNNI static QMM_INLINE __m512 compact_vec(const uint8_t* block, int64_t G, int64_t sub, int64_t gi) {
  const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + gi * 16))));
  const __m256i base = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 * G + (gi / sub) * 32));
  return _mm512_mul_ps(code, _mm512_cvtph_ps(base));
}

// The 16 scales of group gi of block blk in scale layout SL (kLayoutBlocks / Compact / Half).
template <int SL>
QMM_VNNI static QMM_INLINE __m512 scale_vec(const Problem& P, const void* arr, int64_t blk, int64_t gi) {
  if (SL == kLayoutBlocks) return _mm512_loadu_ps(static_cast<const float*>(arr) + (blk * P.G + gi) * 16);
  const uint8_t* b = static_cast<const uint8_t*>(arr) + blk * P.cs_bytes;
  if (SL == kLayoutCompact) return compact_vec(b, P.G, P.sub, gi);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + gi * 32)));
}

// The zeros to go with scales s: the zeros array's, or s * zero_mul (float16 scales, Q4_0).
template <int SL>
QMM_VNNI static QMM_INLINE __m512 zero_vec(const Problem& P, int64_t blk, int64_t gi, __m512 s) {
  if (SL == kLayoutHalf && P.zeros == nullptr) return _mm512_mul_ps(s, _mm512_set1_ps(P.zero_mul));
  return scale_vec<SL>(P, P.zeros, blk, gi);
}

// Blocks blk .. blk + nb - 1's scales in the full layout, [nb][G][16] into out, and (ZEROS) their
// zeros likewise after them.
template <int SL, bool ZEROS>
QMM_VNNI static void expand_scales(const Problem& P, int64_t blk, int nb, float* out) {
  for (int b = 0; b < nb; ++b)
    for (int64_t gi = 0; gi < P.G; ++gi) {
      const __m512 s = scale_vec<SL>(P, P.scales, blk + b, gi);
      _mm512_store_ps(out + (b * P.G + gi) * 16, s);
      if (ZEROS) _mm512_store_ps(out + ((nb + b) * P.G + gi) * 16, zero_vec<SL>(P, blk + b, gi, s));
    }
}

template <class F, int MB, bool ZEROS, int SL>
QMM_VNNI static QMM_INLINE void vnni_tile(const Problem& P, int64_t blk, const __m512i* ctl, int64_t m0) {
  // Compact and float16 scales are formed group by group here (once per tile: expanding a
  // block's once into a buffer first measured no faster at M = 12).
  using C = VnniCodes<F>;
  __m512 acc[MB];
  QMM_UNROLL for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t lines_per_group = P.g / (2 * C::kPairsPerLine);
  const uint8_t* qb = P.q + blk * 16 * P.q_s0;
  const uint8_t* cs = reinterpret_cast<const uint8_t*>(P.scales) + blk * P.cs_bytes;
  const uint8_t* cz = P.zeros ? reinterpret_cast<const uint8_t*>(P.zeros) + blk * P.cs_bytes : nullptr;
  const int16_t* xr = P.xq + m0 * P.K;
  // Two-plane formats (kHighBits: a block's low plane's K / 8 lines, then its high plane's) read
  // two streams: the prefetch follows them in the order they are read, kVnniPrefetchBytes / 64
  // low lines ahead, in this block or the ones after it (pf_block, pf_line), and with every
  // kLowPerHigh-th low line its high line. (Ahead in the bytes as laid out, as for one plane, the
  // low stream's prefetch ran into the block's own high plane, and the high stream's into the
  // next block's low plane, leaving the start of every block's high plane to demand misses:
  // measured 0.62-0.76x the int8 kernel's speed at K = 2048, M = 1.)
  constexpr int64_t kLowPerHigh = kHighBits<F> != 0 ? 4 / kHighBits<F> : 1;  // low lines per high line
  const int64_t low_lines = P.K / 8, block_bytes = 16 * P.q_s0;
  const uint8_t* pf_block = qb;
  int64_t pf_line = kVnniPrefetchBytes / 64;
  if (kHighBits<F> != 0) {
    pf_block += (pf_line / low_lines) * block_bytes;
    pf_line %= low_lines;
  }
  for (int64_t gi = 0; gi < P.G; ++gi) {
    __m512i ia[MB];
    QMM_UNROLL for (int i = 0; i < MB; ++i) ia[i] = _mm512_setzero_si512();
    for (int64_t c = gi * lines_per_group; c < (gi + 1) * lines_per_group; ++c) {
      __m512i high = _mm512_setzero_si512();
      if constexpr (kHighBits<F> != 0) {
        _mm_prefetch(reinterpret_cast<const char*>(pf_block + pf_line * 64), _MM_HINT_T0);
        if (pf_line % kLowPerHigh == 0)
          _mm_prefetch(reinterpret_cast<const char*>(pf_block + (low_lines + pf_line / kLowPerHigh) * 64),
                       _MM_HINT_T0);
        if (++pf_line == low_lines) {
          pf_line = 0;
          pf_block += block_bytes;
        }
        high = high_line_of<F>(qb, P.K, c);
      } else {
        // A line kVnniPrefetchBytes ahead in the weight stream (the blocks are contiguous, so
        // this runs on into the next block and the next thread-chunk's rows) into L1.
        _mm_prefetch(reinterpret_cast<const char*>(qb + c * 64 + kVnniPrefetchBytes), _MM_HINT_T0);
      }
      const __m512i line = _mm512_loadu_si512(qb + c * 64);
      QMM_UNROLL for (int p = 0; p < C::kPairsPerLine; ++p) {
        const int64_t j = c * C::kPairsPerLine + p;
        const __m512i w = pair_of<F>(line, ctl, high, p);
        QMM_UNROLL for (int i = 0; i < MB; ++i) {
          int32_t xpair;  // X[2j] | X[2j + 1] << 16, read through memcpy (int16 storage)
          std::memcpy(&xpair, xr + i * P.K + 2 * j, sizeof xpair);
          ia[i] = dpwssd(ia[i], w, _mm512_set1_epi32(xpair));
        }
      }
    }
    if (SL != kLayoutBlocks) {
      // The next block's compact or float16 scales (and zeros) into L1 as this block's codes
      // stream by, in step with them (cs_bytes / G bytes a group: 16 + 32 / sub, or 32): the
      // code stream's own line-ahead prefetch does not reach other arrays. (Past the last
      // block: a prefetch never faults.)
      const int64_t at = P.cs_bytes + gi * (P.cs_bytes / P.G);
      _mm_prefetch(reinterpret_cast<const char*>(cs + at), _MM_HINT_T0);
      if (cz) _mm_prefetch(reinterpret_cast<const char*>(cz + at), _MM_HINT_T0);
    }
    const __m512 s = scale_vec<SL>(P, P.scales, blk, gi);
    __m512 z = _mm512_setzero_ps();
    if (ZEROS) z = zero_vec<SL>(P, blk, gi, s);
    QMM_UNROLL for (int i = 0; i < MB; ++i) {
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(P.xd[(m0 + i) * P.G + gi]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[i]), sd, acc[i]);
      if (ZEROS) acc[i] = _mm512_fmadd_ps(z, _mm512_set1_ps(P.xz[(m0 + i) * P.G + gi]), acc[i]);
    }
  }
  const int64_t n0 = blk * 16;
  const int nb = int(std::min<int64_t>(16, P.N - n0));
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    if (nb == 16 && !P.y_bf16) {
      _mm512_storeu_ps(static_cast<float*>(P.y) + (m0 + i) * P.y_s0 + n0, acc[i]);
    } else {
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, acc[i]);
      for (int l = 0; l < nb; ++l) store(P, m0 + i, n0 + l, tmp[l]);
    }
  }
}

template <class F, bool ZEROS, int SL>
QMM_VNNI static void vnni_rows_of_block(const Problem& P, int64_t blk, const __m512i* ctl) {
  // Tiles of at most 8 rows, as even as they come (M = 9: 5 + 4, not 8 + 1: each code pair
  // unpacked for a tile feeds that many rows, so a 1-row tile costs nearly what an 8-row one does).
  const int64_t tiles = (P.M + 7) / 8;
  int64_t m0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = (P.M - m0) / (tiles - t) + ((P.M - m0) % (tiles - t) != 0);
    switch (rows) {
      case 8: vnni_tile<F, 8, ZEROS, SL>(P, blk, ctl, m0); break;
      case 7: vnni_tile<F, 7, ZEROS, SL>(P, blk, ctl, m0); break;
      case 6: vnni_tile<F, 6, ZEROS, SL>(P, blk, ctl, m0); break;
      case 5: vnni_tile<F, 5, ZEROS, SL>(P, blk, ctl, m0); break;
      case 4: vnni_tile<F, 4, ZEROS, SL>(P, blk, ctl, m0); break;
      case 3: vnni_tile<F, 3, ZEROS, SL>(P, blk, ctl, m0); break;
      case 2: vnni_tile<F, 2, ZEROS, SL>(P, blk, ctl, m0); break;
      case 1: vnni_tile<F, 1, ZEROS, SL>(P, blk, ctl, m0); break;
      default: break;
    }
    m0 += rows;
  }
}

// Output rows [n0, n1) (n0 a multiple of 16): block by block, each block's lines unpacked per
// tile of x rows (vnni_tile prefetches its own stream, line by line). Up to kVnniTileMaxRows rows
// the block (16 rows of codes: 16 KB at K = 2048 for 4-bit codes) stays in L1 between its tiles,
// so unpacking again per tile costs less than an unpacked panel did: the panel (64 KB of int16
// pairs at K = 2048, past L1) made M = 9 take twice M = 8's time, and M = 16 1.4x two 8-row tiles
// (all of the 1B shape's linears, Q4_K_M: M = 16 69.8 -> 48.5 ms).
template <class F, bool ZEROS, int SL>
QMM_VNNI static void rows_vnni_t(const Problem& P, int64_t n0, int64_t n1) {
  using C = VnniCodes<F>;
  __m512i ctl[C::kPairsPerLine];
  for (int p = 0; p < C::kPairsPerLine; ++p) {
    alignas(64) int8_t c[64];
    C::control(p, c);
    ctl[p] = _mm512_load_si512(c);
  }
  for (int64_t blk = n0 / 16; blk * 16 < n1; ++blk) vnni_rows_of_block<F, ZEROS, SL>(P, blk, ctl);
}

// quantize_x (below) for float32 x and g % 16 == 0, 16 lanes at a time: the same values (the
// same float32 product x * (32767 / max|x|), rounded half to even by vcvtps2dq as by lrintf).
QMM_VNNI static void quantize_x_avx512(const float* x, int64_t s0, int64_t M, int64_t K, int64_t g, int16_t* xq,
                                       float* xd, float* xz) {
  const int64_t G = K / g;
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t gi = 0; gi < G; ++gi) {
      const float* v = x + m * s0 + gi * g;
      int16_t* X = xq + m * K + gi * g;
      __m512 amax = _mm512_setzero_ps();
      __mmask16 bad = 0;
      for (int64_t k = 0; k < g; k += 16) {
        const __m512 a = _mm512_loadu_ps(v + k);
        bad |= _mm512_fpclass_ps_mask(a, 0x99);  // NaN or infinity
        amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, a));
      }
      const float mx = _mm512_reduce_max_ps(amax), inv_s = 32767.f / mx;
      if (bad || !std::isfinite(inv_s)) {  // as in quantize_x
        for (int64_t k = 0; k < g; ++k) X[k] = 0;
        xd[m * G + gi] = bad ? std::nanf("") : 0.f;
        xz[m * G + gi] = xd[m * G + gi];
        continue;
      }
      const __m512 inv = _mm512_set1_ps(inv_s);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t k = 0; k < g; k += 16) {
        const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + k), inv));
        sum = _mm512_add_epi32(sum, r);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(X + k), _mm512_cvtsepi32_epi16(r));
      }
      xd[m * G + gi] = mx / 32767.f;
      xz[m * G + gi] = xd[m * G + gi] * float(_mm512_reduce_add_epi32(sum));
    }
  }
}

template <class F>
static void rows_vnni(const Problem& P, int64_t n0, int64_t n1) {
  const bool z = P.zeros || P.zero_mul != 0.f;
  switch (P.layout) {
    case kLayoutCompact: return z ? rows_vnni_t<F, true, kLayoutCompact>(P, n0, n1) : rows_vnni_t<F, false, kLayoutCompact>(P, n0, n1);
    case kLayoutHalf: return z ? rows_vnni_t<F, true, kLayoutHalf>(P, n0, n1) : rows_vnni_t<F, false, kLayoutHalf>(P, n0, n1);
    default: return z ? rows_vnni_t<F, true, kLayoutBlocks>(P, n0, n1) : rows_vnni_t<F, false, kLayoutBlocks>(P, n0, n1);
  }
}

// ---- Many rows (M > kVnniTileMaxRows) --------------------------------------------------------
// vnni_tile above keeps one block (16 outputs) against up to 8 rows: each unpacked code pair feeds
// 8 vpdpwssd, each x pair is broadcast again for every block. Prompt-sized M goes through
// vnni_gemm instead: a register tile of kGemmMR = 6 rows x kGemmNB = 4 blocks (24 int32
// accumulators; per code pair 4 panel loads and 6 x pair broadcasts feed 24 vpdpwssd), the code
// pairs of 4 blocks unpacked once per K slice (kVnniSliceCodes codes, whole groups) into a panel
// [pairs][4][16], the float accumulators of a tile kept in a small buffer across groups and
// slices, and work items (4 blocks x a range of rows) handed out to the threads dynamically, so
// that N as small as 576 still keeps every thread busy. The int32 group sums are exact whatever
// the tiling, and each (row, output) still gets
//   acc = fma(float(I_g), scale_g * d_g, acc);  acc = fma(zero_g, xz_g, acc)
// per group in group order from acc = 0, the same float32 ops as vnni_tile: the same bits.
// What bounds it (Zen 5, measured): vpdpwssd and the float32 mul / fma share the two FMA pipes
// (2 per cycle in all), so the epilogue's 3 ops per 16 vpdpwssd (g = 32) cost ~16% of the time;
// without them the tile runs at ~80% of the vpdpwssd peak, as fast as a bf16 GEMM (vdpbf16ps, the
// same 32 products per instruction, no epilogue). Embedded broadcasts ({1to16} memory operands)
// instead of vpbroadcastd ran ~15% slower; K slices of 128 or 256 codes (panel in L1) slower than
// 2048; 8 x 3, 12 x 2 and 4 x 6 tiles no faster than 6 x 4; a fully unrolled g = 32 loop no faster.
// Up to this many rows: rows_vnni_t (the decode path), beyond: vnni_gemm. Measured on the 1B
// shape's linears: one-plane codes (Q4_K_M) at 24 rows 70 ms on tiles vs 82 on the GEMM, at 32
// rows 94 vs ~98, at 64 rows 191 vs 179; two-plane codes (Q6_K, Q5_K_M), which unpack a line
// with more ops for each tile, at 24 rows 86 vs 79 (Q6_K), at 16 about even.
template <class F> constexpr int64_t kVnniTileMaxRows = kHighBits<F> != 0 ? 16 : 32;
constexpr int kGemmMR = 6, kGemmNB = 4;
constexpr int64_t kVnniSliceCodes = 2048;
constexpr int64_t kVnniItemRows = 192;  // rows per work item at most (a multiple of kGemmMR)

// MR rows x NB blocks over groups [g0, g1): panel [pairs from g0 * g / 2][NB][16] int32 pairs; x
// rows xr (row stride K, column 0 of the problem), facc [MR][NB][16] the float accumulators.
// The x pairs are broadcast into a register once per row and pair (vpbroadcastd), not read by
// each vpdpwssd as an embedded broadcast: on Zen 5 those run ~15% slower.
template <int MR, int NB, bool ZEROS>
QMM_VNNI static QMM_INLINE void gemm_tile(const Problem& P, const int32_t* __restrict panel,
                                          const int16_t* __restrict xr, const float* __restrict xd,
                                          const float* __restrict xz, const float* __restrict sb,
                                          const float* __restrict zb, float* __restrict facc, int64_t g0, int64_t g1) {
  const int64_t half = P.g / 2;  // code pairs per group
  const int64_t bs = 16 * P.G;   // scales / zeros stride between blocks
  const int64_t K = P.K, G = P.G, g = P.g;
  for (int64_t gi = g0; gi < g1; ++gi) {
    __m512i ia[MR][NB];
    QMM_UNROLL for (int i = 0; i < MR; ++i) {
      QMM_UNROLL for (int b = 0; b < NB; ++b) ia[i][b] = _mm512_setzero_si512();
    }
    const int32_t* pw = panel + (gi - g0) * half * NB * 16;
    const int16_t* px = xr + gi * g;
    for (int64_t j = 0; j < half; ++j) {
      __m512i w[NB];
      QMM_UNROLL for (int b = 0; b < NB; ++b) w[b] = _mm512_load_si512(pw + (j * NB + b) * 16);
      QMM_UNROLL for (int i = 0; i < MR; ++i) {
        int32_t xpair;  // X[2j] | X[2j + 1] << 16, read through memcpy (int16 storage)
        std::memcpy(&xpair, px + i * K + 2 * j, sizeof xpair);
        const __m512i xv = _mm512_set1_epi32(xpair);
        QMM_UNROLL for (int b = 0; b < NB; ++b) ia[i][b] = dpwssd(ia[i][b], w[b], xv);
      }
    }
    QMM_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 d = _mm512_set1_ps(xd[i * G + gi]);
      QMM_UNROLL for (int b = 0; b < NB; ++b) {
        float* f = facc + (i * NB + b) * 16;
        const __m512 sd = _mm512_mul_ps(_mm512_loadu_ps(sb + b * bs + gi * 16), d);
        __m512 acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[i][b]), sd, _mm512_load_ps(f));
        if (ZEROS) acc = _mm512_fmadd_ps(_mm512_loadu_ps(zb + b * bs + gi * 16), _mm512_set1_ps(xz[i * G + gi]), acc);
        _mm512_store_ps(f, acc);
      }
    }
  }
}

// The last r < kGemmMR rows of a range: a tile of exactly r rows.
template <int MR, int NB, bool ZEROS>
QMM_VNNI static void gemm_tail(int r, const Problem& P, const int32_t* panel, const int16_t* xr, const float* xd,
                               const float* xz, const float* sb, const float* zb, float* facc, int64_t g0, int64_t g1) {
  if constexpr (MR > 1) {
    if (r < MR) return gemm_tail<MR - 1, NB, ZEROS>(r, P, panel, xr, xd, xz, sb, zb, facc, g0, g1);
  }
  gemm_tile<MR, NB, ZEROS>(P, panel, xr, xd, xz, sb, zb, facc, g0, g1);
}

// Rows [m0, m1) x NB blocks from blk: one K slice at a time (the panel unpacked), every row tile.
template <class F, int NB, bool ZEROS, int SL>
QMM_VNNI static void gemm_item(const Problem& P, int64_t blk, int64_t m0, int64_t m1, const __m512i* ctl,
                               int32_t* panel, float* facc, float* sexp) {
  using C = VnniCodes<F>;
  const int64_t slice_groups = std::max<int64_t>(1, kVnniSliceCodes / P.g);
  const int64_t lines_per_group = P.g / (2 * C::kPairsPerLine);
  const int64_t rows = m1 - m0;
  std::memset(facc, 0, size_t(rows * NB * 16) * sizeof(float));
  const float* sb = P.scales + blk * 16 * P.G;
  const float* zb = ZEROS ? P.zeros + blk * 16 * P.G : nullptr;
  if (SL != kLayoutBlocks) {
    // The item's scales (and zeros) in the full layout once per item: the tiles then read them
    // as they read the full layout's (the item's M x K work dwarfs this).
    expand_scales<SL, ZEROS>(P, blk, NB, sexp);
    sb = sexp;
    zb = ZEROS ? sexp + NB * 16 * P.G : nullptr;
  }
  for (int64_t g0 = 0; g0 < P.G; g0 += slice_groups) {
    const int64_t g1 = std::min(P.G, g0 + slice_groups);
    for (int64_t c = g0 * lines_per_group; c < g1 * lines_per_group; ++c) {
      QMM_UNROLL for (int b = 0; b < NB; ++b) {
        const uint8_t* qb = P.q + (blk + b) * 16 * P.q_s0;
        const __m512i line = _mm512_loadu_si512(qb + c * 64), high = high_line_of<F>(qb, P.K, c);
        QMM_UNROLL for (int p = 0; p < C::kPairsPerLine; ++p) {
          const int64_t j = (c - g0 * lines_per_group) * C::kPairsPerLine + p;
          _mm512_store_si512(panel + (j * NB + b) * 16, pair_of<F>(line, ctl, high, p));
        }
      }
    }
    int64_t m = m0;
    for (; m + kGemmMR <= m1; m += kGemmMR)
      gemm_tile<kGemmMR, NB, ZEROS>(P, panel, P.xq + m * P.K, P.xd + m * P.G, P.xz + m * P.G, sb, zb,
                                    facc + (m - m0) * NB * 16, g0, g1);
    if (m < m1)
      gemm_tail<kGemmMR - 1, NB, ZEROS>(int(m1 - m), P, panel, P.xq + m * P.K, P.xd + m * P.G, P.xz + m * P.G, sb,
                                        zb, facc + (m - m0) * NB * 16, g0, g1);
  }
  for (int64_t m = m0; m < m1; ++m) {
    for (int b = 0; b < NB; ++b) {
      const int64_t n0 = (blk + b) * 16;
      const int nb = int(std::min<int64_t>(16, P.N - n0));
      const float* f = facc + ((m - m0) * NB + b) * 16;
      if (nb == 16 && !P.y_bf16) {
        _mm512_storeu_ps(static_cast<float*>(P.y) + m * P.y_s0 + n0, _mm512_load_ps(f));
      } else {
        for (int l = 0; l < nb; ++l) store(P, m, n0 + l, f[l]);
      }
    }
  }
}

// An item of nb <= kGemmNB blocks.
template <class F, int NB, bool ZEROS, int SL>
QMM_VNNI static void gemm_item_any(const Problem& P, int64_t blk, int nb, int64_t m0, int64_t m1, const __m512i* ctl,
                                   int32_t* panel, float* facc, float* sexp) {
  if constexpr (NB > 1) {
    if (nb < NB) return gemm_item_any<F, NB - 1, ZEROS, SL>(P, blk, nb, m0, m1, ctl, panel, facc, sexp);
  }
  gemm_item<F, NB, ZEROS, SL>(P, blk, m0, m1, ctl, panel, facc, sexp);
}

// All of y for many rows: work items of kGemmNB blocks x a range of rows, handed out dynamically.
template <class F, bool ZEROS, int SL>
QMM_VNNI static void vnni_gemm_t(const Problem& P, int nt) {
  using C = VnniCodes<F>;
  const int64_t blocks = (P.N + 15) / 16;
  const int64_t nchunks = (blocks + kGemmNB - 1) / kGemmNB;
  // Rows per item: all of them (up to kVnniItemRows) when the blocks alone give every thread
  // several items, else fewer, so that there are about 4 items per thread.
  int64_t msplit = (P.M + kVnniItemRows - 1) / kVnniItemRows;
  msplit = std::max<int64_t>(msplit, (4 * nt + nchunks - 1) / nchunks);
  int64_t mrows = (P.M + msplit - 1) / msplit;
  mrows = std::max<int64_t>(kGemmMR, (mrows + kGemmMR - 1) / kGemmMR * kGemmMR);
  const int64_t mchunks = (P.M + mrows - 1) / mrows;
  const int64_t items = nchunks * mchunks;
  const int64_t slice_pairs = std::max<int64_t>(1, kVnniSliceCodes / P.g) * P.g / 2;
  nt = int(std::max<int64_t>(1, std::min<int64_t>(nt, items)));
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
  {
    __m512i ctl[C::kPairsPerLine];
    for (int p = 0; p < C::kPairsPerLine; ++p) {
      alignas(64) int8_t c[64];
      C::control(p, c);
      ctl[p] = _mm512_load_si512(c);
    }
    std::vector<int32_t> pbuf(size_t(slice_pairs * kGemmNB * 16 + 16));
    std::vector<float> fbuf(size_t(mrows * kGemmNB * 16 + 16));
    std::vector<float> sbuf(SL != kLayoutBlocks ? size_t(2 * kGemmNB * 16 * P.G + 16) : 0);
    float* sexp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sbuf.data()) + 63) & ~uintptr_t(63));
    int32_t* panel = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(pbuf.data()) + 63) & ~uintptr_t(63));
    float* facc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(fbuf.data()) + 63) & ~uintptr_t(63));
    // Items row range fastest: consecutive items of a thread reuse the same blocks' codes.
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t it = 0; it < items; ++it) {
      const int64_t nc = it / mchunks, mc = it % mchunks;
      const int64_t blk = nc * kGemmNB;
      const int nb = int(std::min<int64_t>(kGemmNB, blocks - blk));
      gemm_item_any<F, kGemmNB, ZEROS, SL>(P, blk, nb, mc * mrows, std::min(P.M, (mc + 1) * mrows), ctl, panel,
                                                facc, sexp);
    }
  }
}

template <class F>
static void vnni_gemm(const Problem& P, int nt) {
  const bool z = P.zeros || P.zero_mul != 0.f;
  switch (P.layout) {
    case kLayoutCompact: return z ? vnni_gemm_t<F, true, kLayoutCompact>(P, nt) : vnni_gemm_t<F, false, kLayoutCompact>(P, nt);
    case kLayoutHalf: return z ? vnni_gemm_t<F, true, kLayoutHalf>(P, nt) : vnni_gemm_t<F, false, kLayoutHalf>(P, nt);
    default: return z ? vnni_gemm_t<F, true, kLayoutBlocks>(P, nt) : vnni_gemm_t<F, false, kLayoutBlocks>(P, nt);
  }
}
#else
static bool cpu_has_vnni() { return false; }
#endif
#else
static bool cpu_has_avx512() { return false; }
static bool cpu_has_avx2() { return false; }
static bool cpu_has_vnni() { return false; }
#endif

// x rows as float32, row stride K, into dst; with block > 0 (int4 vector paths), the even
// columns of each block of `block` columns first, then its odd ones (K % block == 0):
// dst[m, b + i] = x[m, b + 2 i], dst[m, b + block / 2 + i] = x[m, b + 2 i + 1].
static void prepare_x(const void* x, int64_t s0, bool bf16, int64_t M, int64_t K, int64_t block, float* dst) {
  for (int64_t m = 0; m < M; ++m) {
    float* d = dst + m * K;
    if (bf16) {
      const uint16_t* r = static_cast<const uint16_t*>(x) + m * s0;
      for (int64_t k = 0; k < K; ++k) d[k] = bf16_to_f32(r[k]);
    } else {
      std::memcpy(d, static_cast<const float*>(x) + m * s0, size_t(K) * sizeof(float));
    }
    if (block > 0) {
      float tmp[64];  // block <= 32
      for (int64_t b = 0; b < K; b += block) {
        for (int64_t i = 0; i < block / 2; ++i) {
          tmp[i] = d[b + 2 * i];
          tmp[block / 2 + i] = d[b + 2 * i + 1];
        }
        std::memcpy(d + b, tmp, size_t(block) * sizeof(float));
      }
    }
  }
}

// x rounded for the avx512-vnni path: per row m and group, d = max|x| / 32767 and X = round(x / d)
// (int16, |X| <= 32767) into xq [M][K] (read as int32 pairs), d into xd [M][G], d * sum X into
// xz [M][G]. A group with a non-finite value gets X = 0 and d = NaN, so its outputs are NaN as
// they would be on the float paths; an all-zero group d = 0.
static void quantize_x(const void* x, int64_t s0, bool bf16, int64_t M, int64_t K, int64_t g, int16_t* xq, float* xd,
                       float* xz) {
  const int64_t G = K / g;
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t m = 0; m < M; ++m) {
    if (bf16) {
      const uint16_t* r = static_cast<const uint16_t*>(x) + m * s0;
      for (int64_t k = 0; k < K; ++k) row[size_t(k)] = bf16_to_f32(r[k]);
    } else {
      std::memcpy(row.data(), static_cast<const float*>(x) + m * s0, size_t(K) * sizeof(float));
    }
    for (int64_t gi = 0; gi < G; ++gi) {
      const float* v = row.data() + gi * g;
      int16_t* X = xq + m * K + gi * g;
      float amax = 0.f;
      bool finite = true;
      for (int64_t k = 0; k < g; ++k) {
        finite = finite && std::isfinite(v[k]);
        amax = std::max(amax, std::fabs(v[k]));
      }
      const float inv = 32767.f / amax;
      if (!finite || !std::isfinite(inv)) {  // (an all-zero group, or one too small to scale: 0)
        for (int64_t k = 0; k < g; ++k) X[k] = 0;
        xd[m * G + gi] = finite ? 0.f : std::nanf("");
        xz[m * G + gi] = xd[m * G + gi];
        continue;
      }
      int32_t sum = 0;
      for (int64_t k = 0; k < g; ++k) {
        const long r = std::lrintf(v[k] * inv);
        X[k] = int16_t(std::max(-32767L, std::min(32767L, r)));
        sum += X[k];
      }
      xd[m * G + gi] = amax / 32767.f;
      xz[m * G + gi] = xd[m * G + gi] * float(sum);
    }
  }
}

// Whether weights of this shape can be kept in VNNI blocks (and so run on the avx512-vnni path).
static bool vnni_blocks_fit(int64_t K, int64_t group_size) {
  return cpu_has_vnni() && group_size >= 8 && group_size % 8 == 0 && group_size <= 256 && K % group_size == 0;
}

// Shared by both formats: checks, path choice, threading. layout: kLayoutRows, or q, scales and
// zeros in VNNI blocks (kLayoutBlocks, kLayoutCompact: compact scales and zeros, kLayoutHalf:
// float16 ones, zero_mul as in Problem), and then the avx512-vnni path runs, and only it can.
template <class F>
static int group_matmul(const void* x, int64_t x_s0, int x_bf16, const uint8_t* q, const float* scales,
                        const float* zeros, void* y, int64_t y_s0, int64_t M, int64_t N, int64_t K,
                        int64_t group_size, int impl, int num_threads, char* err, int64_t err_len,
                        int layout = kLayoutRows, float zero_mul = 0.f) {
  const bool vnni_blocks = layout != kLayoutRows;
  if (layout < kLayoutRows || layout > kLayoutHalf) {
    std::snprintf(err, size_t(err_len), "unknown weight layout %d", layout);
    return 1;
  }
  if (zero_mul != 0.f && (layout != kLayoutHalf || zeros != nullptr)) {
    std::snprintf(err, size_t(err_len), "zeros as a multiple of the scales need float16 scales and no zeros array");
    return 1;
  }
  if (layout == kLayoutCompact && (kSuperBlock % group_size != 0 || K % kSuperBlock != 0)) {
    std::snprintf(err, size_t(err_len), "compact scales need K (%lld) a multiple of %lld and a group size "
                  "dividing it (got %lld)", (long long)K, (long long)kSuperBlock, (long long)group_size);
    return 1;
  }
  if (group_size < 1 || K % group_size != 0) {
    std::snprintf(err, size_t(err_len), "group_size %lld must be >= 1 and divide K=%lld", (long long)group_size,
                  (long long)K);
    return 1;
  }
  if (K % F::kCodesPerByte != 0) {
    std::snprintf(err, size_t(err_len), "K=%lld must be even for packed 4-bit codes", (long long)K);
    return 1;
  }
  if ((impl == 2 && !cpu_has_avx512()) || (impl == 3 && !cpu_has_avx2()) || (impl == 4 && !cpu_has_vnni())) {
    std::snprintf(err, size_t(err_len), "code path %d is not supported by this CPU", impl);
    return 1;
  }
  if (impl < 0 || impl > 4) {
    std::snprintf(err, size_t(err_len), "unknown code path %d", impl);
    return 1;
  }
  if (vnni_blocks != (impl == 4) && !(vnni_blocks && impl == 0)) {
    std::snprintf(err, size_t(err_len), vnni_blocks ? "weights in VNNI blocks run only on the avx512-vnni path"
                                                    : "the avx512-vnni path reads weights in VNNI blocks only");
    return 1;
  }
  if (!F::kRowPaths && !vnni_blocks) {
    std::snprintf(err, size_t(err_len), "4-bit table indices (IQ4_XS), 6-bit planes (Q6_K) and 5-bit planes "
                  "(Q5_0, Q5_1, Q5_K) run only on weights in VNNI blocks");
    return 1;
  }
  if (kHighBits<F> == 1 && K % 32 != 0) {
    std::snprintf(err, size_t(err_len), "5-bit planes need K a multiple of 32 (got %lld)", (long long)K);
    return 1;
  }
  if (std::is_same<F, I6>::value && group_size % 16 != 0) {
    std::snprintf(err, size_t(err_len), "6-bit planes need a group size that is a multiple of 16 (got %lld)",
                  (long long)group_size);
    return 1;
  }
  if (vnni_blocks && !vnni_blocks_fit(K, group_size)) {
    std::snprintf(err, size_t(err_len), "VNNI blocks need an AVX-512 VNNI CPU and a group size in 8..256 that "
                  "is a multiple of 8 (got %lld)", (long long)group_size);
    return 1;
  }
  if (M <= 0 || N <= 0) return 0;

  Problem P;
  P.q = q; P.q_s0 = F::bytes(K); P.scales = scales; P.zeros = zeros;
  P.M = M; P.N = N; P.K = K; P.g = group_size; P.G = K / group_size;
  P.y = y; P.y_s0 = y_s0; P.y_bf16 = x_bf16 != 0;
  P.layout = layout;
  P.zero_mul = zero_mul;
  if (layout == kLayoutCompact) {
    P.sub = kSuperBlock / group_size;
    P.cs_bytes = compact_block_bytes(P.G, P.sub);
  } else if (layout == kLayoutHalf) {
    P.cs_bytes = half_block_bytes(P.G);
  }

  // The path: the requested one (0: the best) if its step divides the group, else the next.
  void (*rows)(const Problem&, int64_t, int64_t) = nullptr;
  if constexpr (F::kRowPaths) rows = &rows_scalar<F>;
  int64_t step = 0;  // the vector path's step (codes per group chunk); 0: scalar
  const bool vnni = vnni_blocks;
#if QMM_X86
  if (vnni) {
#ifdef QMM_HAS_VNNI
    rows = &rows_vnni<F>;
#endif
  } else if constexpr (F::kRowPaths) {
    if ((impl == 0 || impl == 2) && cpu_has_avx512() && group_size % Avx512<F>::kStep == 0) {
      rows = &rows_avx512<F>;
      step = Avx512<F>::kStep;
    } else if (impl != 1 && cpu_has_avx2() && group_size % Avx2<F>::kStep == 0) {
      rows = &rows_avx2<F>;
      step = Avx2<F>::kStep;
    }
  }
#endif
  // x as the kernel reads it: float32 x itself where it can, else one small copy per call
  // (M x K): bf16 x widened, and for the int4 vector paths each step's columns reordered.
  const int64_t block = F::kCodesPerByte == 2 ? step : 0;
  std::vector<float> xf;
  std::vector<int16_t> xq;
  std::vector<float> xd, xz;
  if (vnni) {
    xq.resize(size_t(M * K));
    xd.resize(size_t(M * P.G));
    xz.resize(size_t(M * P.G));
    // Row by row, so many rows (a prompt) are rounded by all threads, each row as alone.
    const int64_t qt = M >= 64 && M * K >= (int64_t(1) << 16) ? std::max(1, num_threads) : 1;
    const int64_t G = P.G;
#ifdef _OPENMP
#pragma omp parallel for num_threads(int(qt)) schedule(static) if (qt > 1)
#endif
    for (int64_t t = 0; t < qt; ++t) {
      const int64_t m0 = M * t / qt, rows = M * (t + 1) / qt - m0;
      const void* xr = static_cast<const char*>(x) + m0 * x_s0 * (x_bf16 ? 2 : 4);
#ifdef QMM_HAS_VNNI
      if (!x_bf16 && group_size % 16 == 0)
        quantize_x_avx512(static_cast<const float*>(xr), x_s0, rows, K, group_size, xq.data() + m0 * K,
                          xd.data() + m0 * G, xz.data() + m0 * G);
      else
#endif
        quantize_x(xr, x_s0, x_bf16 != 0, rows, K, group_size, xq.data() + m0 * K, xd.data() + m0 * G,
                   xz.data() + m0 * G);
    }
    P.xq = xq.data();
    P.xd = xd.data();
    P.xz = xz.data();
  } else if (x_bf16 || block > 0) {
    xf.resize(size_t(M * K));
    prepare_x(x, x_s0, x_bf16 != 0, M, K, block, xf.data());
    P.x = xf.data();
    P.x_s0 = K;
  } else {
    P.x = static_cast<const float*>(x);
    P.x_s0 = x_s0;
  }

  // Tiny problems run on the calling thread (waking the pool costs more than they do).
  const int64_t work = M * N * K;
#ifdef QMM_HAS_VNNI
  if (vnni && M > kVnniTileMaxRows<F>) {
    vnni_gemm<F>(P, work < (int64_t(1) << 16) ? 1 : std::max(1, num_threads));
    return 0;
  }
#endif
  int nt = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, (N + 15) / 16)));
  if (work < (int64_t(1) << 16)) nt = 1;
  if (nt == 1) {
    rows(P, 0, N);
    return 0;
  }
#ifdef _OPENMP
  // Chunks of whole 16-row blocks (a multiple of every tile's row count), handed out dynamically
  // (a thread that starts late, or shares its core, just takes fewer), about 8 per thread and at
  // least 64 rows each.
  const int64_t blocks = (N + 15) / 16;
  const int64_t chunk = std::max<int64_t>(4, (blocks + 8 * nt - 1) / (8 * nt)) * 16;
  const int64_t nchunks = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t c = 0; c < nchunks; ++c) rows(P, c * chunk, std::min(N, (c + 1) * chunk));
#else
  rows(P, 0, N);
#endif
  return 0;
}

// ------------------------------------------------------------------------------------------
// Dequantization into a dense matrix (what a prefill-sized matmul multiplies by): out[n, k] =
// q[n, k] * scale + zero, rounded once to out's dtype (float32, or bfloat16 to nearest even).
// Plain loops the compiler vectorizes for each target; memory-bound, so rows are split between
// threads. The weight values are the ones the matmul kernels form (code * scale + zero in
// float32), so a dense GEMM by them differs from the packed kernels by summation order only.
#ifndef QMM_INLINE
#define QMM_INLINE inline
#endif
template <class F, bool BF16>
static QMM_INLINE void dequant_rows_body(const uint8_t* q, int64_t q_s0, const float* scales, const float* zeros,
                                         int64_t K, int64_t g, void* out, int64_t n0, int64_t n1) {
  const int64_t G = K / g;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = q + n * q_s0;
    for (int64_t gi = 0; gi < G; ++gi) {
      const float s = scales[n * G + gi], z = zeros ? zeros[n * G + gi] : 0.f;
      const int64_t k0 = gi * g;
      float* of = static_cast<float*>(out) + n * K + k0;
      uint16_t* ob = static_cast<uint16_t*>(out) + n * K + k0;
      if (F::kCodesPerByte == 2) {
        const uint8_t* b = qr + k0 / 2;
        for (int64_t j = 0; j < g / 2; ++j) {
          const float lo = float(F::nibble(b[j] & 15)) * s + z, hi = float(F::nibble(b[j] >> 4)) * s + z;
          if (BF16) {
            ob[2 * j] = f32_to_bf16(lo);
            ob[2 * j + 1] = f32_to_bf16(hi);
          } else {
            of[2 * j] = lo;
            of[2 * j + 1] = hi;
          }
        }
      } else {
        const int8_t* c = reinterpret_cast<const int8_t*>(qr) + k0;
        for (int64_t j = 0; j < g; ++j) {
          const float w = float(c[j]) * s + z;
          if (BF16)
            ob[j] = f32_to_bf16(w);
          else
            of[j] = w;
        }
      }
    }
  }
}

template <class F, bool BF16>
static void dequant_rows_scalar(const uint8_t* q, int64_t q_s0, const float* s, const float* z, int64_t K, int64_t g,
                                void* out, int64_t n0, int64_t n1) {
  dequant_rows_body<F, BF16>(q, q_s0, s, z, K, g, out, n0, n1);
}
#if QMM_X86
// 16 weights from 16 int32 codes: fma once, stored as float32 or rounded to bfloat16 (nearest
// even, integer ops: AVX-512F only; weights are finite).
template <bool BF16>
QMM_AVX512 static QMM_INLINE void dequant_store16(__m512i codes, __m512 s, __m512 z, void* out, int64_t i) {
  const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), s, z);
  if (BF16) {
    const __m512i u = _mm512_castps_si512(w);
    const __m512i r = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                       _mm512_set1_epi32(0x7fff));
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, r), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), h);
  } else {
    _mm512_storeu_ps(static_cast<float*>(out) + i, w);
  }
}

template <class F, bool BF16>
QMM_AVX512 static void dequant_rows_avx512(const uint8_t* q, int64_t q_s0, const float* sc, const float* zs, int64_t K,
                                           int64_t g, void* out, int64_t n0, int64_t n1) {
  const bool int4 = F::kCodesPerByte == 2;
  if (g % (int4 ? 32 : 16) != 0) {
    dequant_rows_body<F, BF16>(q, q_s0, sc, zs, K, g, out, n0, n1);
    return;
  }
  const int64_t G = K / g;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = q + n * q_s0;
    for (int64_t gi = 0; gi < G; ++gi) {
      const __m512 s = _mm512_set1_ps(sc[n * G + gi]), z = _mm512_set1_ps(zs ? zs[n * G + gi] : 0.f);
      const int64_t k0 = gi * g, o = n * K + k0;
      if (int4) {
        for (int64_t j = 0; j < g; j += 32) {  // 16 bytes: codes k0+j .. k0+j+31, low nibble first
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + (k0 + j) / 2));
          __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
          __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
          if (F::kTable) {  // (NL4: the table's int8 values, widened with their sign)
            const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kNl4Values));
            lo = _mm_shuffle_epi8(t, lo);
            hi = _mm_shuffle_epi8(t, hi);
            dequant_store16<BF16>(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(lo, hi)), s, z, out, o + j);
            dequant_store16<BF16>(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(lo, hi)), s, z, out, o + j + 16);
            continue;
          }
          dequant_store16<BF16>(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), s, z, out, o + j);
          dequant_store16<BF16>(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), s, z, out, o + j + 16);
        }
      } else {
        for (int64_t j = 0; j < g; j += 16) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k0 + j));
          dequant_store16<BF16>(_mm512_cvtepi8_epi32(b), s, z, out, o + j);
        }
      }
    }
  }
}
template <class F, bool BF16>
QMM_AVX2 static void dequant_rows_avx2(const uint8_t* q, int64_t q_s0, const float* s, const float* z, int64_t K,
                                       int64_t g, void* out, int64_t n0, int64_t n1) {
  dequant_rows_body<F, BF16>(q, q_s0, s, z, K, g, out, n0, n1);
}
#endif

template <class F, bool BF16>
static void dequantize(const uint8_t* q, const float* scales, const float* zeros, void* out, int64_t N, int64_t K,
                       int64_t g, int num_threads, int layout, float zero_mul);

// A two-plane format (I6, I5, I5S; VNNI blocks only): its codes as the int8 layout's VNNI blocks,
// then I8's dequantization, so the values are the int8 weight's.
template <class F, bool BF16>
static void dequantize_planes(const uint8_t* q, const float* scales, const float* zeros, void* out, int64_t N,
                              int64_t K, int64_t g, int num_threads, int layout, float zero_mul) {
  std::vector<uint8_t> q8(size_t(N * K));
  const int64_t blocks = (N + 15) / 16, block_bytes = 16 * F::bytes(K);
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < 16; ++r)
      for (int64_t k = 0; k < K; ++k)
        q8[size_t(b * 16 * K + (k / 4) * 64 + 4 * r + k % 4)] = uint8_t(int8_t(F::code_in_block(q + b * block_bytes, K, r, k)));
  dequantize<I8, BF16>(q8.data(), scales, zeros, out, N, K, g, num_threads, layout, zero_mul);
}

template <class F, bool BF16>
static void dequantize(const uint8_t* q, const float* scales, const float* zeros, void* out, int64_t N, int64_t K,
                       int64_t g, int num_threads, int layout, float zero_mul) {
  if constexpr (kHighBits<F> != 0) {
    dequantize_planes<F, BF16>(q, scales, zeros, out, N, K, g, num_threads, layout, zero_mul);
    return;
  }
  const bool vnni_blocks = layout != kLayoutRows, packed_scales = layout >= kLayoutCompact;
  const bool any_zeros = zeros != nullptr || zero_mul != 0.f;
  auto rows = &dequant_rows_scalar<F, BF16>;
#if QMM_X86
  if (cpu_has_avx512())
    rows = &dequant_rows_avx512<F, BF16>;
  else if (cpu_has_avx2())
    rows = &dequant_rows_avx2<F, BF16>;
#endif
  const int64_t q_s0 = F::bytes(K);
  if (vnni_blocks) {
    // Block by block: its rows back in row order (16 rows of codes, scales and zeros), then the
    // same row code as for weights kept in rows, so both give the same values.
    const int64_t G = K / g, blocks = (N + 15) / 16;
    int nt = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
    if (N * K < (int64_t(1) << 16)) nt = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
      std::vector<uint8_t> tq(size_t(16 * q_s0));
      std::vector<float> ts(size_t(16 * G)), tz(any_zeros ? size_t(16 * G) : 0);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* qb = q + b * 16 * q_s0;
        for (int64_t c = 0; c < q_s0 / 4; ++c)
          for (int r = 0; r < 16; ++r) {
            uint32_t lane;
            std::memcpy(&lane, qb + c * 64 + 4 * r, 4);
            if (F::kCodesPerByte == 2) lane = u4_lane_to_row(lane);
            std::memcpy(&tq[size_t(r * q_s0 + 4 * c)], &lane, 4);
          }
        if (packed_scales) {
          const int64_t sub = layout == kLayoutCompact ? kSuperBlock / g : 1;
          const int64_t cs = layout == kLayoutCompact ? compact_block_bytes(G, sub) : half_block_bytes(G);
          const uint8_t* sbk = reinterpret_cast<const uint8_t*>(scales) + b * cs;
          const uint8_t* zbk = zeros ? reinterpret_cast<const uint8_t*>(zeros) + b * cs : nullptr;
          for (int r = 0; r < 16; ++r)
            for (int64_t gi = 0; gi < G; ++gi) {
              const float s = scale_at(layout, sbk, G, sub, gi, r);
              ts[size_t(r * G + gi)] = s;
              if (any_zeros) tz[size_t(r * G + gi)] = zbk ? scale_at(layout, zbk, G, sub, gi, r) : s * zero_mul;
            }
        } else {
          for (int r = 0; r < 16; ++r)
            for (int64_t gi = 0; gi < G; ++gi) {
              ts[size_t(r * G + gi)] = scales[(b * G + gi) * 16 + r];
              if (zeros) tz[size_t(r * G + gi)] = zeros[(b * G + gi) * 16 + r];
            }
        }
        const int64_t nb = std::min<int64_t>(16, N - b * 16);
        void* ob = static_cast<char*>(out) + b * 16 * K * (BF16 ? 2 : 4);
        rows(tq.data(), q_s0, ts.data(), any_zeros ? tz.data() : nullptr, K, g, ob, 0, nb);
      }
    }
    return;
  }
  int nt = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, N / 16)));
  if (N * K < (int64_t(1) << 16)) nt = 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
  for (int t = 0; t < nt; ++t) rows(q, q_s0, scales, zeros, K, g, out, N * t / nt, N * (t + 1) / nt);
}

}  // namespace qmm

// ---- C ABI (called through ctypes) ---------------------------------------------------------

// Bit mask of the code paths this CPU can run: 1 scalar, 2 avx512, 4 avx2, 8 avx512-vnni.
extern "C" int kvs_qmm_cpu_paths() {
  return 1 | (qmm::cpu_has_avx512() ? 2 : 0) | (qmm::cpu_has_avx2() ? 4 : 0) | (qmm::cpu_has_vnni() ? 8 : 0);
}

// Whether weights [N, K] in groups of group_size can be kept in VNNI blocks on this CPU.
extern "C" int kvs_qmm_vnni_blocks_fit(int64_t K, int64_t group_size) { return qmm::vnni_blocks_fit(K, group_size); }

// Shapes, dtypes and strides are checked by the Python wrapper. Returns 0, or 1 with a message
// in err. impl: 0 best, 1 scalar, 2 avx512, 3 avx2, 4 avx512-vnni; a vector path whose lane
// count does not divide group_size falls back to the next one that does (the scalar path takes
// any). layout: 0 rows; 1 q, scales and zeros in VNNI blocks, 2 the same with compact scales and
// zeros, 3 with float16 ones (all three: impl 0 or 4, the avx512-vnni path); zero_mul != 0 (layout
// 3, zeros null): each zero is its scale times zero_mul.
extern "C" int kvs_int8_group_matmul(const void* x, int64_t x_s0, int x_bf16, const int8_t* q, const float* scales,
                                     const float* zeros, void* y, int64_t y_s0, int64_t M, int64_t N, int64_t K,
                                     int64_t group_size, int impl, int num_threads, char* err, int64_t err_len,
                                     int layout, float zero_mul) {
  return qmm::group_matmul<qmm::I8>(x, x_s0, x_bf16, reinterpret_cast<const uint8_t*>(q), scales, zeros, y, y_s0, M,
                                    N, K, group_size, impl, num_threads, err, err_len, layout, zero_mul);
}

// As kvs_int8_group_matmul, with q the packed 4-bit codes: uint8 [N, K / 2], K even (layout at
// the top of this file).
extern "C" int kvs_int4_group_matmul(const void* x, int64_t x_s0, int x_bf16, const uint8_t* packed,
                                     const float* scales, const float* zeros, void* y, int64_t y_s0, int64_t M,
                                     int64_t N, int64_t K, int64_t group_size, int impl, int num_threads, char* err,
                                     int64_t err_len, int layout, float zero_mul) {
  return qmm::group_matmul<qmm::U4>(x, x_s0, x_bf16, packed, scales, zeros, y, y_s0, M, N, K, group_size, impl,
                                    num_threads, err, err_len, layout, zero_mul);
}

// As kvs_int4_group_matmul, with q 4-bit indices into the IQ4_NL table (kNl4Values) packed as
// the 4-bit codes are: the results of kvs_int8_group_matmul on the table's values, bit for bit.
// VNNI blocks only (layout 1 or 2, impl 0 or 4).
extern "C" int kvs_nl4_group_matmul(const void* x, int64_t x_s0, int x_bf16, const uint8_t* packed,
                                    const float* scales, const float* zeros, void* y, int64_t y_s0, int64_t M,
                                    int64_t N, int64_t K, int64_t group_size, int impl, int num_threads, char* err,
                                    int64_t err_len, int layout, float zero_mul) {
  return qmm::group_matmul<qmm::NL4>(x, x_s0, x_bf16, packed, scales, zeros, y, y_s0, M, N, K, group_size, impl,
                                     num_threads, err, err_len, layout, zero_mul);
}

// As kvs_int8_group_matmul, with q Q6_K's codes as a 4-bit and a 2-bit plane (qmatmul.cpp I6),
// in VNNI blocks only: the int8 kernel's results on the same codes, bit for bit.
extern "C" int kvs_i6_group_matmul(const void* x, int64_t x_s0, int x_bf16, const uint8_t* q, const float* scales,
                                   const float* zeros, void* y, int64_t y_s0, int64_t M, int64_t N, int64_t K,
                                   int64_t group_size, int impl, int num_threads, char* err, int64_t err_len,
                                   int layout, float zero_mul) {
  return qmm::group_matmul<qmm::I6>(x, x_s0, x_bf16, q, scales, zeros, y, y_s0, M, N, K, group_size, impl,
                                    num_threads, err, err_len, layout, zero_mul);
}

// As kvs_i6_group_matmul, with q the 5-bit codes of Q5_1 / Q5_K (unsigned: qmatmul.cpp I5) or
// Q5_0 (signed: I5S) as a 4-bit and a 1-bit plane, in VNNI blocks only.
extern "C" int kvs_i5_group_matmul(const void* x, int64_t x_s0, int x_bf16, const uint8_t* q, const float* scales,
                                   const float* zeros, void* y, int64_t y_s0, int64_t M, int64_t N, int64_t K,
                                   int64_t group_size, int impl, int num_threads, char* err, int64_t err_len,
                                   int layout, float zero_mul) {
  return qmm::group_matmul<qmm::I5>(x, x_s0, x_bf16, q, scales, zeros, y, y_s0, M, N, K, group_size, impl,
                                    num_threads, err, err_len, layout, zero_mul);
}
extern "C" int kvs_i5s_group_matmul(const void* x, int64_t x_s0, int x_bf16, const uint8_t* q, const float* scales,
                                    const float* zeros, void* y, int64_t y_s0, int64_t M, int64_t N, int64_t K,
                                    int64_t group_size, int impl, int num_threads, char* err, int64_t err_len,
                                    int layout, float zero_mul) {
  return qmm::group_matmul<qmm::I5S>(x, x_s0, x_bf16, q, scales, zeros, y, y_s0, M, N, K, group_size, impl,
                                     num_threads, err, err_len, layout, zero_mul);
}

// Dense weights out [N, K] (contiguous; float32, or bfloat16 when out_bf16) from int8 codes
// (int4 = 0, q int8 [N, K]), packed 4-bit codes (int4 = 1, q uint8 [N, K / 2]) or packed 4-bit
// IQ4_NL table indices (int4 = 2), or (VNNI blocks only) Q6_K's planes (int4 = 3: I6) or the 5-bit
// planes (int4 = 4: I5, unsigned; 5: I5S, Q5_0's signed codes), in rows or (with layout 1 to 3) in
// VNNI blocks; scales / zeros as for the matmuls. Shapes are checked by the Python wrapper.
// Returns 0 (1: planes asked for in rows).
extern "C" int kvs_group_dequantize(const uint8_t* q, int int4, const float* scales, const float* zeros, void* out,
                                    int out_bf16, int64_t N, int64_t K, int64_t group_size, int num_threads,
                                    int layout, float zero_mul) {
  if (N <= 0 || K <= 0) return 0;
  const int vb = layout;
  if (int4 >= 3 && layout == 0) return 1;  // (planes are kept in VNNI blocks only)
  if (int4 == 5)
    out_bf16 ? qmm::dequantize<qmm::I5S, true>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul)
             : qmm::dequantize<qmm::I5S, false>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul);
  else if (int4 == 4)
    out_bf16 ? qmm::dequantize<qmm::I5, true>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul)
             : qmm::dequantize<qmm::I5, false>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul);
  else if (int4 == 3)
    out_bf16 ? qmm::dequantize<qmm::I6, true>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul)
             : qmm::dequantize<qmm::I6, false>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul);
  else if (int4 == 2)
    out_bf16 ? qmm::dequantize<qmm::NL4, true>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul)
             : qmm::dequantize<qmm::NL4, false>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul);
  else if (int4)
    out_bf16 ? qmm::dequantize<qmm::U4, true>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul)
             : qmm::dequantize<qmm::U4, false>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul);
  else
    out_bf16 ? qmm::dequantize<qmm::I8, true>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul)
             : qmm::dequantize<qmm::I8, false>(q, scales, zeros, out, N, K, group_size, num_threads, vb, zero_mul);
  return 0;
}
