// GGUF quantized blocks -> the layouts the group kernels read (qmatmul.cpp), in one pass.
//
// The Python reference is kvshare/model/gguf_quants.py (`to_group_affine`: codes one per byte,
// float32 scale and zero per group) followed by qlinear's packing (`pack_int4_rows` for the Q4
// formats, int8 codes for the rest) and, where `vnni_blocks_fit` says so, `to_vnni_blocks`. At
// load that chain makes several single-threaded passes over every weight; here each output row
// is decoded once from the file's bytes straight into its final place, rows split over threads.
// The values are the reference's bit for bit: a scale is a float16 times a small integer (exact
// in float32, so the product's rounding cannot differ) and the codes are integers
// (tests/test_gguf_repack.py compares every format with torch.equal).
//
// Output row r of the call reads its blocks at row_addrs[r] (a row of the file's tensor: the
// caller picks the rows, so llama's q/k un-permute, a tensor-parallel shard and a fused q/k/v
// are just other address lists) and is written as row `row0 + r` of a weight of n_total rows:
//
// * int4 = 1 (Q4_0 / Q4_1 / Q4_K): uint8 [N, K / 2], byte j = code 2j | code 2j + 1 << 4.
//   IQ4_XS too: then the 4-bit fields are its indices into the non-linear table (what
//   qmatmul.cpp's NL4 reads), not codes; its scales are the same as with int4 = 0.
// * int4 = 2 (Q6_K, VNNI blocks only): its codes + 32 as a 4-bit plane (K / 2 bytes, packed as
//   above) then a 2-bit plane (K / 4 bytes: per 16 codes 4 bytes, code 2m at bits 2m and code
//   2m + 1 at bits 16 + 2m), which qmatmul.cpp's I6 reads; in VNNI blocks the low plane's lines
//   and then the high plane's.
// * int4 = 3 (Q5_0 / Q5_1 / Q5_K, VNNI blocks only): its codes' low 4 bits as a 4-bit plane (K / 2
//   bytes, packed as above) then their fifth bits as a 1-bit plane (K / 8 bytes: per 32 codes 4
//   bytes, code 8t + 2p at bit 4t + p and code 8t + 2p + 1 at bit 16 + 4t + p), which
//   qmatmul.cpp's I5 (Q5_1, Q5_K: codes 0..31) and I5S (Q5_0: -16..15, the fifth bit its sign)
//   read; in VNNI blocks the low plane's lines and then the high plane's.
// * int4 = 0 (every format): int8 [N, K], one code per byte (unsigned codes of 5 bits and less
//   fit as they are, as qlinear's `q.to(torch.int8)` leaves them).
// * scales / zeros float32 [N, K / g]; zeros null for a weight without offsets, and written 0
//   for a symmetric format's rows inside a weight that has them (GroupAffine.cat's zeros_like).
// * vnni = 1: the same bytes in VNNI blocks (qmatmul.cpp "VNNI blocks"): q [N / 16, row_bytes / 4,
//   16, 4], scales and zeros [N / 16, K / g, 16]. Threads take whole 16-row blocks, so no two
//   write the same cache line.
// * vnni = 2 (the K-quants and IQ4_XS): VNNI blocks with compact scales and zeros (qmatmul.cpp,
//   kLayoutCompact): per 16-row block, int8 codes [G][16] and then the float16 bases [G / sub][16]
//   of its super-blocks (d, and -dmin for the zeros), so that base * code is the scale (zero)
//   above. Each one is checked bit for bit against the full layout's value as it is written;
//   a weight where one differs (a non-finite d, say) is refused (the caller keeps the full layout).
// * vnni = 3 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): VNNI blocks with float16 scales and zeros (kLayoutHalf):
//   per 16-row block float16 [G][16], the file's d (and m); zeros null for Q4_0 (its zero, -8 d, is
//   formed by the kernel), and refused for a Q4_0 run inside a weight with a zeros array.
//
// On AVX-512 CPUs, whole 16-row spans of the layouts K-quant files are made of (Q4_K codes, IQ4_XS
// indices and Q5_K / Q6_K planes with compact scales, Q5_0 / Q5_1 planes with float16 scales) take a vector path
// (repack_span_*_avx512) that writes the same bytes; impl = 1 keeps every call scalar (tests).
//
// The block layouts follow ggml's definitions (ggml-common.h), as gguf_quants.py's decoders do.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <atomic>
#include <system_error>
#include <thread>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace gguf_repack {

// ggml's type ids (the GGUF tensor table's type field).
enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
                  Q6_K = 14, IQ4_XS = 23 };

struct Format {
  int block;       // weights per block
  int type_size;   // bytes per block
  int group;       // weights per scale
  bool has_zero;   // an offset per group
  bool int4_ok;    // 4-bit unsigned codes (what the int4 kernels take)
};

inline bool format_of(int type, Format* f) {
  switch (type) {
    case Q4_0: *f = {32, 18, 32, true, true}; return true;
    case Q4_1: *f = {32, 20, 32, true, true}; return true;
    case Q5_0: *f = {32, 22, 32, false, false}; return true;
    case Q5_1: *f = {32, 24, 32, true, false}; return true;
    case Q8_0: *f = {32, 34, 32, false, false}; return true;
    case Q2_K: *f = {256, 84, 16, true, false}; return true;
    case Q3_K: *f = {256, 110, 16, false, false}; return true;
    case Q4_K: *f = {256, 144, 32, true, true}; return true;
    case Q5_K: *f = {256, 176, 32, true, false}; return true;
    case Q6_K: *f = {256, 210, 16, false, false}; return true;
    case IQ4_XS: *f = {256, 136, 32, false, true}; return true;  // (int4: its table indices)
    default: return false;
  }
}

// A float16 at p (little-endian), as float (qmatmul.cpp's f16_to_f32: this file follows it in
// the library's one translation unit).
inline uint16_t half_bits(const uint8_t* p) { return uint16_t(p[0] | p[1] << 8); }
inline float f16(const uint8_t* p) { return qmm::f16_to_f32(half_bits(p)); }

const int8_t* const kIq4nlValues = qmm::kNl4Values;

// Low nibbles are weights 0..15 of a 32, high nibbles 16..31 (Q4_0, Q4_1, Q5_x, IQ4_XS).
inline void nibbles32(const uint8_t* qs, uint8_t* c) {
  for (int j = 0; j < 16; ++j) {
    c[j] = qs[j] & 0xF;
    c[j + 16] = qs[j] >> 4;
  }
}

// The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K super-block.
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | (s[j] >> 6) << 4;
    mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
  }
}

// One block: its codes (as bytes: int8 values, or unsigned values that fit int8) and the
// scale (and zero) of each of its groups, in gguf_quants._decode's arithmetic.
inline void decode_block(int type, const uint8_t* b, uint8_t* c, float* s, float* z) {
  switch (type) {
    case Q4_0: {
      const float d = f16(b);
      nibbles32(b + 2, c);
      s[0] = d;
      z[0] = -8.0f * d;
      return;
    }
    case Q4_1:
      nibbles32(b + 4, c);
      s[0] = f16(b);
      z[0] = f16(b + 2);
      return;
    case Q8_0:
      std::memcpy(c, b + 2, 32);
      s[0] = f16(b);
      return;
    case Q5_0:
    case Q5_1: {
      const int base = type == Q5_0 ? 2 : 4;
      const uint32_t qh = uint32_t(b[base]) | uint32_t(b[base + 1]) << 8 | uint32_t(b[base + 2]) << 16 |
                          uint32_t(b[base + 3]) << 24;
      nibbles32(b + base + 4, c);
      for (int j = 0; j < 32; ++j) c[j] |= ((qh >> j) & 1) << 4;
      s[0] = f16(b);
      if (type == Q5_0) {
        for (int j = 0; j < 32; ++j) c[j] = uint8_t(int8_t(c[j] - 16));
      } else {
        z[0] = f16(b + 2);
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      const float d = f16(b), dmin = f16(b + 2);
      uint8_t sc[8], mn[8];
      k_scales(b + 4, sc, mn);
      for (int j = 0; j < 8; ++j) {
        s[j] = d * float(sc[j]);
        z[j] = -(dmin * float(mn[j]));
      }
      // 4 chunks of 64 weights: chunk ch's 32 bytes hold weights 64ch + l (low nibble) and
      // 64ch + 32 + l (high nibble); Q5_K's bit 2ch / 2ch + 1 of qh[l] is their fifth bit.
      const uint8_t* qs = b + (type == Q4_K ? 16 : 48);
      for (int ch = 0; ch < 4; ++ch)
        for (int l = 0; l < 32; ++l) {
          c[64 * ch + l] = qs[32 * ch + l] & 0xF;
          c[64 * ch + 32 + l] = qs[32 * ch + l] >> 4;
        }
      if (type == Q5_K) {
        const uint8_t* qh = b + 16;
        for (int ch = 0; ch < 4; ++ch)
          for (int l = 0; l < 32; ++l) {
            c[64 * ch + l] |= ((qh[l] >> (2 * ch)) & 1) << 4;
            c[64 * ch + 32 + l] |= ((qh[l] >> (2 * ch + 1)) & 1) << 4;
          }
      }
      return;
    }
    case Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int j = 0; j < 16; ++j) s[j] = d * float(sc[j]);
      // Two halves of 128 weights; quarter t of a half takes ql's low (t < 2) or high nibbles
      // of bytes 32 (t % 2) + l and bits 2t, 2t + 1 of qh[l].
      for (int p = 0; p < 2; ++p)
        for (int l = 0; l < 32; ++l) {
          const uint8_t a = ql[64 * p + l], bb = ql[64 * p + 32 + l], h = qh[32 * p + l];
          uint8_t* o = c + 128 * p + l;
          o[0] = uint8_t(int8_t(((a & 0xF) | (h & 3) << 4) - 32));
          o[32] = uint8_t(int8_t(((bb & 0xF) | ((h >> 2) & 3) << 4) - 32));
          o[64] = uint8_t(int8_t(((a >> 4) | ((h >> 4) & 3) << 4) - 32));
          o[96] = uint8_t(int8_t(((bb >> 4) | ((h >> 6) & 3) << 4) - 32));
        }
      return;
    }
    case Q2_K: {
      const uint8_t *sc = b, *qs = b + 16;
      const float d = f16(b + 80), dmin = f16(b + 82);
      for (int j = 0; j < 16; ++j) {
        s[j] = d * float(sc[j] & 0xF);
        z[j] = -(dmin * float(sc[j] >> 4));
      }
      for (int p = 0; p < 2; ++p)
        for (int sh = 0; sh < 4; ++sh)
          for (int l = 0; l < 32; ++l) c[128 * p + 32 * sh + l] = (qs[32 * p + l] >> (2 * sh)) & 3;
      return;
    }
    case Q3_K: {
      const uint8_t *hmask = b, *qs = b + 32, *packed = b + 96;
      const float d = f16(b + 108);
      for (int j = 0; j < 16; ++j) {
        const int low = (packed[j % 8] >> (4 * (j / 8))) & 0xF;
        const int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        s[j] = d * float((low | high << 4) - 32);
      }
      // Weight 32m + l (m = 4p + sh): two bits of qs[32p + l] at 2sh, minus 4 where bit m of
      // hmask[l] is clear.
      for (int p = 0; p < 2; ++p)
        for (int sh = 0; sh < 4; ++sh) {
          const int m = 4 * p + sh;
          for (int l = 0; l < 32; ++l) {
            const int lo = (qs[32 * p + l] >> (2 * sh)) & 3;
            const int hi = (hmask[l] >> m) & 1;
            c[32 * m + l] = uint8_t(int8_t(lo - ((hi ^ 1) << 2)));
          }
        }
      return;
    }
    case IQ4_XS: {
      const float d = f16(b);
      const uint32_t high = uint32_t(b[2]) | uint32_t(b[3]) << 8;
      for (int j = 0; j < 8; ++j) {
        const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 0xF;
        const int ls = (low | int((high >> (2 * j)) & 3) << 4) - 32;
        s[j] = d * float(ls);
        uint8_t idx[32];
        nibbles32(b + 8 + 16 * j, idx);
        for (int l = 0; l < 32; ++l) c[32 * j + l] = uint8_t(kIq4nlValues[idx[l]]);
      }
      return;
    }
    default:
      return;
  }
}

// The 4-bit formats straight into packed bytes (byte i = code 2i | code 2i + 1 << 4), with no
// byte-per-code step: their 2m bytes of nibbles hold codes 0..2m-1 in the low nibbles and
// 2m..4m-1 in the high ones, so the packed byte i < m pairs the low nibbles of bytes 2i and
// 2i + 1, and byte m + i their high nibbles.
inline void pack_nibble_halves(const uint8_t* qs, int nbytes, uint8_t* out) {
  const int m = nbytes / 2;
  for (int i = 0; i < m; ++i) {
    const uint32_t w = uint32_t(qs[2 * i]) | uint32_t(qs[2 * i + 1]) << 8;
    out[i] = uint8_t((w & 0xF) | ((w >> 4) & 0xF0));
    out[m + i] = uint8_t(((w >> 4) & 0xF) | ((w >> 8) & 0xF0));
  }
}

// The float16s of a block's scales and zeros, as the file has them: for the K-quants and IQ4_XS
// the bases of compact scales (d; -dmin is dmin with its sign flipped: scale = sbase * code, zero =
// zbase * code for small integer codes), for the one-group formats the scale d and zero m
// themselves (0 where the format has no offset; Q4_0's -8 d is not a float16 of the file).
inline bool block_halves(int type, const uint8_t* b, uint16_t* sbase, uint16_t* zbase) {
  switch (type) {
    case Q4_0:
    case Q5_0:
    case Q8_0: *sbase = half_bits(b); *zbase = 0; return true;
    case Q4_1:
    case Q5_1: *sbase = half_bits(b); *zbase = half_bits(b + 2); return true;
    case Q4_K:
    case Q5_K: *sbase = half_bits(b); *zbase = half_bits(b + 2) ^ 0x8000; return true;
    case Q6_K: *sbase = half_bits(b + 208); *zbase = 0; return true;
    case Q2_K: *sbase = half_bits(b + 80); *zbase = half_bits(b + 82) ^ 0x8000; return true;
    case Q3_K: *sbase = half_bits(b + 108); *zbase = 0; return true;
    case IQ4_XS: *sbase = half_bits(b); *zbase = 0; return true;
    default: return false;
  }
}

// The int8 code c with base * c == v bit for bit, if there is one.
inline bool compact_code(float v, float base, int8_t* code) {
  long c = 0;
  if (base != 0.f && std::isfinite(base)) c = std::lrint(double(v) / double(base));
  if (c < -128 || c > 127) return false;
  const float back = float(c) * base;
  *code = int8_t(c);
  return std::memcmp(&back, &v, 4) == 0;
}

// One block of Q4_0 / Q4_1 / Q4_K as packed bytes (block / 2 of them) and its groups' scales and
// zeros, the values decode_block gives; IQ4_XS's table indices likewise, with its scales.
inline void decode_block_int4(int type, const uint8_t* b, uint8_t* packed, float* s, float* z) {
  if (type == IQ4_XS) {
    const float d = f16(b);
    const uint32_t high = uint32_t(b[2]) | uint32_t(b[3]) << 8;
    for (int j = 0; j < 8; ++j) {
      const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 0xF;
      s[j] = d * float((low | int((high >> (2 * j)) & 3) << 4) - 32);
      pack_nibble_halves(b + 8 + 16 * j, 16, packed + 16 * j);
    }
    return;
  }
  if (type == Q4_K) {
    const float d = f16(b), dmin = f16(b + 2);
    uint8_t sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    for (int j = 0; j < 8; ++j) {
      s[j] = d * float(sc[j]);
      z[j] = -(dmin * float(mn[j]));
    }
    for (int ch = 0; ch < 4; ++ch) pack_nibble_halves(b + 16 + 32 * ch, 32, packed + 32 * ch);
    return;
  }
  const float d = f16(b);
  s[0] = d;
  if (type == Q4_0) {
    z[0] = -8.0f * d;
    pack_nibble_halves(b + 2, 16, packed);
  } else {
    z[0] = f16(b + 2);
    pack_nibble_halves(b + 4, 16, packed);
  }
}

struct Job {
  const int64_t* row_addrs;
  int64_t rows, row0, n_total, k;
  Format f;
  int type;
  bool int4, vnni, compact, half;
  int high_bits;  // 2: Q6_K's 4-bit + 2-bit planes; 1: the 5-bit formats' 4-bit + 1-bit planes; 0: neither
  uint8_t* q;
  float *scales, *zeros;
  std::atomic<bool>* not_compact;  // set when a scale or zero has no compact form
  bool simd;  // the AVX-512 path may run (repack_span_*_avx512)
};

// One file row (blocks at `src`) decoded into `out` (its row bytes: packed or int8 codes) and its
// groups' scales `s` and zeros `z` (K / g floats each; zeros 0 for a symmetric format).
inline void decode_row(const Job& j, const uint8_t* src, uint8_t* out, float* s, float* z, uint16_t* bases = nullptr) {
  const int64_t gpb = j.f.block / j.f.group, blocks = j.k / j.f.block;
  if (j.high_bits == 2) {  // (Q6_K: the codes, then their two planes)
    uint8_t c[256];
    for (int64_t i = 0; i < blocks; ++i) {
      decode_block(j.type, src + i * j.f.type_size, c, s + i * gpb, z + i * gpb);
      uint8_t* lo = out + i * 128;
      uint8_t* hi = out + j.k / 2 + i * 64;
      for (int t = 0; t < 128; ++t) {
        const int a = int8_t(c[2 * t]) + 32, b = int8_t(c[2 * t + 1]) + 32;
        lo[t] = uint8_t((a & 15) | (b & 15) << 4);
      }
      for (int t = 0; t < 16; ++t) {
        uint32_t w = 0;
        for (int m = 0; m < 8; ++m) {
          const uint32_t a = uint32_t(int8_t(c[16 * t + 2 * m]) + 32) >> 4;
          const uint32_t b = uint32_t(int8_t(c[16 * t + 2 * m + 1]) + 32) >> 4;
          w |= a << (2 * m) | b << (16 + 2 * m);
        }
        std::memcpy(hi + 4 * t, &w, 4);
      }
    }
  } else if (j.high_bits == 1) {  // (Q5_0 / Q5_1 / Q5_K: the codes, then their two planes)
    uint8_t c[256];
    const int64_t bs = j.f.block;
    for (int64_t i = 0; i < blocks; ++i) {
      decode_block(j.type, src + i * j.f.type_size, c, s + i * gpb, z + i * gpb);
      uint8_t* lo = out + i * (bs / 2);
      uint8_t* hi = out + j.k / 2 + i * (bs / 8);
      for (int64_t t = 0; t < bs / 2; ++t) lo[t] = uint8_t((c[2 * t] & 15) | (c[2 * t + 1] & 15) << 4);
      for (int64_t u = 0; u < bs / 32; ++u) {
        uint32_t w = 0;
        for (int m = 0; m < 32; ++m)  // (bit 4 of the byte: of Q5_0's int8 code, its sign)
          w |= uint32_t((c[32 * u + m] >> 4) & 1) << ((m & 1) * 16 + 4 * (m / 8) + (m % 8) / 2);
        std::memcpy(hi + 4 * u, &w, 4);
      }
    }
  } else if (j.int4) {
    for (int64_t i = 0; i < blocks; ++i)
      decode_block_int4(j.type, src + i * j.f.type_size, out + i * (j.f.block / 2), s + i * gpb, z + i * gpb);
  } else {
    for (int64_t i = 0; i < blocks; ++i)
      decode_block(j.type, src + i * j.f.type_size, out + i * j.f.block, s + i * gpb, z + i * gpb);
  }
  if (!j.f.has_zero) std::fill(z, z + j.k / j.f.group, 0.0f);
  if (bases)  // (compact or float16 scales) per block: its scale half, then its zero half
    for (int64_t i = 0; i < blocks; ++i) block_halves(j.type, src + i * j.f.type_size, bases + 2 * i, bases + 2 * i + 1);
}

// A span's scales and zeros (s_buf / z_buf [16][G], float16 bases [16][G / sub][2]) in compact
// layout at cs / cz (rows lane_lo .. lane_hi - 1 of the block), each value checked against its
// full form.
inline void write_compact(const Job& j, int64_t lane_lo, int64_t lane_hi, const float* s_buf, const float* z_buf,
                          const uint16_t* bases, uint8_t* cs, uint8_t* cz) {
  const int64_t G = j.k / j.f.group, sub = j.f.block / j.f.group, S = G / sub;
  for (int64_t lane = lane_lo; lane < lane_hi; ++lane) {
    for (int64_t g = 0; g < G; ++g) {
      const float sb = qmm::f16_to_f32(bases[(lane * S + g / sub) * 2]);
      const float zb = qmm::f16_to_f32(bases[(lane * S + g / sub) * 2 + 1]);
      int8_t c;
      if (!compact_code(s_buf[lane * G + g], sb, &c)) *j.not_compact = true;
      cs[g * 16 + lane] = uint8_t(c);
      if (cz) {
        if (!compact_code(z_buf[lane * G + g], zb, &c)) *j.not_compact = true;
        cz[g * 16 + lane] = uint8_t(c);
      }
    }
    for (int64_t t = 0; t < S; ++t) {
      std::memcpy(cs + 16 * G + (t * 16 + lane) * 2, &bases[(lane * S + t) * 2], 2);
      if (cz) std::memcpy(cz + 16 * G + (t * 16 + lane) * 2, &bases[(lane * S + t) * 2 + 1], 2);
    }
  }
}

// Packed 4-bit codes of a row (code i at bits 4i of a little-endian 4-byte unit) as a VNNI
// block's lane holds them: code 2p at bits 4p, code 2p + 1 at bits 16 + 4p (the even codes in
// the low half, the odd ones in the high half), so the kernel takes a pair with a shift and a mask.
inline uint32_t u4_row_to_lane(uint32_t v) {
  uint32_t out = 0;
  for (int p = 0; p < 4; ++p) out |= ((v >> (8 * p)) & 15u) << (4 * p) | ((v >> (8 * p + 4)) & 15u) << (16 + 4 * p);
  return out;
}

// 16 rows of `units` 4-byte units (row r at in + r * stride) -> `units` 64-byte lines, line c
// holding unit c of rows 0..15: how a VNNI block lays out a block's codes (units of 4 code bytes)
// and its scales and zeros (units of one float). 4 units of 4 rows at a time, transposed in
// registers, each line written whole with non-temporal stores: the weights are not read again
// during the load, so no read-for-ownership of lines about to be overwritten.
inline void transpose_block(const uint8_t* in, int64_t stride, int64_t units, uint8_t* out) {
  int64_t c = 0;
#if defined(__SSE2__)
  if (reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    for (; c + 4 <= units; c += 4)
      for (int r = 0; r < 16; r += 4) {
        const uint8_t* p = in + r * stride + c * 4;
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride));
        const __m128i cc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * stride));
        const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * stride));
        const __m128i ab_lo = _mm_unpacklo_epi32(a, b), ab_hi = _mm_unpackhi_epi32(a, b);
        const __m128i cd_lo = _mm_unpacklo_epi32(cc, d), cd_hi = _mm_unpackhi_epi32(cc, d);
        __m128i* o = reinterpret_cast<__m128i*>(out + c * 64 + r * 4);
        _mm_stream_si128(o, _mm_unpacklo_epi64(ab_lo, cd_lo));
        _mm_stream_si128(o + 4, _mm_unpackhi_epi64(ab_lo, cd_lo));
        _mm_stream_si128(o + 8, _mm_unpacklo_epi64(ab_hi, cd_hi));
        _mm_stream_si128(o + 12, _mm_unpackhi_epi64(ab_hi, cd_hi));
      }
  }
#endif
  for (; c < units; ++c)
    for (int r = 0; r < 16; ++r) std::memcpy(out + c * 64 + r * 4, in + r * stride + c * 4, 4);
}

// Rows [lo, hi) of one 16-row span (one VNNI block) of the whole weight. In rows, each row is
// decoded straight into its place. For a VNNI block, the span's rows are decoded into the
// thread's scratch (16 rows: at most a few hundred KB, cache-resident) and then written out line
// by line, each 64-byte line whole (about 10% faster than 4 bytes into every line per row).
// A span's float16 scales and zeros (the file's, in bases [16][G][2]) at cs / cz, each checked
// against its full form (cz null: Q4_0's zeros, formed by the kernel).
inline void write_half(const Job& j, int64_t lane_lo, int64_t lane_hi, const float* s_buf, const float* z_buf,
                       const uint16_t* bases, uint8_t* cs, uint8_t* cz) {
  const int64_t G = j.k / j.f.group;
  for (int64_t lane = lane_lo; lane < lane_hi; ++lane)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t sh = bases[(lane * G + g) * 2], zh = bases[(lane * G + g) * 2 + 1];
      const float s = qmm::f16_to_f32(sh), z = qmm::f16_to_f32(zh);
      if (std::memcmp(&s, &s_buf[lane * G + g], 4) != 0) *j.not_compact = true;
      std::memcpy(cs + (g * 16 + lane) * 2, &sh, 2);
      if (cz) {
        if (std::memcmp(&z, &z_buf[lane * G + g], 4) != 0) *j.not_compact = true;
        std::memcpy(cz + (g * 16 + lane) * 2, &zh, 2);
      }
    }
}

// The fast path of the formats K-quant files are made of, for a whole 16-row span in VNNI blocks
// with compact scales: Q4_K's 4-bit codes and Q5_K's and Q6_K's planes, decoded with AVX-512 (BW, VL) one
// super-block column at a time straight into their lanes' 4-byte units (a 16-row tile of 2 KB or
// less, in L1), then transposed in registers into whole 64-byte lines written with non-temporal
// stores. The same bytes as the scalar path above (tests/test_gguf_repack.py runs both).

// A compact code of a group with a regular base (float16 finite and non-zero) is the file's own
// small integer: base * code is then exact in float32 (11 bits times at most 8), so compact_code
// finds that code and its check passes. For any other base, compact_code on the value decode_block
// computes (what write_compact does).
inline bool regular_half(uint16_t h) { return (h & 0x7C00) != 0x7C00 && (h & 0x7FFF) != 0; }

inline int8_t compact_of(const Job& j, uint16_t base_bits, bool regular, int code, float value) {
  if (regular) return int8_t(code);
  int8_t c;
  if (!compact_code(value, qmm::f16_to_f32(base_bits), &c)) *j.not_compact = true;
  return c;
}

#if QMM_X86
// Units of `tile` (16 rows of 16 4-byte units, row r at tile + r * stride) -> 16 lines of 64 bytes
// at out (line c: unit c of rows 0..15), in registers.
QMM_AVX512 inline void transpose16_avx512(const uint8_t* tile, int64_t stride, uint8_t* out, bool stream) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(tile + i * stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4a + b]: in each 128-bit lane k, unit 4k + b of rows 4a .. 4a + 3
  for (int a = 0; a < 4; ++a) {
    r[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    r[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    r[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    r[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int b = 0; b < 4; ++b) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88), w0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xDD);
    const __m512i v1 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xDD);
    const __m512i line[4] = {_mm512_shuffle_i32x4(v0, v1, 0x88), _mm512_shuffle_i32x4(w0, w1, 0x88),
                             _mm512_shuffle_i32x4(v0, v1, 0xDD), _mm512_shuffle_i32x4(w0, w1, 0xDD)};
    for (int k = 0; k < 4; ++k) {
      __m512i* o = reinterpret_cast<__m512i*>(out + (4 * k + b) * 64);
      if (stream)
        _mm512_stream_si512(o, line[k]);
      else
        _mm512_storeu_si512(o, line[k]);
    }
  }
}

// 64 bytes of nibbles -> their 16 lane units (u4_row_to_lane of pack_nibble_halves): per 8 bytes
// b0..b7, the low nibbles' unit is (b0 | b2 << 4, b4 | b6 << 4, b1 | b3 << 4, b5 | b7 << 4) of
// those nibbles, the high nibbles' likewise. Before `order` (a qword permutation) the result holds,
// per 16 bytes of x, 2 units of its low nibbles then 2 of its high ones.
QMM_AVX512 inline __m512i nibble_units_avx512(__m512i x, __m512i order) {
  const __m512i pick = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 1, 5, 8, 12, 9, 13, 2, 6, 3, 7, 10, 14, 11, 15));
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i y = _mm512_shuffle_epi8(x, pick);  // per 16 bytes: the units' first nibbles, then their second
  const __m512i second = _mm512_bsrli_epi128(y, 8);
  const __m512i lo = _mm512_or_si512(_mm512_and_si512(y, low), _mm512_andnot_si512(low, _mm512_slli_epi16(second, 4)));
  const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(y, 4), low), _mm512_andnot_si512(low, second));
  return _mm512_permutexvar_epi64(order, _mm512_unpacklo_epi64(lo, hi));
}

inline uint32_t even_bits(uint32_t x) {  // bits 0, 2, .., 30 of x -> bits 0..15
  x &= 0x55555555u;
  x = (x | x >> 1) & 0x33333333u;
  x = (x | x >> 2) & 0x0F0F0F0Fu;
  x = (x | x >> 4) & 0x00FF00FFu;
  return (x | x >> 8) & 0x0000FFFFu;
}

// Q4_K, IQ4_XS (its indices as Q4_K's codes, its own scales), and Q5_K's planes: its low 4 bits as Q4_K's codes, then per 32 codes m the 1-bit plane's
// unit of their fifth bits (bit m of qh[l] for code 32m + l; the even codes' bits in the low 16
// bits of the unit, the odd codes' in the high 16), lines K / 8 + 8i .. + 7 for super-block i.
QMM_AVX512 inline void repack_span_q4k_avx512(const Job& j, int64_t span, uint8_t* tile) {
  const bool q5k = j.type == Q5_K, iq4 = j.type == IQ4_XS;
  const int64_t G = j.k / 32, S = j.k / 256, lines = q5k ? j.k / 8 + j.k / 32 : j.k / 8;
  const int type_size = q5k ? 176 : iq4 ? 136 : 144, qs_at = q5k ? 48 : iq4 ? 8 : 16;
  alignas(64) uint8_t fifth[8 * 64];  // Q5_K: a super-block column's 8 lines of the 1-bit plane
  uint8_t* qb = j.q + span * lines * 64;
  const int64_t cs_bytes = 16 * G + 32 * S;
  uint8_t* cs = reinterpret_cast<uint8_t*>(j.scales) + span * cs_bytes;
  uint8_t* cz = j.zeros ? reinterpret_cast<uint8_t*>(j.zeros) + span * cs_bytes : nullptr;  // (IQ4_XS: none)
  const bool stream = reinterpret_cast<uintptr_t>(qb) % 64 == 0;
  // chunk ch's low units are units 8ch .. 8ch + 3 of the row, its high ones 8ch + 4 .. 8ch + 7;
  // IQ4_XS's 16 bytes j hold indices 32j + l (low nibbles) and 32j + 16 + l (high): in order
  const __m512i order = iq4 ? _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7) : _mm512_setr_epi64(0, 2, 1, 3, 4, 6, 5, 7);
  const uint8_t* src[16];
  for (int lane = 0; lane < 16; ++lane)
    src[lane] = reinterpret_cast<const uint8_t*>(j.row_addrs[span * 16 + lane - j.row0]);
  for (int64_t i = 0; i < S; ++i) {
    for (int lane = 0; lane < 16; ++lane) {
      const uint8_t* b = src[lane] + i * type_size;
      for (int c = 0; c < type_size; c += 64)  // (two super-blocks ahead in each row)
        _mm_prefetch(reinterpret_cast<const char*>(b + 2 * type_size + c), _MM_HINT_T0);
      uint8_t* t = tile + lane * 128;
      _mm512_storeu_si512(t, nibble_units_avx512(_mm512_loadu_si512(b + qs_at), order));
      _mm512_storeu_si512(t + 64, nibble_units_avx512(_mm512_loadu_si512(b + qs_at + 64), order));
      if (q5k) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
        for (int m = 0; m < 8; ++m) {  // (bit m of each byte to its sign bit: movemask's bit l)
          const uint32_t bits = uint32_t(_mm256_movemask_epi8(_mm256_slli_epi16(qh, 7 - m)));
          const uint32_t w = even_bits(bits) | even_bits(bits >> 1) << 16;
          std::memcpy(fifth + m * 64 + lane * 4, &w, 4);
        }
      }
      const uint16_t dh = half_bits(b), mh = half_bits(b + 2) ^ 0x8000;
      const bool dreg = regular_half(dh), mreg = regular_half(mh);
      if (iq4) {  // (its 6-bit scales, minus 32; no zeros)
        const float d = qmm::f16_to_f32(dh);
        const uint32_t high = uint32_t(b[2]) | uint32_t(b[3]) << 8;
        for (int g = 0; g < 8; ++g) {
          const int ls = (((b[4 + g / 2] >> (4 * (g % 2))) & 0xF) | int((high >> (2 * g)) & 3) << 4) - 32;
          cs[(8 * i + g) * 16 + lane] = uint8_t(compact_of(j, dh, dreg, ls, d * float(ls)));
        }
        std::memcpy(cs + 16 * G + (i * 16 + lane) * 2, &dh, 2);
        continue;
      }
      uint8_t sc[8], mn[8];
      k_scales(b + 4, sc, mn);
      const float d = qmm::f16_to_f32(dh), dmin = f16(b + 2);
      for (int g = 0; g < 8; ++g) {
        cs[(8 * i + g) * 16 + lane] = uint8_t(compact_of(j, dh, dreg, sc[g], d * float(sc[g])));
        cz[(8 * i + g) * 16 + lane] = uint8_t(compact_of(j, mh, mreg, mn[g], -(dmin * float(mn[g]))));
      }
      std::memcpy(cs + 16 * G + (i * 16 + lane) * 2, &dh, 2);
      std::memcpy(cz + 16 * G + (i * 16 + lane) * 2, &mh, 2);
    }
    transpose16_avx512(tile, 128, qb + 32 * i * 64, stream);
    transpose16_avx512(tile + 64, 128, qb + (32 * i + 16) * 64, stream);
    if (q5k)
      for (int m = 0; m < 8; ++m) {
        __m512i* o = reinterpret_cast<__m512i*>(qb + (j.k / 8 + 8 * i + m) * 64);
        const __m512i line = _mm512_load_si512(fifth + m * 64);
        if (stream)
          _mm512_stream_si512(o, line);
        else
          _mm512_storeu_si512(o, line);
      }
  }
}

// Q6_K: the 4-bit plane's units (ql's nibbles: half p's bytes 64p + 32s + l hold codes 128p + 32s
// + l, low nibble, and 128p + 64 + 32s + l, high nibble) and the 2-bit plane's (per 16 codes, the
// even codes' high bits in the low 16 bits, 2 bits each, the odd codes' in the high 16).
QMM_AVX512 inline void repack_span_q6k_avx512(const Job& j, int64_t span, uint8_t* tile) {
  const int64_t G = j.k / 16, S = j.k / 256, lines = j.k * 3 / 16;
  uint8_t* qb = j.q + span * lines * 64;
  uint8_t* cs = reinterpret_cast<uint8_t*>(j.scales) + span * (16 * G + 32 * S);
  const bool stream = reinterpret_cast<uintptr_t>(qb) % 64 == 0;
  // a half's units: [low of s = 0, low of s = 1, high of s = 0, high of s = 1], 4 units each
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  // per 16 bytes: the even bytes' 2-bit values, then the odd bytes'; 4 of them to a byte
  const __m512i even_odd = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  const __m512i by4 = _mm512_set1_epi16(0x0401), by16 = _mm512_set1_epi32(0x00100001), three = _mm512_set1_epi8(3);
  uint8_t* tile_hi = tile + 16 * 128;
  const uint8_t* src[16];
  for (int lane = 0; lane < 16; ++lane)
    src[lane] = reinterpret_cast<const uint8_t*>(j.row_addrs[span * 16 + lane - j.row0]);
  for (int64_t i = 0; i < S; ++i) {
    for (int lane = 0; lane < 16; ++lane) {
      const uint8_t* b = src[lane] + i * 210;
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(b + 2 * 210 + 64 * c), _MM_HINT_T0);
      uint8_t* t = tile + lane * 128;
      _mm512_storeu_si512(t, nibble_units_avx512(_mm512_loadu_si512(b), order));
      _mm512_storeu_si512(t + 64, nibble_units_avx512(_mm512_loadu_si512(b + 64), order));
      // qh byte 32p + l: bits 2q, 2q + 1 are the high bits of code 128p + 32q + l; 16 codes
      // (16-byte lane 2p + h of quarter q's values) make unit 8p + 2q + h of the plane.
      const __m512i qh = _mm512_loadu_si512(b + 128);
      uint8_t* th = tile_hi + lane * 64;
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * q), three);
        const __m512i w = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_shuffle_epi8(v, even_odd), by4), by16);
        const __m128i u = _mm512_cvtepi32_epi8(w);  // units 2q, 2q + 1, 8 + 2q, 9 + 2q
        _mm_storel_epi64(reinterpret_cast<__m128i*>(th + 8 * q), u);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(th + 32 + 8 * q), _mm_unpackhi_epi64(u, u));
      }
      const uint16_t dh = half_bits(b + 208);
      const bool dreg = regular_half(dh);
      const float d = qmm::f16_to_f32(dh);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int g = 0; g < 16; ++g)
        cs[(16 * i + g) * 16 + lane] = uint8_t(compact_of(j, dh, dreg, sc[g], d * float(sc[g])));
      std::memcpy(cs + 16 * G + (i * 16 + lane) * 2, &dh, 2);
    }
    transpose16_avx512(tile, 128, qb + 32 * i * 64, stream);
    transpose16_avx512(tile + 64, 128, qb + (32 * i + 16) * 64, stream);
    transpose16_avx512(tile_hi, 64, qb + (j.k / 8 + 16 * i) * 64, stream);
  }
}

// Q5_0 / Q5_1 in VNNI blocks with float16 scales: a 32-code block's 16 bytes of nibbles make its 4
// units of the 4-bit plane (its low nibbles codes 0..15, its high ones 16..31), its qh (bit m: the
// fifth bit of code m) the 1-bit plane's unit, with the even codes' bits gathered into the low 16
// bits and the odd codes' into the high 16 (Q5_0's plane holds bit 4 of code - 16: the fifth bit
// inverted). The rows' lane units go to rows_buf, then out in whole lines.
QMM_AVX512 inline void repack_span_q5_avx512(const Job& j, int64_t span, uint8_t* rows_buf) {
  const int64_t B = j.k / 32, row_bytes = j.k / 2 + j.k / 8, lines = row_bytes / 4;
  const bool signed_codes = j.type == Q5_0;
  const int base = signed_codes ? 2 : 4;
  uint8_t* qb = j.q + span * lines * 64;
  uint8_t* cs = reinterpret_cast<uint8_t*>(j.scales) + span * 32 * B;  // (half_block_bytes)
  uint8_t* cz = j.zeros ? reinterpret_cast<uint8_t*>(j.zeros) + span * 32 * B : nullptr;
  const __m512i in_order = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  for (int lane = 0; lane < 16; ++lane) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(j.row_addrs[span * 16 + lane - j.row0]);
    uint8_t* row = rows_buf + lane * row_bytes;
    for (int64_t i = 0; i < B; ++i) {
      const uint8_t* b = src + i * j.f.type_size;
      // (nibble_units_avx512 on the block's 16 bytes: its first 128-bit lane is their 4 units)
      const __m512i nibbles = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + base + 4)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 16 * i),
                       _mm512_castsi512_si128(nibble_units_avx512(nibbles, in_order)));
      uint32_t qh;
      std::memcpy(&qh, b + base, 4);
      uint32_t w = even_bits(qh) | even_bits(qh >> 1) << 16;
      if (signed_codes) w = ~w;
      std::memcpy(row + j.k / 2 + 4 * i, &w, 4);
      std::memcpy(cs + (i * 16 + lane) * 2, b, 2);
      if (cz) std::memcpy(cz + (i * 16 + lane) * 2, b + 2, 2);
    }
  }
  const bool stream = reinterpret_cast<uintptr_t>(qb) % 64 == 0;
  int64_t c = 0;
  for (; c + 16 <= lines; c += 16) transpose16_avx512(rows_buf + 4 * c, row_bytes, qb + c * 64, stream);
  if (c < lines) transpose_block(rows_buf + 4 * c, row_bytes, lines - c, qb + c * 64);
}
#endif

// Whether the AVX-512 path takes this span (j.simd: the CPU has it and the caller did not ask for
// the scalar path): whole 16-row spans of Q4_K / IQ4_XS / Q5_K / Q6_K with compact scales, Q5_0 / Q5_1 planes
// with float16 scales (a Q5_0 weight without a zeros array, a Q5_1 one with it).
inline bool fast_span(const Job& j, int64_t lo, int64_t hi) {
  if (!j.simd || hi - lo != 16 || lo % 16) return false;
  if (j.compact)
    return ((j.int4 && j.type == Q4_K) || (j.high_bits == 1 && j.type == Q5_K)) && j.zeros ||
           (((j.int4 && j.type == IQ4_XS) || (j.high_bits == 2 && j.type == Q6_K)) && !j.zeros);
  if (j.half) return j.high_bits == 1 && ((j.type == Q5_0 && !j.zeros) || (j.type == Q5_1 && j.zeros));
  return false;
}

inline void repack_span(const Job& j, int64_t span, int64_t lo, int64_t hi, uint8_t* rows_buf, float* s_buf,
                        float* z_buf, uint16_t* bases) {
#if QMM_X86
  if (fast_span(j, lo, hi)) {
    alignas(64) uint8_t tile[16 * 128 + 16 * 64];
    if (j.type == Q4_K || j.type == Q5_K || j.type == IQ4_XS)
      repack_span_q4k_avx512(j, span, tile);
    else if (j.type == Q6_K)
      repack_span_q6k_avx512(j, span, tile);
    else
      repack_span_q5_avx512(j, span, rows_buf);
    return;
  }
#endif
  const int64_t G = j.k / j.f.group, row_bytes = j.high_bits ? j.k / 2 + j.k * j.high_bits / 8 : j.int4 ? j.k / 2 : j.k;
  const auto src = [&](int64_t row) { return reinterpret_cast<const uint8_t*>(j.row_addrs[row - j.row0]); };
  if (!j.vnni) {
    for (int64_t row = lo; row < hi; ++row) {
      float* z = j.zeros ? j.zeros + row * G : z_buf;
      decode_row(j, src(row), j.q + row * row_bytes, j.scales + row * G, z);
    }
    return;
  }
  const int64_t lane_lo = lo - span * 16, lane_hi = hi - span * 16, lines = row_bytes / 4;
  for (int64_t lane = lane_lo; lane < lane_hi; ++lane) {
    uint8_t* row = rows_buf + lane * row_bytes;
    decode_row(j, src(span * 16 + lane), row, s_buf + lane * G, z_buf + lane * G,
               j.compact || j.half ? bases + lane * (j.k / j.f.block) * 2 : nullptr);
    if (j.int4 || j.high_bits)  // each 4-byte unit's codes as the VNNI kernel takes them (qmatmul.cpp VnniCodes<U4>)
      for (int64_t u = 0; u < (j.high_bits ? j.k / 8 : lines); ++u) {
        uint32_t v;
        std::memcpy(&v, row + 4 * u, 4);
        v = u4_row_to_lane(v);
        std::memcpy(row + 4 * u, &v, 4);
      }
  }
  uint8_t* qb = j.q + span * lines * 64;
  float* sb = j.scales + span * G * 16;
  float* zb = j.zeros ? j.zeros + span * G * 16 : nullptr;
  if (j.compact || j.half) {
    // (qmatmul.cpp compact_block_bytes, half_block_bytes)
    const int64_t cs = j.compact ? 16 * G + 32 * (j.k / j.f.block) : 32 * G;
    uint8_t* cz = j.zeros ? reinterpret_cast<uint8_t*>(j.zeros) + span * cs : nullptr;
    if (j.compact)
      write_compact(j, lane_lo, lane_hi, s_buf, z_buf, bases, reinterpret_cast<uint8_t*>(j.scales) + span * cs, cz);
    else
      write_half(j, lane_lo, lane_hi, s_buf, z_buf, bases, reinterpret_cast<uint8_t*>(j.scales) + span * cs, cz);
    if (lane_lo == 0 && lane_hi == 16) {
      transpose_block(rows_buf, row_bytes, lines, qb);
    } else {
      for (int64_t c = 0; c < lines; ++c)
        for (int64_t lane = lane_lo; lane < lane_hi; ++lane)
          std::memcpy(qb + c * 64 + lane * 4, rows_buf + lane * row_bytes + c * 4, 4);
    }
    return;
  }
  if (lane_lo == 0 && lane_hi == 16) {
    transpose_block(rows_buf, row_bytes, lines, qb);
    transpose_block(reinterpret_cast<const uint8_t*>(s_buf), G * 4, G, reinterpret_cast<uint8_t*>(sb));
    if (zb) transpose_block(reinterpret_cast<const uint8_t*>(z_buf), G * 4, G, reinterpret_cast<uint8_t*>(zb));
    return;
  }
  for (int64_t c = 0; c < lines; ++c)
    for (int64_t lane = lane_lo; lane < lane_hi; ++lane)
      std::memcpy(qb + c * 64 + lane * 4, rows_buf + lane * row_bytes + c * 4, 4);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t lane = lane_lo; lane < lane_hi; ++lane) {
      sb[g * 16 + lane] = s_buf[lane * G + g];
      if (zb) zb[g * 16 + lane] = z_buf[lane * G + g];
    }
}

inline void run(const Job& j, int num_threads) {
  // Work in 16-row spans of the whole weight (a VNNI block each), so threads never share one,
  // handed out 4 at a time from a shared counter. Plain threads that end with the call rather
  // than an OpenMP team: libgomp's workers spin for milliseconds after each region and at its
  // closing barrier, and over a model's ~150 calls, while the other thread is stalled in page
  // faults, that spinning took ~2 s of CPU from a 2-core machine (measured with
  // OMP_WAIT_POLICY=passive: user time 4.6 -> 2.3 s on the 8B load).
  const int64_t first = j.row0 / 16, last = (j.row0 + j.rows + 15) / 16;
  const int64_t spans = last - first, chunk = 4;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, (spans + chunk - 1) / chunk)));
  const int64_t G = j.k / j.f.group, row_bytes = j.high_bits ? j.k / 2 + j.k * j.high_bits / 8 : j.int4 ? j.k / 2 : j.k;
  std::atomic<int64_t> next{first};
  const auto work = [&]() {
    std::vector<uint8_t> rows_buf(size_t(j.vnni ? 16 * row_bytes : 0));
    std::vector<float> s_buf(size_t(16 * G)), z_buf(size_t(16 * G));
    std::vector<uint16_t> bases(size_t(j.compact || j.half ? 16 * (j.k / j.f.block) * 2 : 0));
    for (int64_t at = next.fetch_add(chunk); at < last; at = next.fetch_add(chunk))
      for (int64_t span = at; span < std::min(at + chunk, last); ++span)
        repack_span(j, span, std::max(span * 16, j.row0), std::min(span * 16 + 16, j.row0 + j.rows),
                    rows_buf.data(), s_buf.data(), z_buf.data(), bases.data());
#if defined(__SSE2__)
    _mm_sfence();  // (the non-temporal stores visible before the weights are used)
#endif
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < nt; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // (no more threads to be had: the ones running share the rest)
    }
  }
  work();
  for (auto& h : helpers) h.join();
}

}  // namespace gguf_repack

// Rows [row0, row0 + rows) of a weight [n_total, k] in a group kernel's layout, from GGUF blocks of
// ggml type `type` (row r's at row_addrs[r]); see the top of this file. Returns 0, or 1 with a
// message in err for arguments the layout cannot take.
extern "C" int kvs_gguf_repack(const int64_t* row_addrs, int64_t rows, int64_t row0, int type, int64_t n_total,
                               int64_t k, int int4, int vnni, void* q, float* scales, float* zeros, int num_threads,
                               int impl, char* err, int64_t err_len) {
  using namespace gguf_repack;
  Format f;
  const auto fail = [&](const char* msg) {
    std::snprintf(err, size_t(err_len), "%s", msg);
    return 1;
  };
  if (!format_of(type, &f)) return fail("not a GGUF type kvs_gguf_repack decodes");
  if (k <= 0 || k % f.block) return fail("K must be a positive multiple of the format's block size");
  if (rows < 0 || row0 < 0 || row0 + rows > n_total) return fail("rows out of the weight's range");
  if (int4 == 2 && (type != Q6_K || !vnni)) return fail("6-bit planes are for Q6_K in VNNI blocks only");
  if (int4 == 3 && (!(type == Q5_0 || type == Q5_1 || type == Q5_K) || !vnni))
    return fail("5-bit planes are for Q5_0, Q5_1 and Q5_K in VNNI blocks only");
  if (int4 < 0 || int4 > 3) return fail("int4 must be 0 (int8 codes), 1 (4-bit), 2 (6-bit planes) or 3 (5-bit planes)");
  if (int4 == 1 && !f.int4_ok) return fail("only Q4_0, Q4_1 and Q4_K codes (and IQ4_XS's table indices) pack two per byte");
  if (f.has_zero && !zeros && !(vnni == 3 && type == Q4_0))
    return fail("this format has offsets: zeros must be given");
  if (vnni < 0 || vnni > 3)
    return fail("vnni must be 0 (rows), 1 (VNNI blocks), 2 (compact scales) or 3 (float16 scales)");
  if (vnni && (n_total % 16 || (int4 ? k / 2 : k) % 4))
    return fail("VNNI blocks need N % 16 == 0 and row bytes % 4 == 0");
  if (vnni == 2 && !(type == Q4_K || type == Q5_K || type == Q6_K || type == Q2_K || type == Q3_K || type == IQ4_XS))
    return fail("compact scales are for the K-quants and IQ4_XS only");
  if (vnni == 3 && !(type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0))
    return fail("float16 scales are for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 only");
  if (impl < 0 || impl > 1) return fail("impl must be 0 (the fastest path this CPU has) or 1 (scalar)");
  if (rows == 0) return 0;
  std::atomic<bool> not_compact{false};
  Job j{row_addrs, rows, row0, n_total, k, f, type, int4 == 1, vnni != 0, vnni == 2, vnni == 3,
        int4 == 2 ? 2 : int4 == 3 ? 1 : 0, static_cast<uint8_t*>(q), scales, zeros, &not_compact, false};
#if QMM_X86
  j.simd = impl != 1 && qmm::cpu_has_avx512();
#endif
  run(j, num_threads);
  if (not_compact) return fail("a scale or zero has no compact or float16 form");
  return 0;
}
