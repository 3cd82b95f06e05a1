#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVS_X86 1
#include <immintrin.h>
#define KVS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
// Small helpers must inline: a prefetch left in its own function is "pure" to GCC's IPA and its
// calls get deleted, and an opaque call in a loop pins the accumulators to memory.
#define KVS_INLINE inline __attribute__((always_inline))
// Fixed-trip loops over heads and chunks, unrolled early so accumulator arrays become registers.
#define KVS_UNROLL _Pragma("GCC unroll 16")
// avx512_bf16 intrinsics: GCC >= 11, clang >= 12.
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define KVS_BF16DP 1
#define KVS_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))
#else
#define KVS_BF16DP 0
#endif
#else
#define KVS_X86 0
#define KVS_BF16DP 0
#endif

namespace kvs {

constexpr int kTile = 64;  // tokens per online-softmax step (a multiple of 16)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// bfloat16 tensors are handled as raw uint16_t bit patterns.
static inline float to_f32(float x) { return x; }
static inline float to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// float16 and float8 e4m3fn caches, as raw bits; int8 caches are plain int8_t. int8 and fp8
// caches come with one float scale per (kv head, slot): the stored value times its scale.
struct f16_t { uint16_t bits; };
struct fp8_t { uint8_t bits; };
static inline float to_f32(int8_t x) { return float(x); }
static inline float to_f32(f16_t h) {
  const int e = (h.bits >> 10) & 0x1f, m = h.bits & 0x3ff;
  const float f = e == 0    ? std::ldexp(float(m), -24)
                  : e == 31 ? (m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity())
                            : std::ldexp(float(m | 0x400), e - 25);
  return (h.bits & 0x8000) ? -f : f;
}
static inline float to_f32(fp8_t b) {  // e4m3fn: bias 7, no infinities, S.1111.111 is NaN
  const int e = (b.bits >> 3) & 0xf, m = b.bits & 7;
  const float f = e == 0                ? std::ldexp(float(m), -9)
                  : (e == 15 && m == 7) ? std::numeric_limits<float>::quiet_NaN()
                                        : std::ldexp(float(m | 8), e - 10);
  return (b.bits & 0x80) ? -f : f;
}

struct Problem {
  int64_t n, H, KVH, G, D, bs;
  float scale;
  const void* q;
  int64_t q_s0, q_s1;
  bool q_bf16;
  const void* k;
  const void* v;
  int64_t k_s0, k_s1, v_s0, v_s1;
  const float* ks;  // K scales [KVH, slots] (ks_s0 per head, unit stride over slots); null: none
  const float* vs;
  int64_t ks_s0, vs_s0;
  const int64_t* tables;
  int64_t tbl_s0;
  const int64_t* ctx;
  // Optional per-row visible range (bounded-KV policies): a row sees positions [0, sink_end)
  // and [win_start, ctx); null, or win_start <= sink_end: all of [0, ctx).
  const int64_t* sink_end;
  const int64_t* win_start;
  void* out;
  int64_t o_s0, o_s1;
};

// Per-thread buffers, reused across tasks. Dp: head_dim padded for the vector code.
struct Scratch {
  int64_t Dp;
  std::vector<float> qf, acc, s, m, l;
  std::vector<uint16_t> qb, pb;  // bf16 q bits; bf16 probabilities (hi and lo halves)
  std::vector<int64_t> slots;    // this tile and the next
  Scratch(int64_t G, int64_t Dp_)
      : Dp(Dp_), qf(G * Dp_), acc(G * Dp_), s(G * kTile), m(G), l(G), qb(G * Dp_), pb(G * 2 * kTile),
        slots(2 * kTile) {}
};

// Quantized caches: the tile's scores (before the softmax) times K's per-slot scale, or its
// probabilities (after it, so the normalizer is untouched) times V's, folding dequantization
// into one multiply per (token, head) instead of one per element.
static inline void apply_slot_scales(const float* sc, const int64_t* slots, int tn, int64_t G, float* s) {
  if (sc == nullptr) return;
  for (int j = 0; j < tn; ++j) {
    const float c = sc[slots[j]];
    for (int64_t g = 0; g < G; ++g) s[g * kTile + j] *= c;
  }
}

// fp32 copy of the task's G query heads, times scale, zero padded to Dp, into qf; resets the
// softmax state (acc, m, l).
static void load_q_into(const Problem& P, int64_t row, int64_t h, int64_t Dp, float* qf, float* acc, float* m,
                        float* l) {
  std::fill(qf, qf + P.G * Dp, 0.f);
  for (int64_t g = 0; g < P.G; ++g) {
    const int64_t off = row * P.q_s0 + (h * P.G + g) * P.q_s1;
    float* dst = qf + g * Dp;
    if (P.q_bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(P.q) + off;
      for (int64_t d = 0; d < P.D; ++d) dst[d] = to_f32(src[d]) * P.scale;
    } else {
      const float* src = static_cast<const float*>(P.q) + off;
      for (int64_t d = 0; d < P.D; ++d) dst[d] = src[d] * P.scale;
    }
  }
  std::fill(acc, acc + P.G * Dp, 0.f);
  std::fill(m, m + P.G, kNegInf);
  std::fill(l, l + P.G, 0.f);
}

static void load_q(const Problem& P, int64_t row, int64_t h, Scratch& S) {
  load_q_into(P, row, h, S.Dp, S.qf.data(), S.acc.data(), S.m.data(), S.l.data());
}

static void store_out_from(const Problem& P, int64_t row, int64_t h, int64_t Dp, const float* acc, const float* ls) {
  for (int64_t g = 0; g < P.G; ++g) {
    const float l = ls[g];
    const float inv = l > 0.f ? 1.f / l : 0.f;  // empty context: zeros
    const float* a = acc + g * Dp;
    const int64_t off = row * P.o_s0 + (h * P.G + g) * P.o_s1;
    if (P.q_bf16) {
      uint16_t* dst = static_cast<uint16_t*>(P.out) + off;
      for (int64_t d = 0; d < P.D; ++d) dst[d] = to_bf16(a[d] * inv);
    } else {
      float* dst = static_cast<float*>(P.out) + off;
      for (int64_t d = 0; d < P.D; ++d) dst[d] = a[d] * inv;
    }
  }
}

static void store_out(const Problem& P, int64_t row, int64_t h, const Scratch& S) {
  store_out_from(P, row, h, S.Dp, S.acc.data(), S.l.data());
}

// Where a row's walk over its visible positions stands: table entry blk, offset off, text
// position pos; at position skip_at it jumps to skip_to (from the sinks to the window).
struct Cursor {
  int64_t blk = 0, off = 0, pos = 0, skip_at = -1, skip_to = -1;
};

static inline int64_t clamp_pos(int64_t x, int64_t ctx) { return std::max<int64_t>(0, std::min(x, ctx)); }

// The number of positions the row sees, with the cursor at the first of them.
static int64_t start_walk(const Problem& P, int64_t row, Cursor& c) {
  const int64_t ctx = P.ctx[row];
  const int64_t s = P.sink_end ? clamp_pos(P.sink_end[row], ctx) : 0;
  const int64_t w = P.win_start ? clamp_pos(P.win_start[row], ctx) : 0;
  c = Cursor();
  if (w <= s) return ctx;
  if (s == 0) {
    c.pos = w; c.blk = w / P.bs; c.off = w % P.bs;
    return ctx - w;
  }
  c.skip_at = s; c.skip_to = w;
  return s + ctx - w;
}

// Slots of the next tn visible tokens, walking the row's table from the cursor. Slots past tn,
// up to a multiple of 16, repeat the last one: vector code may read them, never another block.
// A table entry is read only for a position the row sees.
static int fill_tile(const int64_t* table, int64_t bs, int64_t remaining, Cursor& c, int64_t* slots) {
  if (remaining <= 0) return 0;
  const int tn = int(std::min<int64_t>(kTile, remaining));
  int64_t base = table[c.blk] * bs;
  for (int j = 0; j < tn; ++j) {
    slots[j] = base + c.off;
    if (++c.pos == c.skip_at) {
      c.pos = c.skip_to; c.blk = c.skip_to / bs; c.off = c.skip_to % bs;
      if (j + 1 < tn) base = table[c.blk] * bs;
    } else if (++c.off == bs) {
      c.off = 0;
      ++c.blk;
      if (j + 1 < tn) base = table[c.blk] * bs;
    }
  }
  for (int j = tn; j < ((tn + 15) & ~15); ++j) slots[j] = slots[tn - 1];
  return tn;
}

// ------------------------------------------------------------------------------------------
// Portable scalar path (any CPU, any head_dim).
template <typename KT>
static void task_scalar(const Problem& P, int64_t row, int64_t h, Scratch& S) {
  Cursor walk;
  const int64_t ctx = start_walk(P, row, walk);  // positions this row sees
  const int64_t G = P.G, D = P.D, Dp = S.Dp;
  load_q(P, row, h, S);
  const int64_t* table = P.tables + row * P.tbl_s0;
  const KT* kb = static_cast<const KT*>(P.k) + h * P.k_s0;
  const KT* vb = static_cast<const KT*>(P.v) + h * P.v_s0;
  const float* ksh = P.ks ? P.ks + h * P.ks_s0 : nullptr;
  const float* vsh = P.vs ? P.vs + h * P.vs_s0 : nullptr;
  float* s = S.s.data();
  for (int64_t t0 = 0; t0 < ctx; t0 += kTile) {
    const int tn = fill_tile(table, P.bs, ctx - t0, walk, S.slots.data());
    for (int j = 0; j < tn; ++j) {
      const KT* kp = kb + S.slots[j] * P.k_s1;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = S.qf.data() + g * Dp;
        float a = 0.f;
        for (int64_t d = 0; d < D; ++d) a += qg[d] * to_f32(kp[d]);
        s[g * kTile + j] = a;
      }
    }
    apply_slot_scales(ksh, S.slots.data(), tn, G, s);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * kTile;
      float mt = kNegInf;
      for (int j = 0; j < tn; ++j) mt = std::max(mt, sg[j]);
      const float mnew = std::max(S.m[g], mt);
      if (mnew > S.m[g]) {
        const float alpha = std::exp(S.m[g] - mnew);
        S.l[g] *= alpha;
        float* a = S.acc.data() + g * Dp;
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        S.m[g] = mnew;
      }
      float sum = 0.f;
      for (int j = 0; j < tn; ++j) {
        sg[j] = std::exp(sg[j] - mnew);
        sum += sg[j];
      }
      S.l[g] += sum;
    }
    apply_slot_scales(vsh, S.slots.data(), tn, G, s);
    for (int j = 0; j < tn; ++j) {
      const KT* vp = vb + S.slots[j] * P.v_s1;
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * kTile + j];
        float* a = S.acc.data() + g * Dp;
        for (int64_t d = 0; d < D; ++d) a[d] += p * to_f32(vp[d]);
      }
    }
  }
  store_out(P, row, h, S);
}

// ------------------------------------------------------------------------------------------
// AVX-512 path, head_dim <= 128: head_dim in NC chunks of 16 lanes (masked past head_dim), up
// to GB query heads of the group per pass over the tile. Rows are prefetched into L2 one pass
// ahead: V rows of the tile while its scores are computed, K rows of the next tile while V is
// accumulated (blocks are scattered, so the hardware prefetcher alone stalls at every block).
#if KVS_X86
KVS_AVX512 static KVS_INLINE __m512 ld16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
KVS_AVX512 static KVS_INLINE __m512 ld16(const uint16_t* p, __mmask16 m) {
  __m256i x = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
KVS_AVX512 static KVS_INLINE __m512 ld16(const f16_t* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
KVS_AVX512 static KVS_INLINE __m512 ld16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
// e4m3's exponent and mantissa bits land in float16's fields (4 of its 5 exponent bits, the top
// 3 mantissa bits), which reads as the value times 2^-8, subnormals included: widen as float16,
// then undo the bias difference.
KVS_AVX512 static KVS_INLINE __m512 ld16(const fp8_t* p, __mmask16 m) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(mag, sign)), _mm512_set1_ps(256.f));
}

template <typename KT>
KVS_AVX512 static KVS_INLINE void prefetch_row(const KT* p, int64_t row_bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

// Where a loop prefetches: rows slots[0 .. n-1] at base + slot * stride.
template <typename KT>
struct Prefetch {
  const KT* base;
  int64_t stride;
  const int64_t* slots;
  int n;
  int64_t row_bytes;
  KVS_AVX512 KVS_INLINE void operator()(int j) const {
    if (j < n) prefetch_row(base + slots[j] * stride, row_bytes);
  }
};

// exp(x), Cephes-style polynomial (~1 ulp); underflows cleanly to 0 for very negative x.
KVS_AVX512 static KVS_INLINE __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

static inline __mmask16 mask16(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : remaining <= 0 ? __mmask16(0) : __mmask16((1u << remaining) - 1);
}

// a0..a3 -> one vector whose 128-bit lane k holds [a0, a1, a2, a3] each summed over its lane k.
KVS_AVX512 static KVS_INLINE __m512 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d x = _mm512_castps_pd(t01), y = _mm512_castps_pd(t23);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// Four reduce4 results (tokens 0-3, 4-7, 8-11, 12-15) -> the 16 horizontal sums, in token order.
KVS_AVX512 static KVS_INLINE __m512 reduce16(__m512 u0, __m512 u1, __m512 u2, __m512 u3) {
  const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u2, u3, 0x88), _mm512_shuffle_f32x4(u2, u3, 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v, w, 0x88), _mm512_shuffle_f32x4(v, w, 0xDD));
}

// Scores s[g][j] = q_g . k_j for GB heads and tokens j < tn, 16 tokens at a time (q pre-scaled).
template <typename KT, int NC, int GB>
KVS_AVX512 static void qk_f32(const float* qf, int64_t Dp, const KT* kb, int64_t ks1, const int64_t* slots,
                              int tn, const __mmask16* mk, float* s, Prefetch<KT> pf) {
  for (int j0 = 0; j0 < tn; j0 += 16) {
    __m512 u[GB][4];
    KVS_UNROLL
    for (int qd = 0; qd < 4; ++qd) {
      __m512 a[GB][4];
      KVS_UNROLL
      for (int t = 0; t < 4; ++t) {
        const int j = j0 + 4 * qd + t;
        pf(j);
        const KT* kp = kb + slots[j] * ks1;
        __m512 kv[NC];
        KVS_UNROLL
        for (int c = 0; c < NC; ++c) kv[c] = ld16(kp + 16 * c, mk[c]);
        KVS_UNROLL
        for (int g = 0; g < GB; ++g) {
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qf + g * Dp), kv[0]);
          KVS_UNROLL
          for (int c = 1; c < NC; ++c) x = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * Dp + 16 * c), kv[c], x);
          a[g][t] = x;
        }
      }
      KVS_UNROLL
      for (int g = 0; g < GB; ++g) u[g][qd] = reduce4(a[g][0], a[g][1], a[g][2], a[g][3]);
    }
    KVS_UNROLL
    for (int g = 0; g < GB; ++g) _mm512_storeu_ps(s + g * kTile + j0, reduce16(u[g][0], u[g][1], u[g][2], u[g][3]));
  }
}

// acc[g] += sum_j p[g][j] v_j for GB heads, tokens j < tn.
template <typename KT, int NC, int GB>
KVS_AVX512 static void pv_f32(float* acc, int64_t Dp, const KT* vb, int64_t vs1, const int64_t* slots, int tn,
                              const __mmask16* mk, const float* s, Prefetch<KT> pf) {
  __m512 ar[GB][NC];
  KVS_UNROLL
  for (int g = 0; g < GB; ++g)
    KVS_UNROLL
    for (int c = 0; c < NC; ++c) ar[g][c] = _mm512_loadu_ps(acc + g * Dp + 16 * c);
  for (int j = 0; j < tn; ++j) {
    pf(j);
    const KT* vp = vb + slots[j] * vs1;
    __m512 vv[NC];
    KVS_UNROLL
    for (int c = 0; c < NC; ++c) vv[c] = ld16(vp + 16 * c, mk[c]);
    KVS_UNROLL
    for (int g = 0; g < GB; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * kTile + j]);
      KVS_UNROLL
      for (int c = 0; c < NC; ++c) ar[g][c] = _mm512_fmadd_ps(p, vv[c], ar[g][c]);
    }
  }
  KVS_UNROLL
  for (int g = 0; g < GB; ++g)
    KVS_UNROLL
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * Dp + 16 * c, ar[g][c]);
}

// Online softmax over one tile of one head's scores: updates (m, l), rescales acc (Dp floats,
// any layout), and leaves exp(s - m) in s[0 .. tn-1] and zeros in s[tn .. kTile-1].
KVS_AVX512 static void softmax_tile(float* sg, int tn, float& m, float& l, float* acc, int64_t Dp) {
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 vmax = ninf;
  for (int j = 0; j < tn; j += 16)
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, mask16(tn - j), sg + j));
  const float mnew = std::max(m, _mm512_reduce_max_ps(vmax));
  if (mnew > m) {
    const float alpha = std::exp(m - mnew);
    const __m512 va = _mm512_set1_ps(alpha);
    l *= alpha;
    for (int64_t d = 0; d < Dp; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(va, _mm512_loadu_ps(acc + d)));
    m = mnew;
  }
  const __m512 vm = _mm512_set1_ps(mnew);
  __m512 vsum = _mm512_setzero_ps();
  for (int j = 0; j < kTile; j += 16) {
    const __mmask16 mk = mask16(tn - j);
    const __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), vm)));
    _mm512_storeu_ps(sg + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  l += _mm512_reduce_add_ps(vsum);
}

#if KVS_BF16DP
// bf16 cache and bf16 q on CPUs with avx512_bf16: vdpbf16ps multiplies bf16 pairs exactly and
// accumulates in fp32, so K/V need no widening. Scores use the unscaled bf16 q (scaled after);
// probabilities are split into bf16 hi + lo parts (~16 significant bits) for the V sum.
KVS_AVX512BF16 static KVS_INLINE __m512bh as_bh(__m512i x) { return (__m512bh)x; }

template <int NC2, int GB>
KVS_AVX512BF16 static void qk_bf16(const uint16_t* qb, int64_t Dp, const uint16_t* kb, int64_t ks1,
                                   const int64_t* slots, int tn, const __mmask32* mk, float* s, float scale,
                                   Prefetch<uint16_t> pf) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int j0 = 0; j0 < tn; j0 += 16) {
    __m512 u[GB][4];
    KVS_UNROLL
    for (int qd = 0; qd < 4; ++qd) {
      __m512 a[GB][4];
      KVS_UNROLL
      for (int t = 0; t < 4; ++t) {
        const int j = j0 + 4 * qd + t;
        pf(j);
        const uint16_t* kp = kb + slots[j] * ks1;
        __m512i kv[NC2];
        KVS_UNROLL
        for (int c = 0; c < NC2; ++c) kv[c] = _mm512_maskz_loadu_epi16(mk[c], kp + 32 * c);
        KVS_UNROLL
        for (int g = 0; g < GB; ++g) {
          __m512 x = _mm512_setzero_ps();
          KVS_UNROLL
          for (int c = 0; c < NC2; ++c)
            x = _mm512_dpbf16_ps(x, as_bh(_mm512_loadu_si512(qb + g * Dp + 32 * c)), as_bh(kv[c]));
          a[g][t] = x;
        }
      }
      KVS_UNROLL
      for (int g = 0; g < GB; ++g) u[g][qd] = reduce4(a[g][0], a[g][1], a[g][2], a[g][3]);
    }
    KVS_UNROLL
    for (int g = 0; g < GB; ++g)
      _mm512_storeu_ps(s + g * kTile + j0, _mm512_mul_ps(vscale, reduce16(u[g][0], u[g][1], u[g][2], u[g][3])));
  }
}

// Probabilities s[0 .. kTile-1] (fp32, zero past tn) -> bf16 hi and lo parts, hi + lo ~= s.
KVS_AVX512BF16 static void split_probs(const float* sg, uint16_t* hi, uint16_t* lo) {
  for (int j = 0; j < kTile; j += 16) {
    const __m512 x = _mm512_loadu_ps(sg + j);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, hf));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + j), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + j), l);
  }
}

// acc[g] += sum_j p[g][j] v_j over token pairs (j, j+1): the two V rows are interleaved so each
// 32-bit lane holds (v_j[d], v_j+1[d]) and one vdpbf16ps adds p_j v_j[d] + p_j+1 v_j+1[d].
// Interleaving permutes head_dim inside 128-bit lanes: acc is kept in that order (see unpermute).
template <int NC2, int GB>
KVS_AVX512BF16 static void pv_bf16(float* acc, int64_t Dp, const uint16_t* vb, int64_t vs1, const int64_t* slots,
                                   int tn, const __mmask32* mk, const uint16_t* pb, Prefetch<uint16_t> pf) {
  __m512 ar[GB][NC2][2];
  KVS_UNROLL
  for (int g = 0; g < GB; ++g)
    KVS_UNROLL
    for (int c = 0; c < NC2; ++c)
      KVS_UNROLL
      for (int e = 0; e < 2; ++e) ar[g][c][e] = _mm512_loadu_ps(acc + g * Dp + 32 * c + 16 * e);
  for (int j = 0; j < tn; j += 2) {
    pf(j);
    pf(j + 1);
    const uint16_t* v0 = vb + slots[j] * vs1;
    const uint16_t* v1 = vb + slots[j + 1] * vs1;  // padded slot when j + 1 == tn: its p is 0
    __m512i lo[NC2], hi[NC2];
    KVS_UNROLL
    for (int c = 0; c < NC2; ++c) {
      const __m512i a = _mm512_maskz_loadu_epi16(mk[c], v0 + 32 * c);
      const __m512i b = _mm512_maskz_loadu_epi16(mk[c], v1 + 32 * c);
      lo[c] = _mm512_unpacklo_epi16(a, b);
      hi[c] = _mm512_unpackhi_epi16(a, b);
    }
    KVS_UNROLL
    for (int g = 0; g < GB; ++g) {
      int32_t wh, wl;
      std::memcpy(&wh, pb + g * 2 * kTile + j, 4);
      std::memcpy(&wl, pb + g * 2 * kTile + kTile + j, 4);
      const __m512bh ph = as_bh(_mm512_set1_epi32(wh)), pl = as_bh(_mm512_set1_epi32(wl));
      KVS_UNROLL
      for (int c = 0; c < NC2; ++c) {
        ar[g][c][0] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(ar[g][c][0], as_bh(lo[c]), ph), as_bh(lo[c]), pl);
        ar[g][c][1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(ar[g][c][1], as_bh(hi[c]), ph), as_bh(hi[c]), pl);
      }
    }
  }
  KVS_UNROLL
  for (int g = 0; g < GB; ++g)
    KVS_UNROLL
    for (int c = 0; c < NC2; ++c)
      KVS_UNROLL
      for (int e = 0; e < 2; ++e) _mm512_storeu_ps(acc + g * Dp + 32 * c + 16 * e, ar[g][c][e]);
}

// pv_bf16's layout -> head_dim order: chunk c, half e, 128-bit lane k, element i holds
// d = 32c + 8k + 4e + i.
static void unpermute(float* acc, int64_t G, int64_t Dp) {
  float tmp[32];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < Dp; c += 32) {
      float* a = acc + g * Dp + c;
      KVS_UNROLL
      for (int e = 0; e < 2; ++e)
        for (int k = 0; k < 4; ++k)
          for (int i = 0; i < 4; ++i) tmp[8 * k + 4 * e + i] = a[16 * e + 4 * k + i];
      std::memcpy(a, tmp, sizeof(tmp));
    }
}
#endif  // KVS_BF16DP

// One (row, kv head) task. BF16DP: the vdpbf16ps variant (bf16 cache and q only).
template <typename KT, int NC, bool BF16DP>
static void task_avx512(const Problem& P, int64_t row, int64_t h, Scratch& S) {
  constexpr int NC2 = (NC + 1) / 2;
  constexpr int GB = NC <= 4 ? 4 : 2;
  Cursor walk;
  const int64_t ctx = start_walk(P, row, walk);  // positions this row sees
  const int64_t G = P.G, Dp = S.Dp;
  load_q(P, row, h, S);
  __mmask16 mk[NC];
  KVS_UNROLL
  for (int c = 0; c < NC; ++c) mk[c] = mask16(P.D - 16 * c);
  __mmask32 mk2[NC2];
  KVS_UNROLL
  for (int c = 0; c < NC2; ++c) mk2[c] = __mmask32(mk[2 * c]) | (2 * c + 1 < NC ? __mmask32(mk[2 * c + 1]) << 16 : 0);
  if constexpr (BF16DP) {
    std::fill(S.qb.begin(), S.qb.end(), uint16_t(0));
    for (int64_t g = 0; g < G; ++g)
      std::memcpy(S.qb.data() + g * Dp,
                  static_cast<const uint16_t*>(P.q) + row * P.q_s0 + (h * G + g) * P.q_s1, P.D * 2);
  }
  const int64_t* table = P.tables + row * P.tbl_s0;
  const KT* kb = static_cast<const KT*>(P.k) + h * P.k_s0;
  const KT* vb = static_cast<const KT*>(P.v) + h * P.v_s0;
  const float* ksh = P.ks ? P.ks + h * P.ks_s0 : nullptr;
  const float* vsh = P.vs ? P.vs + h * P.vs_s0 : nullptr;
  const int64_t row_bytes = P.D * int64_t(sizeof(KT));
  int64_t* cur = S.slots.data();
  int64_t* nxt = cur + kTile;
  int tn = fill_tile(table, P.bs, ctx, walk, cur);
  for (int64_t t0 = 0; t0 < ctx; t0 += kTile) {
    const int next_n = fill_tile(table, P.bs, ctx - t0 - kTile, walk, nxt);
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
      // The first pass over the tile prefetches its V rows.
      const Prefetch<KT> pf{vb, P.v_s1, cur, g0 == 0 ? tn : 0, row_bytes};
      const int64_t gb = std::min<int64_t>(GB, G - g0);
      float* s = S.s.data() + g0 * kTile;
#if KVS_BF16DP
      if constexpr (BF16DP) {
        const uint16_t* qb = S.qb.data() + g0 * Dp;
#define KVS_QK(N) qk_bf16<NC2, N>(qb, Dp, kb, P.k_s1, cur, tn, mk2, s, P.scale, pf)
        switch (gb) {
          case 1: KVS_QK(1); break;
          case 2: KVS_QK(2); break;
          case 3: if constexpr (GB >= 3) KVS_QK(3); break;
          default: if constexpr (GB >= 4) KVS_QK(4); break;
        }
#undef KVS_QK
        continue;
      }
#endif
      const float* qf = S.qf.data() + g0 * Dp;
#define KVS_QK(N) qk_f32<KT, NC, N>(qf, Dp, kb, P.k_s1, cur, tn, mk, s, pf)
      switch (gb) {
        case 1: KVS_QK(1); break;
        case 2: KVS_QK(2); break;
        case 3: if constexpr (GB >= 3) KVS_QK(3); break;
        default: if constexpr (GB >= 4) KVS_QK(4); break;
      }
#undef KVS_QK
    }
    apply_slot_scales(ksh, cur, tn, G, S.s.data());
    for (int64_t g = 0; g < G; ++g) {
      softmax_tile(S.s.data() + g * kTile, tn, S.m[g], S.l[g], S.acc.data() + g * Dp, Dp);
#if KVS_BF16DP
      if constexpr (BF16DP) {
        uint16_t* pb = S.pb.data() + g * 2 * kTile;
        split_probs(S.s.data() + g * kTile, pb, pb + kTile);
      }
#endif
    }
    apply_slot_scales(vsh, cur, tn, G, S.s.data());  // bf16 caches (the BF16DP path) have none
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
      // The first pass over the tile prefetches the next tile's K rows.
      const Prefetch<KT> pf{kb, P.k_s1, nxt, g0 == 0 ? next_n : 0, row_bytes};
      const int64_t gb = std::min<int64_t>(GB, G - g0);
      float* acc = S.acc.data() + g0 * Dp;
#if KVS_BF16DP
      if constexpr (BF16DP) {
        const uint16_t* pb = S.pb.data() + g0 * 2 * kTile;
#define KVS_PV(N) pv_bf16<NC2, N>(acc, Dp, vb, P.v_s1, cur, tn, mk2, pb, pf)
        switch (gb) {
          case 1: KVS_PV(1); break;
          case 2: KVS_PV(2); break;
          case 3: if constexpr (GB >= 3) KVS_PV(3); break;
          default: if constexpr (GB >= 4) KVS_PV(4); break;
        }
#undef KVS_PV
        continue;
      }
#endif
      const float* s = S.s.data() + g0 * kTile;
#define KVS_PV(N) pv_f32<KT, NC, N>(acc, Dp, vb, P.v_s1, cur, tn, mk, s, pf)
      switch (gb) {
        case 1: KVS_PV(1); break;
        case 2: KVS_PV(2); break;
        case 3: if constexpr (GB >= 3) KVS_PV(3); break;
        default: if constexpr (GB >= 4) KVS_PV(4); break;
      }
#undef KVS_PV
    }
    std::swap(cur, nxt);
    tn = next_n;
  }
#if KVS_BF16DP
  if constexpr (BF16DP) unpermute(S.acc.data(), G, Dp);
#endif
  store_out(P, row, h, S);
}

// ---- Rows of a prompt chunk: one task walks the shared keys once for a block of rows ----------
// With token rows a prompt chunk of T tokens arrives as T rows that share one table, with context
// lengths start+1 .. start+T. Each row's result must stay bitwise what it is alone, so a block
// task replays, for every row, the exact operations of task_avx512 on that row: the same tiles
// (kTile positions from position 0), per token the same score (a token's score depends only on q
// and its key: the same FMA chain over head_dim chunks, the same reduce4 / reduce16 tree), the same
// softmax_tile over that row's tn tokens of the tile, and the same in-order P.V FMA chain over its
// tn tokens. What is shared is only the loads: the tile's K and V rows are widened to float32 once
// (exact, as ld16 does it) into per-thread scratch, and every row's queries run against them, many
// queries per loaded key vector. Rows whose tile is cut short (the chunk's diagonal) take their own
// P.V pass over exactly their tokens.
struct BlockScratch {
  int64_t Dp;
  std::vector<float> qf, acc, s, m, l, kf, vf;
  std::vector<uint16_t> qb, pb;
  std::vector<int64_t> slots, ident;
  BlockScratch(int64_t queries, int64_t Dp_)
      : Dp(Dp_), qf(queries * Dp_), acc(queries * Dp_), s(queries * kTile), m(queries), l(queries),
        kf(kTile * Dp_), vf(kTile * Dp_), qb(queries * Dp_), pb(queries * 2 * kTile), slots(kTile + 16),
        ident(kTile + 16) {
    std::iota(ident.begin(), ident.end(), int64_t(0));
  }
};

// The tile's rows slots[0 .. tnp-1] widened to float32, head_dim zero padded to NC * 16 (what
// ld16's masked loads give).
template <typename KT, int NC>
KVS_AVX512 static void widen_tile(const KT* base, int64_t stride, const int64_t* slots, int tnp, const __mmask16* mk,
                                  float* dst, int64_t Dp) {
  for (int j = 0; j < tnp; ++j) {
    const KT* p = base + slots[j] * stride;
    KVS_UNROLL
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(dst + j * Dp + 16 * c, ld16(p + 16 * c, mk[c]));
  }
}

// Scores of queries [q0, q1) (query i: qf + i * Dp -> s + i * kTile) for tokens < tn, in passes of
// up to 4 queries (any pass width gives a query the same bits).
template <typename KT, int NC>
KVS_AVX512 static void qk_many(const float* qf, int64_t Dp, const KT* kb, int64_t ks1, const int64_t* slots, int tn,
                               const __mmask16* mk, float* s, int64_t q0, int64_t q1) {
  const Prefetch<KT> nopf{kb, ks1, slots, 0, 0};
  int64_t i = q0;
  for (; i + 4 <= q1; i += 4) qk_f32<KT, NC, 4>(qf + i * Dp, Dp, kb, ks1, slots, tn, mk, s + i * kTile, nopf);
  switch (q1 - i) {
    case 3: qk_f32<KT, NC, 3>(qf + i * Dp, Dp, kb, ks1, slots, tn, mk, s + i * kTile, nopf); break;
    case 2: qk_f32<KT, NC, 2>(qf + i * Dp, Dp, kb, ks1, slots, tn, mk, s + i * kTile, nopf); break;
    case 1: qk_f32<KT, NC, 1>(qf + i * Dp, Dp, kb, ks1, slots, tn, mk, s + i * kTile, nopf); break;
    default: break;
  }
}

// acc[i] += sum_{j < tn} p[i][j] v_j for queries [q0, q1), float32 V rows vf (Dp apart), as many
// queries per pass as registers hold (each query's FMA chain is the same whatever the pass width).
template <int NC>
KVS_AVX512 static void pv_many(float* acc, int64_t Dp, const float* vf, const int64_t* ident, int tn,
                               const __mmask16* mk, const float* s, int64_t q0, int64_t q1) {
  constexpr int W = NC >= 8 ? 3 : NC >= 4 ? 6 : NC >= 2 ? 12 : 16;
  const Prefetch<float> nopf{vf, Dp, ident, 0, 0};
  int64_t i = q0;
  for (; i + W <= q1; i += W) pv_f32<float, NC, W>(acc + i * Dp, Dp, vf, Dp, ident, tn, mk, s + i * kTile, nopf);
  for (; i + 2 <= q1; i += 2) pv_f32<float, NC, 2>(acc + i * Dp, Dp, vf, Dp, ident, tn, mk, s + i * kTile, nopf);
  if (i < q1) pv_f32<float, NC, 1>(acc + i * Dp, Dp, vf, Dp, ident, tn, mk, s + i * kTile, nopf);
}

#if KVS_BF16DP
template <int NC2>
KVS_AVX512BF16 static void qk_many_bf16(const uint16_t* qb, int64_t Dp, const uint16_t* kb, int64_t ks1,
                                        const int64_t* slots, int tn, const __mmask32* mk, float* s, float scale,
                                        int64_t q0, int64_t q1) {
  const Prefetch<uint16_t> nopf{kb, ks1, slots, 0, 0};
  int64_t i = q0;
  for (; i + 4 <= q1; i += 4) qk_bf16<NC2, 4>(qb + i * Dp, Dp, kb, ks1, slots, tn, mk, s + i * kTile, scale, nopf);
  switch (q1 - i) {
    case 3: qk_bf16<NC2, 3>(qb + i * Dp, Dp, kb, ks1, slots, tn, mk, s + i * kTile, scale, nopf); break;
    case 2: qk_bf16<NC2, 2>(qb + i * Dp, Dp, kb, ks1, slots, tn, mk, s + i * kTile, scale, nopf); break;
    case 1: qk_bf16<NC2, 1>(qb + i * Dp, Dp, kb, ks1, slots, tn, mk, s + i * kTile, scale, nopf); break;
    default: break;
  }
}

template <int NC2>
KVS_AVX512BF16 static void pv_many_bf16(float* acc, int64_t Dp, const uint16_t* vb, int64_t vs1,
                                        const int64_t* slots, int tn, const __mmask32* mk, const uint16_t* pb,
                                        int64_t q0, int64_t q1) {
  constexpr int W = NC2 >= 4 ? 2 : NC2 >= 2 ? 4 : 8;
  const Prefetch<uint16_t> nopf{vb, vs1, slots, 0, 0};
  int64_t i = q0;
  for (; i + W <= q1; i += W) pv_bf16<NC2, W>(acc + i * Dp, Dp, vb, vs1, slots, tn, mk, pb + i * 2 * kTile, nopf);
  for (; i < q1; ++i) pv_bf16<NC2, 1>(acc + i * Dp, Dp, vb, vs1, slots, tn, mk, pb + i * 2 * kTile, nopf);
}
#endif

// One task: rows r0 .. r0 + R - 1 (context lengths non-decreasing, each seeing all of [0, ctx),
// their tables equal over every block the shorter one reads) x kv head h.
template <typename KT, int NC, bool BF16DP>
static void block_avx512(const Problem& P, int64_t r0, int64_t R, int64_t h, BlockScratch& B) {
  constexpr int NC2 = (NC + 1) / 2;
  const int64_t G = P.G, Dp = B.Dp;
  __mmask16 mk[NC];
  KVS_UNROLL
  for (int c = 0; c < NC; ++c) mk[c] = mask16(P.D - 16 * c);
  __mmask32 mk2[NC2];
  KVS_UNROLL
  for (int c = 0; c < NC2; ++c) mk2[c] = __mmask32(mk[2 * c]) | (2 * c + 1 < NC ? __mmask32(mk[2 * c + 1]) << 16 : 0);
  for (int64_t i = 0; i < R; ++i) {
    load_q_into(P, r0 + i, h, Dp, B.qf.data() + i * G * Dp, B.acc.data() + i * G * Dp, B.m.data() + i * G,
                B.l.data() + i * G);
    if constexpr (BF16DP) {
      uint16_t* qb = B.qb.data() + i * G * Dp;
      std::fill(qb, qb + G * Dp, uint16_t(0));
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(qb + g * Dp, static_cast<const uint16_t*>(P.q) + (r0 + i) * P.q_s0 + (h * G + g) * P.q_s1,
                    P.D * 2);
    }
  }
  const int64_t* ctx = P.ctx + r0;
  const int64_t cmax = ctx[R - 1];
  const int64_t* table = P.tables + (r0 + R - 1) * P.tbl_s0;  // the longest row's: the others' prefix
  const KT* kb = static_cast<const KT*>(P.k) + h * P.k_s0;
  const KT* vb = static_cast<const KT*>(P.v) + h * P.v_s0;
  const float* ksh = P.ks ? P.ks + h * P.ks_s0 : nullptr;
  const float* vsh = P.vs ? P.vs + h * P.vs_s0 : nullptr;
  int64_t* slots = B.slots.data();
  Cursor walk;
  int64_t first = 0;  // rows before it have seen all their positions
  for (int64_t t0 = 0; t0 < cmax; t0 += kTile) {
    while (ctx[first] <= t0) ++first;
    const int tn = fill_tile(table, P.bs, cmax - t0, walk, slots);
    const int tnp = (tn + 15) & ~15;
    // Rows [first, full) see only part of this tile; rows [full, R) see all tn tokens of it.
    int64_t full = first;
    while (ctx[full] - t0 < tn) ++full;
    float* s = B.s.data();
    if constexpr (BF16DP) {
#if KVS_BF16DP
      qk_many_bf16<NC2>(B.qb.data(), Dp, kb, P.k_s1, slots, tn, mk2, s, P.scale, first * G, R * G);
#endif
    } else {
      widen_tile<KT, NC>(kb, P.k_s1, slots, tnp, mk, B.kf.data(), Dp);
      qk_many<float, NC>(B.qf.data(), Dp, B.kf.data(), Dp, B.ident.data(), tn, mk, s, first * G, R * G);
      widen_tile<KT, NC>(vb, P.v_s1, slots, tn, mk, B.vf.data(), Dp);
    }
    for (int64_t i = first; i < R; ++i) {
      const int tni = int(std::min<int64_t>(tn, ctx[i] - t0));
      float* si = s + i * G * kTile;
      apply_slot_scales(ksh, slots, tni, G, si);
      for (int64_t g = 0; g < G; ++g) {
        softmax_tile(si + g * kTile, tni, B.m[i * G + g], B.l[i * G + g], B.acc.data() + (i * G + g) * Dp, Dp);
#if KVS_BF16DP
        if constexpr (BF16DP) {
          uint16_t* pb = B.pb.data() + (i * G + g) * 2 * kTile;
          split_probs(si + g * kTile, pb, pb + kTile);
        }
#endif
      }
      apply_slot_scales(vsh, slots, tni, G, si);
    }
    for (int64_t i = first; i < full; ++i) {  // the cut-short rows: their own tokens only
      const int tni = int(ctx[i] - t0);
      if constexpr (BF16DP) {
#if KVS_BF16DP
        // The pair past an odd count reads the slot after it, with probability 0: the lone row
        // reads its last slot again there (fill_tile's padding), so this row does too.
        const int64_t keep = slots[tni];
        if (tni & 1) slots[tni] = slots[tni - 1];
        pv_many_bf16<NC2>(B.acc.data(), Dp, vb, P.v_s1, slots, tni, mk2, B.pb.data(), i * G, (i + 1) * G);
        slots[tni] = keep;
#endif
      } else {
        pv_many<NC>(B.acc.data(), Dp, B.vf.data(), B.ident.data(), tni, mk, s, i * G, (i + 1) * G);
      }
    }
    if constexpr (BF16DP) {
#if KVS_BF16DP
      pv_many_bf16<NC2>(B.acc.data(), Dp, vb, P.v_s1, slots, tn, mk2, B.pb.data(), full * G, R * G);
#endif
    } else {
      pv_many<NC>(B.acc.data(), Dp, B.vf.data(), B.ident.data(), tn, mk, s, full * G, R * G);
    }
  }
  for (int64_t i = 0; i < R; ++i) {
#if KVS_BF16DP
    if constexpr (BF16DP) unpermute(B.acc.data() + i * G * Dp, G, Dp);
#endif
    store_out_from(P, r0 + i, h, Dp, B.acc.data() + i * G * Dp, B.l.data() + i * G);
  }
}

// ------------------------------------------------------------------------------------------
// AVX2 + FMA (+ F16C) path, any head_dim: head_dim in chunks of 8 lanes (a last partial chunk
// goes through a zeroed copy, so no row is read past head_dim), up to 3 query heads of the group
// per pass over the tile. Same tiles, prefetching and online softmax as the AVX-512 path; the
// chunk count is a run-time value (the loops over heads, tokens and chunk blocks are unrolled).
#define KVS_AVX2 __attribute__((target("avx2,fma,f16c")))

KVS_AVX2 static KVS_INLINE __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
KVS_AVX2 static KVS_INLINE __m256 ld8(const uint16_t* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
KVS_AVX2 static KVS_INLINE __m256 ld8(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
KVS_AVX2 static KVS_INLINE __m256 ld8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// e4m3 -> float16 fields -> float, times 2^8 (see the AVX-512 ld16).
KVS_AVX2 static KVS_INLINE __m256 ld8(const fp8_t* p) {
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(mag, sign)), _mm256_set1_ps(256.f));
}
// The first n (< 8) elements at p, zeros after: only those n are read.
template <typename KT>
KVS_AVX2 static KVS_INLINE __m256 ld8_part(const KT* p, int n) {
  KT buf[8];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, size_t(n) * sizeof(KT));
  return ld8(buf);
}

template <typename KT>
struct Prefetch2 {  // Prefetch, for AVX2 callers
  const KT* base;
  int64_t stride;
  const int64_t* slots;
  int n;
  int64_t row_bytes;
  KVS_AVX2 KVS_INLINE void operator()(int j) const {
    if (j < n) {
      const char* c = reinterpret_cast<const char*>(base + slots[j] * stride);
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
    }
  }
};

// exp(x) for x <= 0 (scores minus their running max), the AVX-512 exp16's polynomial; exactly 0
// below -87.3 (where 2^n leaves the normal range).
KVS_AVX2 static KVS_INLINE __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Lanes i < n all ones, the rest zero.
KVS_AVX2 static KVS_INLINE __m256 mask8(int n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

KVS_AVX2 static KVS_INLINE float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
KVS_AVX2 static KVS_INLINE float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// a0..a3 -> one vector whose 128-bit lane k holds [a0, a1, a2, a3] each summed over its lane k.
KVS_AVX2 static KVS_INLINE __m256 reduce4_8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
  const __m256 t23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
  const __m256d x = _mm256_castps_pd(t01), y = _mm256_castps_pd(t23);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
}
// Two reduce4_8 results (tokens 0-3, 4-7) -> the 8 horizontal sums, in token order.
KVS_AVX2 static KVS_INLINE __m256 reduce8(__m256 u0, __m256 u1) {
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores s[g][j] = q_g . k_j for GB heads and tokens j < tn, 8 at a time (q pre-scaled, zero
// padded to Dp): nf full chunks of 8, then rem (< 8) elements.
template <typename KT, int GB>
KVS_AVX2 static void qk_avx2(const float* qf, int64_t Dp, const KT* kb, int64_t ks1, const int64_t* slots,
                             int tn, int nf, int rem, float* s, Prefetch2<KT> pf) {
  for (int j0 = 0; j0 < tn; j0 += 8) {  // tiles are padded to 16 slots: j0 + 7 is a real slot
    __m256 u[GB][2];
    KVS_UNROLL
    for (int hf = 0; hf < 2; ++hf) {
      const KT* kp[4];
      KVS_UNROLL
      for (int t = 0; t < 4; ++t) {
        const int j = j0 + 4 * hf + t;
        pf(j);
        kp[t] = kb + slots[j] * ks1;
      }
      __m256 a[GB][4];
      KVS_UNROLL
      for (int g = 0; g < GB; ++g)
        KVS_UNROLL
        for (int t = 0; t < 4; ++t) a[g][t] = _mm256_setzero_ps();
      for (int c = 0; c < nf; ++c) {
        KVS_UNROLL
        for (int t = 0; t < 4; ++t) {
          const __m256 kv = ld8(kp[t] + 8 * c);
          KVS_UNROLL
          for (int g = 0; g < GB; ++g) a[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * Dp + 8 * c), kv, a[g][t]);
        }
      }
      if (rem) {
        KVS_UNROLL
        for (int t = 0; t < 4; ++t) {
          const __m256 kv = ld8_part(kp[t] + 8 * nf, rem);
          KVS_UNROLL
          for (int g = 0; g < GB; ++g) a[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * Dp + 8 * nf), kv, a[g][t]);
        }
      }
      KVS_UNROLL
      for (int g = 0; g < GB; ++g) u[g][hf] = reduce4_8(a[g][0], a[g][1], a[g][2], a[g][3]);
    }
    KVS_UNROLL
    for (int g = 0; g < GB; ++g) _mm256_storeu_ps(s + g * kTile + j0, reduce8(u[g][0], u[g][1]));
  }
}

// acc[g][chunks c0 .. c0+CB-1] += sum_j p[g][j] v_j for GB heads, tokens j < tn. PART: one
// partial chunk of rem elements (CB == 1).
template <typename KT, int GB, int CB, bool PART>
KVS_AVX2 static void pv_block(float* acc, int64_t Dp, const KT* vb, int64_t vs1, const int64_t* slots, int tn,
                              int c0, int rem, const float* s, Prefetch2<KT> pf) {
  __m256 ar[GB][CB];
  KVS_UNROLL
  for (int g = 0; g < GB; ++g)
    KVS_UNROLL
    for (int c = 0; c < CB; ++c) ar[g][c] = _mm256_loadu_ps(acc + g * Dp + 8 * (c0 + c));
  for (int j = 0; j < tn; ++j) {
    pf(j);
    const KT* vp = vb + slots[j] * vs1 + 8 * c0;
    __m256 p[GB];
    KVS_UNROLL
    for (int g = 0; g < GB; ++g) p[g] = _mm256_broadcast_ss(s + g * kTile + j);
    KVS_UNROLL
    for (int c = 0; c < CB; ++c) {
      const __m256 vv = PART ? ld8_part(vp, rem) : ld8(vp + 8 * c);
      KVS_UNROLL
      for (int g = 0; g < GB; ++g) ar[g][c] = _mm256_fmadd_ps(p[g], vv, ar[g][c]);
    }
  }
  KVS_UNROLL
  for (int g = 0; g < GB; ++g)
    KVS_UNROLL
    for (int c = 0; c < CB; ++c) _mm256_storeu_ps(acc + g * Dp + 8 * (c0 + c), ar[g][c]);
}

// acc[g] += sum_j p[g][j] v_j over every chunk: blocks of 4 chunks, then single ones, then the
// partial chunk. Only the first block prefetches.
template <typename KT, int GB>
static void pv_avx2(float* acc, int64_t Dp, const KT* vb, int64_t vs1, const int64_t* slots, int tn, int nf,
                    int rem, const float* s, Prefetch2<KT> pf) {
  int c0 = 0;
  for (; c0 + 4 <= nf; c0 += 4, pf.n = 0) pv_block<KT, GB, 4, false>(acc, Dp, vb, vs1, slots, tn, c0, 0, s, pf);
  for (; c0 < nf; ++c0, pf.n = 0) pv_block<KT, GB, 1, false>(acc, Dp, vb, vs1, slots, tn, c0, 0, s, pf);
  if (rem) pv_block<KT, GB, 1, true>(acc, Dp, vb, vs1, slots, tn, nf, rem, s, pf);
}

// The AVX-512 softmax_tile in 8 lanes: updates (m, l), rescales acc (Dp floats, a multiple of
// 8), leaves exp(s - m) in s[0 .. tn-1] and zeros in s[tn .. kTile-1].
KVS_AVX2 static void softmax_tile_avx2(float* sg, int tn, float& m, float& l, float* acc, int64_t Dp) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  __m256 vmax = ninf;
  for (int j = 0; j < tn; j += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(ninf, _mm256_loadu_ps(sg + j), mask8(tn - j)));
  const float mnew = std::max(m, hmax8(vmax));
  if (mnew > m) {
    const float alpha = std::exp(m - mnew);
    const __m256 va = _mm256_set1_ps(alpha);
    l *= alpha;
    for (int64_t d = 0; d < Dp; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(va, _mm256_loadu_ps(acc + d)));
    m = mnew;
  }
  const __m256 vm = _mm256_set1_ps(mnew);
  __m256 vsum = _mm256_setzero_ps();
  for (int j = 0; j < kTile; j += 8) {
    const __m256 e = _mm256_and_ps(mask8(tn - j), exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), vm)));
    _mm256_storeu_ps(sg + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  l += hsum8(vsum);
}

// Heads per pass, up to 3 (12 score accumulators; 12 V accumulators of 4 chunks), in as few
// passes as possible, as even as possible (4 heads: 2 + 2, not 3 + 1).
static KVS_INLINE int64_t pass_heads(int64_t G, int64_t g0) {
  const int64_t passes_left = (G - g0 + 2) / 3;
  return (G - g0 + passes_left - 1) / passes_left;
}

// One (row, kv head) task.
template <typename KT>
static void task_avx2(const Problem& P, int64_t row, int64_t h, Scratch& S) {
  Cursor walk;
  const int64_t ctx = start_walk(P, row, walk);  // positions this row sees
  const int64_t G = P.G, Dp = S.Dp;
  const int nf = int(P.D / 8), rem = int(P.D % 8);
  load_q(P, row, h, S);
  const int64_t* table = P.tables + row * P.tbl_s0;
  const KT* kb = static_cast<const KT*>(P.k) + h * P.k_s0;
  const KT* vb = static_cast<const KT*>(P.v) + h * P.v_s0;
  const float* ksh = P.ks ? P.ks + h * P.ks_s0 : nullptr;
  const float* vsh = P.vs ? P.vs + h * P.vs_s0 : nullptr;
  const int64_t row_bytes = P.D * int64_t(sizeof(KT));
  int64_t* cur = S.slots.data();
  int64_t* nxt = cur + kTile;
  int tn = fill_tile(table, P.bs, ctx, walk, cur);
  for (int64_t t0 = 0; t0 < ctx; t0 += kTile) {
    const int next_n = fill_tile(table, P.bs, ctx - t0 - kTile, walk, nxt);
    for (int64_t g0 = 0, gb; g0 < G; g0 += gb) {
      gb = pass_heads(G, g0);
      // The first pass over the tile prefetches its V rows.
      const Prefetch2<KT> pf{vb, P.v_s1, cur, g0 == 0 ? tn : 0, row_bytes};
      const float* qf = S.qf.data() + g0 * Dp;
      float* s = S.s.data() + g0 * kTile;
      switch (gb) {
        case 1: qk_avx2<KT, 1>(qf, Dp, kb, P.k_s1, cur, tn, nf, rem, s, pf); break;
        case 2: qk_avx2<KT, 2>(qf, Dp, kb, P.k_s1, cur, tn, nf, rem, s, pf); break;
        default: qk_avx2<KT, 3>(qf, Dp, kb, P.k_s1, cur, tn, nf, rem, s, pf); break;
      }
    }
    apply_slot_scales(ksh, cur, tn, G, S.s.data());
    for (int64_t g = 0; g < G; ++g)
      softmax_tile_avx2(S.s.data() + g * kTile, tn, S.m[g], S.l[g], S.acc.data() + g * Dp, Dp);
    apply_slot_scales(vsh, cur, tn, G, S.s.data());
    for (int64_t g0 = 0, gb; g0 < G; g0 += gb) {
      gb = pass_heads(G, g0);
      // The first pass over the tile prefetches the next tile's K rows.
      const Prefetch2<KT> pf{kb, P.k_s1, nxt, g0 == 0 ? next_n : 0, row_bytes};
      float* acc = S.acc.data() + g0 * Dp;
      const float* s = S.s.data() + g0 * kTile;
      switch (gb) {
        case 1: pv_avx2<KT, 1>(acc, Dp, vb, P.v_s1, cur, tn, nf, rem, s, pf); break;
        case 2: pv_avx2<KT, 2>(acc, Dp, vb, P.v_s1, cur, tn, nf, rem, s, pf); break;
        default: pv_avx2<KT, 3>(acc, Dp, vb, P.v_s1, cur, tn, nf, rem, s, pf); break;
      }
    }
    std::swap(cur, nxt);
    tn = next_n;
  }
  store_out(P, row, h, S);
}

// block_avx512 on the AVX2 path (any head_dim): the tile's K and V rows widened to float32 once
// (exact, as ld8 / ld8_part give them), every row's queries against them, each row replaying
// task_avx2's operations on its own tokens of the tile.
template <typename KT>
KVS_AVX2 static void widen_tile8(const KT* base, int64_t stride, const int64_t* slots, int tnp, int nf, int rem,
                                 float* dst, int64_t Dp) {
  for (int j = 0; j < tnp; ++j) {
    const KT* p = base + slots[j] * stride;
    float* d = dst + j * Dp;
    for (int c = 0; c < nf; ++c) _mm256_storeu_ps(d + 8 * c, ld8(p + 8 * c));
    if (rem) _mm256_storeu_ps(d + 8 * nf, ld8_part(p + 8 * nf, rem));
  }
}

template <typename KT>
static void block_avx2(const Problem& P, int64_t r0, int64_t R, int64_t h, BlockScratch& B) {
  const int64_t G = P.G, Dp = B.Dp;
  const int nf = int(P.D / 8), rem = int(P.D % 8);
  for (int64_t i = 0; i < R; ++i)
    load_q_into(P, r0 + i, h, Dp, B.qf.data() + i * G * Dp, B.acc.data() + i * G * Dp, B.m.data() + i * G,
                B.l.data() + i * G);
  const int64_t* ctx = P.ctx + r0;
  const int64_t cmax = ctx[R - 1];
  const int64_t* table = P.tables + (r0 + R - 1) * P.tbl_s0;  // the longest row's: the others' prefix
  const KT* kb = static_cast<const KT*>(P.k) + h * P.k_s0;
  const KT* vb = static_cast<const KT*>(P.v) + h * P.v_s0;
  const float* ksh = P.ks ? P.ks + h * P.ks_s0 : nullptr;
  const float* vsh = P.vs ? P.vs + h * P.vs_s0 : nullptr;
  int64_t* slots = B.slots.data();
  const int64_t* ident = B.ident.data();
  const Prefetch2<float> nopf{B.kf.data(), Dp, ident, 0, 0};
  float* s = B.s.data();
  float* acc = B.acc.data();
  // Queries [q0, q1) in passes of up to 3 (a query's bits do not depend on the pass width).
  auto qk = [&](int tn, int64_t q0, int64_t q1) {
    for (int64_t i = q0; i < q1; i += 3) {
      const float* qf = B.qf.data() + i * Dp;
      switch (std::min<int64_t>(3, q1 - i)) {
        case 1: qk_avx2<float, 1>(qf, Dp, B.kf.data(), Dp, ident, tn, nf, rem, s + i * kTile, nopf); break;
        case 2: qk_avx2<float, 2>(qf, Dp, B.kf.data(), Dp, ident, tn, nf, rem, s + i * kTile, nopf); break;
        default: qk_avx2<float, 3>(qf, Dp, B.kf.data(), Dp, ident, tn, nf, rem, s + i * kTile, nopf); break;
      }
    }
  };
  auto pv = [&](int tn, int64_t q0, int64_t q1) {
    for (int64_t i = q0; i < q1; i += 3) {
      switch (std::min<int64_t>(3, q1 - i)) {
        case 1: pv_avx2<float, 1>(acc + i * Dp, Dp, B.vf.data(), Dp, ident, tn, nf, rem, s + i * kTile, nopf); break;
        case 2: pv_avx2<float, 2>(acc + i * Dp, Dp, B.vf.data(), Dp, ident, tn, nf, rem, s + i * kTile, nopf); break;
        default: pv_avx2<float, 3>(acc + i * Dp, Dp, B.vf.data(), Dp, ident, tn, nf, rem, s + i * kTile, nopf); break;
      }
    }
  };
  Cursor walk;
  int64_t first = 0;  // rows before it have seen all their positions
  for (int64_t t0 = 0; t0 < cmax; t0 += kTile) {
    while (ctx[first] <= t0) ++first;
    const int tn = fill_tile(table, P.bs, cmax - t0, walk, slots);
    int64_t full = first;  // rows [first, full) see only part of this tile
    while (ctx[full] - t0 < tn) ++full;
    widen_tile8<KT>(kb, P.k_s1, slots, (tn + 15) & ~15, nf, rem, B.kf.data(), Dp);
    qk(tn, first * G, R * G);
    widen_tile8<KT>(vb, P.v_s1, slots, tn, nf, rem, B.vf.data(), Dp);
    for (int64_t i = first; i < R; ++i) {
      const int tni = int(std::min<int64_t>(tn, ctx[i] - t0));
      float* si = s + i * G * kTile;
      apply_slot_scales(ksh, slots, tni, G, si);
      for (int64_t g = 0; g < G; ++g)
        softmax_tile_avx2(si + g * kTile, tni, B.m[i * G + g], B.l[i * G + g], acc + (i * G + g) * Dp, Dp);
      apply_slot_scales(vsh, slots, tni, G, si);
    }
    for (int64_t i = first; i < full; ++i) pv(int(ctx[i] - t0), i * G, (i + 1) * G);
    pv(tn, full * G, R * G);
  }
  for (int64_t i = 0; i < R; ++i) store_out_from(P, r0 + i, h, Dp, acc + i * G * Dp, B.l.data() + i * G);
}

// ---- Causal attention of a prompt chunk over its own keys (prefill from position 0) -------------
// torch's CPU flash attention skips hidden keys only in whole 512-key tiles, so below 512 tokens a
// causal chunk costs as much as a full one (5.1 ms for 512 tokens x 9 heads here, 60 GFLOP/s of
// useful work). Here each task is one KV head and a block of kCausalBq query positions (with the
// KV head's G query heads: G * kCausalBq rows sharing its keys), over key tiles of kCausalBk up to
// the block's last position only: S = (q * scale) K^T by a 6-row x 64-key register tile, an online
// softmax per row (float32, exp16), O += P V by a 6-row x 64-column tile. float32 throughout.
constexpr int kCausalBq = 16;
constexpr int kCausalBk = 64;

struct CausalArgs {
  const float* q; int64_t q_s0;  // [T, H, D]: position stride q_s0, heads contiguous
  const float* k; int64_t k_s0;  // [T, KVH, D]
  const float* v; int64_t v_s0;
  float* out; int64_t out_s0;    // [T, H, D]
  int64_t T, H, KVH, D;
  float scale;
};

// S[i][0..63] = sum_d Q[i][d] * Kt[d][0..63], rows i < MR (Q rows D apart).
template <int MR>
KVS_AVX512 static KVS_INLINE void causal_qk(const float* Q, int64_t D, const float* Kt, float* S) {
  __m512 acc[MR][4];
  KVS_UNROLL for (int i = 0; i < MR; ++i) {
    KVS_UNROLL for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < D; ++d) {
    __m512 kv[4];
    KVS_UNROLL for (int c = 0; c < 4; ++c) kv[c] = _mm512_loadu_ps(Kt + d * kCausalBk + 16 * c);
    KVS_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 qv = _mm512_set1_ps(Q[i * D + d]);
      KVS_UNROLL for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_fmadd_ps(qv, kv[c], acc[i][c]);
    }
  }
  KVS_UNROLL for (int i = 0; i < MR; ++i) {
    KVS_UNROLL for (int c = 0; c < 4; ++c) _mm512_storeu_ps(S + i * kCausalBk + 16 * c, acc[i][c]);
  }
}

// O[i][c0 .. c0 + 63] += sum_{j < nk} P[i][j] * V[j][c0 ..], rows i < MR (O rows D apart).
template <int MR>
KVS_AVX512 static KVS_INLINE void causal_pv(const float* P, int nk, const float* V, int64_t v_s0, float* O,
                                            int64_t D) {
  __m512 acc[MR][4];
  KVS_UNROLL for (int i = 0; i < MR; ++i) {
    KVS_UNROLL for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_loadu_ps(O + i * D + 16 * c);
  }
  for (int j = 0; j < nk; ++j) {
    __m512 vv[4];
    KVS_UNROLL for (int c = 0; c < 4; ++c) vv[c] = _mm512_loadu_ps(V + j * v_s0 + 16 * c);
    KVS_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 pv = _mm512_set1_ps(P[i * kCausalBk + j]);
      KVS_UNROLL for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_fmadd_ps(pv, vv[c], acc[i][c]);
    }
  }
  KVS_UNROLL for (int i = 0; i < MR; ++i) {
    KVS_UNROLL for (int c = 0; c < 4; ++c) _mm512_storeu_ps(O + i * D + 16 * c, acc[i][c]);
  }
}

// One tile of MR rows from row r: S = Q Kt (pv false), or O += P V (pv true, 64 columns at a time).
template <int MR>
KVS_AVX512 static KVS_INLINE void causal_tile(const CausalArgs& A, int64_t r, const float* Q, const float* Kt,
                                              float* S, const float* V, int nk, float* O, bool pv) {
  if (!pv) {
    causal_qk<MR>(Q + r * A.D, A.D, Kt, S + r * kCausalBk);
    return;
  }
  for (int64_t c0 = 0; c0 < A.D; c0 += 64) causal_pv<MR>(S + r * kCausalBk, nk, V + c0, A.v_s0, O + r * A.D + c0, A.D);
}

KVS_AVX512 static void causal_rows(const CausalArgs& A, int64_t rows, const float* Q, const float* Kt, float* S,
                                   const float* V, int nk, float* O, bool pv) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) causal_tile<6>(A, r, Q, Kt, S, V, nk, O, pv);
  for (; r < rows; ++r) causal_tile<1>(A, r, Q, Kt, S, V, nk, O, pv);
}

struct CausalScratch {
  std::vector<float> q, kt, s, o, m, l;
  CausalScratch(int64_t rows, int64_t D)
      : q(size_t(rows * D)), kt(size_t(D * kCausalBk)), s(size_t(rows * kCausalBk)), o(size_t(rows * D)),
        m(size_t(rows)), l(size_t(rows)) {}
};

// One task: KV head h, query positions [p0, p1).
KVS_AVX512 static void causal_block(const CausalArgs& A, int64_t h, int64_t p0, int64_t p1, CausalScratch& W) {
  const int64_t G = A.H / A.KVH, D = A.D, rows = (p1 - p0) * G;
  float* Q = W.q.data();
  float* Kt = W.kt.data();
  float* S = W.s.data();
  float* O = W.o.data();
  const __m512 scale = _mm512_set1_ps(A.scale);
  for (int64_t r = 0; r < rows; ++r) {  // row r: position p0 + r / G, query head h * G + r % G
    const float* src = A.q + (p0 + r / G) * A.q_s0 + (h * G + r % G) * D;
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(Q + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(src + d), scale));
    std::memset(O + r * D, 0, size_t(D) * sizeof(float));
    W.m[size_t(r)] = kNegInf;
    W.l[size_t(r)] = 0.f;
  }
  for (int64_t t0 = 0; t0 < p1; t0 += kCausalBk) {
    const int nk = int(std::min<int64_t>(kCausalBk, p1 - t0));
    for (int j = 0; j < kCausalBk; ++j) {  // K tile transposed: Kt[d][j]
      const float* kr = A.k + (t0 + j) * A.k_s0 + h * D;
      for (int64_t d = 0; d < D; ++d) Kt[d * kCausalBk + j] = j < nk ? kr[d] : 0.f;
    }
    causal_rows(A, rows, Q, Kt, S, nullptr, nk, O, false);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = S + r * kCausalBk;
      const int64_t vis = std::min<int64_t>(nk, p0 + r / G - t0 + 1);  // keys t0 .. position
      if (vis <= 0) {
        std::memset(sr, 0, sizeof(float) * kCausalBk);
        continue;
      }
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int j = 0; j < kCausalBk; j += 16)
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), mask16(vis - j), sr + j));
      const float mnew = std::max(W.m[size_t(r)], _mm512_reduce_max_ps(mx));
      const float alpha = std::exp(W.m[size_t(r)] - mnew);
      __m512 sum = _mm512_setzero_ps();
      const __m512 mv = _mm512_set1_ps(mnew);
      for (int j = 0; j < kCausalBk; j += 16) {
        const __m512 p = _mm512_maskz_mov_ps(mask16(vis - j), exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mv)));
        _mm512_storeu_ps(sr + j, p);
        sum = _mm512_add_ps(sum, p);
      }
      W.l[size_t(r)] = W.l[size_t(r)] * alpha + _mm512_reduce_add_ps(sum);
      W.m[size_t(r)] = mnew;
      if (alpha != 1.f) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(O + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), av));
      }
    }
    causal_rows(A, rows, nullptr, nullptr, S, A.v + t0 * A.v_s0 + h * D, nk, O, true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = A.out + (p0 + r / G) * A.out_s0 + (h * G + r % G) * D;
    const __m512 inv = _mm512_set1_ps(1.f / W.l[size_t(r)]);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), inv));
  }
}

static bool cpu_has_avx2() {
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok;
}

static bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("fma");
  return ok;
}
#if KVS_BF16DP
static bool cpu_has_avx512bf16() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok;
}
#else
static bool cpu_has_avx512bf16() { return false; }
#endif
#else
static bool cpu_has_avx2() { return false; }
static bool cpu_has_avx512() { return false; }
static bool cpu_has_avx512bf16() { return false; }
#endif  // KVS_X86

using TaskFn = void (*)(const Problem&, int64_t, int64_t, Scratch&);

// path: 1 scalar, 2 avx512, 3 avx512 + avx512_bf16 dot products (bf16 cache and q only),
// 4 avx2. A vector path that does not fit falls back to the next one that does: avx512 (head_dim
// > 128) to avx2 where the CPU has it, avx2 (any head_dim) to nothing, then the scalar path.
template <typename KT>
static TaskFn pick(int64_t D, int path, int64_t& Dp) {
#if KVS_X86
  if ((path == 2 || path == 3) && D <= 128) {
    const int64_t nc = (D + 15) / 16;
#if KVS_BF16DP
    if constexpr (std::is_same_v<KT, uint16_t>) {
      if (path == 3) {
        if (nc <= 2) { Dp = 32; return &task_avx512<KT, 2, true>; }
        if (nc <= 4) { Dp = 64; return &task_avx512<KT, 4, true>; }
        Dp = 128; return &task_avx512<KT, 8, true>;
      }
    }
#endif
    if (nc <= 1) { Dp = 16; return &task_avx512<KT, 1, false>; }
    if (nc <= 2) { Dp = 32; return &task_avx512<KT, 2, false>; }
    if (nc <= 4) { Dp = 64; return &task_avx512<KT, 4, false>; }
    Dp = 128; return &task_avx512<KT, 8, false>;
  }
  if (path >= 2 && cpu_has_avx2()) {
    Dp = (D + 7) / 8 * 8;
    return &task_avx2<KT>;
  }
#endif
  (void)path;
  Dp = D;
  return &task_scalar<KT>;
}

using BlockFn = void (*)(const Problem&, int64_t, int64_t, int64_t, BlockScratch&);

// The block task matching pick's choice of task (the same path, chunk count and Dp), or null where
// that path has none (avx2, scalar): those rows run one task each.
template <typename KT>
static BlockFn pick_block(int64_t D, int path) {
#if KVS_X86
  if ((path == 2 || path == 3) && D <= 128) {
    const int64_t nc = (D + 15) / 16;
#if KVS_BF16DP
    if constexpr (std::is_same_v<KT, uint16_t>) {
      if (path == 3) {
        if (nc <= 2) return &block_avx512<KT, 2, true>;
        if (nc <= 4) return &block_avx512<KT, 4, true>;
        return &block_avx512<KT, 8, true>;
      }
    }
#endif
    if (nc <= 1) return &block_avx512<KT, 1, false>;
    if (nc <= 2) return &block_avx512<KT, 2, false>;
    if (nc <= 4) return &block_avx512<KT, 4, false>;
    return &block_avx512<KT, 8, false>;
  }
  if (path >= 2 && cpu_has_avx2()) return &block_avx2<KT>;
#endif
  (void)D;
  (void)path;
  return nullptr;
}

// Whether row r sees all of [0, ctx) (no positions cut out between sinks and window): start_walk's
// test.
static bool sees_all(const Problem& P, int64_t r) {
  const int64_t c = P.ctx[r];
  const int64_t s = P.sink_end ? clamp_pos(P.sink_end[r], c) : 0;
  const int64_t w = P.win_start ? clamp_pos(P.win_start[r], c) : 0;
  return w <= s;
}

// Row r continues row r - 1's prompt chunk: both see all their positions, r's context is at least
// r - 1's, and their tables agree on every block r - 1 reads (so r's table walks r - 1's keys).
static bool continues(const Problem& P, int64_t r) {
  const int64_t a = P.ctx[r - 1];
  if (P.ctx[r] < a || !sees_all(P, r - 1) || !sees_all(P, r)) return false;
  const int64_t used = (a + P.bs - 1) / P.bs;
  return std::memcmp(P.tables + (r - 1) * P.tbl_s0, P.tables + r * P.tbl_s0, size_t(used) * sizeof(int64_t)) == 0;
}

}  // namespace kvs

// ---- C ABI (called through ctypes: no torch headers, so the build takes seconds) ---------

// Bit mask of the code paths this CPU can run: 1 scalar, 2 avx512, 4 avx512bf16, 8 avx2.
extern "C" int kvs_cpu_paths() {
  return 1 | (kvs::cpu_has_avx512() ? 2 : 0) | (kvs::cpu_has_avx512bf16() ? 4 : 0) | (kvs::cpu_has_avx2() ? 8 : 0);
}

// Shapes, dtypes and strides are checked by the Python wrapper; the table contents are checked
// here. Returns 0, or 1 with a message in err. impl: 0 best, 1 scalar, 2 avx512, 3 avx512bf16,
// 4 avx2.
// cache_kind: 0 float32, 1 bfloat16, 2 float16, 3 int8, 4 float8 e4m3fn (3 and 4 with scales).
extern "C" int kvs_paged_decode_attention(
    const void* q, int64_t q_s0, int64_t q_s1, int q_bf16,
    const void* k, int64_t k_s0, int64_t k_s1, const void* v, int64_t v_s0, int64_t v_s1, int cache_kind,
    const float* ks, int64_t ks_s0, const float* vs, int64_t vs_s0,
    const int64_t* tables, int64_t max_blocks, const int64_t* ctx, const int64_t* sink_end, const int64_t* win_start,
    void* out, int64_t o_s0, int64_t o_s1,
    int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t num_blocks, double scale,
    int impl, int num_threads, char* err, int64_t err_len) {
  auto fail = [&](const char* fmt, int64_t a, int64_t b, int64_t c) {
    std::snprintf(err, size_t(err_len), fmt, (long long)a, (long long)b, (long long)c);
    return 1;
  };
  // Isolation: a row reads only the table entries holding positions it sees (0 .. ceil(ctx / bs)
  // - 1, less those wholly between its sinks and its window), and each must be a real block.
  for (int64_t r = 0; r < n; ++r) {
    if (ctx[r] < 0 || ctx[r] > max_blocks * block_size)
      return fail("row %lld: context length %lld out of range for a table of %lld blocks", r, ctx[r], max_blocks);
    const int64_t used = (ctx[r] + block_size - 1) / block_size;
    const int64_t s = sink_end ? std::max<int64_t>(0, std::min(sink_end[r], ctx[r])) : 0;
    const int64_t w = win_start ? std::max<int64_t>(0, std::min(win_start[r], ctx[r])) : 0;
    const int64_t gap_first = w > s ? (s + block_size - 1) / block_size : 0, gap_end = w > s ? w / block_size : 0;
    for (int64_t b = 0; b < used; ++b) {
      if (b >= gap_first && b < gap_end) continue;  // no position it sees lives in this block
      const int64_t id = tables[r * max_blocks + b];
      if (id < 0 || id >= num_blocks) return fail("row %lld: block id %lld out of range [0, %lld)", r, id, num_blocks);
    }
  }
  if ((impl == 2 && !kvs::cpu_has_avx512()) || (impl == 3 && !kvs::cpu_has_avx512bf16()) ||
      (impl == 4 && !kvs::cpu_has_avx2()) || impl < 0 || impl > 4) {
    std::snprintf(err, size_t(err_len), "code path %d is not supported by this CPU", impl);
    return 1;
  }
  if (n == 0 || H == 0 || D == 0) return 0;

  kvs::Problem P;
  P.n = n; P.H = H; P.KVH = KVH; P.G = H / KVH; P.D = D; P.bs = block_size; P.scale = float(scale);
  P.q = q; P.q_s0 = q_s0; P.q_s1 = q_s1; P.q_bf16 = q_bf16 != 0;
  P.k = k; P.v = v; P.k_s0 = k_s0; P.k_s1 = k_s1; P.v_s0 = v_s0; P.v_s1 = v_s1;
  P.ks = ks; P.vs = vs; P.ks_s0 = ks_s0; P.vs_s0 = vs_s0;
  P.tables = tables; P.tbl_s0 = max_blocks; P.ctx = ctx; P.sink_end = sink_end; P.win_start = win_start;
  P.out = out; P.o_s0 = o_s0; P.o_s1 = o_s1;

  int path = impl == 0 ? (kvs::cpu_has_avx512bf16() ? 3 : kvs::cpu_has_avx512() ? 2 : kvs::cpu_has_avx2() ? 4 : 1)
                       : impl;
  if (path == 3 && !(q_bf16 && cache_kind == 1)) path = 2;
  int64_t Dp = D;
  kvs::TaskFn fn;
  switch (cache_kind) {
    case 0: fn = kvs::pick<float>(D, path, Dp); break;
    case 1: fn = kvs::pick<uint16_t>(D, path, Dp); break;
    case 2: fn = kvs::pick<kvs::f16_t>(D, path, Dp); break;
    case 3: fn = kvs::pick<int8_t>(D, path, Dp); break;
    case 4: fn = kvs::pick<kvs::fp8_t>(D, path, Dp); break;
    default:
      std::snprintf(err, size_t(err_len), "unknown cache kind %d", cache_kind);
      return 1;
  }

  kvs::BlockFn bfn = nullptr;
  switch (cache_kind) {
    case 0: bfn = kvs::pick_block<float>(D, path); break;
    case 1: bfn = kvs::pick_block<uint16_t>(D, path); break;
    case 2: bfn = kvs::pick_block<kvs::f16_t>(D, path); break;
    case 3: bfn = kvs::pick_block<int8_t>(D, path); break;
    default: bfn = kvs::pick_block<kvs::fp8_t>(D, path); break;
  }
  // Runs of rows of one prompt chunk, cut into blocks of about kBlockQueries queries per kv head.
  // (Each row's bits are those of its own task: see block_avx512.)
  constexpr int64_t kBlockQueries = 48;
  const int64_t max_rows = std::max<int64_t>(2, kBlockQueries / P.G);
  std::vector<int64_t> starts;  // block b: rows [starts[b], starts[b + 1])
  if (bfn) {
    for (int64_t r = 0; r < n; ++r)
      if (r == 0 || r - starts.back() >= max_rows || !kvs::continues(P, r)) starts.push_back(r);
    if (int64_t(starts.size()) == n) starts.clear();  // no runs: every row its own task, as below
  }
  int64_t total = 0;
  for (int64_t r = 0; r < n; ++r) total += ctx[r];
  if (!starts.empty()) {
    const int64_t nb = int64_t(starts.size());
    starts.push_back(n);
    // Costliest blocks first (work ~ the sum of their rows' contexts), handed out dynamically.
    std::vector<int64_t> cost(nb, 0), order(nb);
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t r = starts[b]; r < starts[b + 1]; ++r) cost[b] += ctx[r];
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
    const int64_t ntasks = nb * KVH;
    int nt = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, ntasks)));
    if (total * KVH * D < (int64_t(1) << 15)) nt = 1;  // tiny: not worth waking threads
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
      kvs::Scratch S(P.G, Dp);
      kvs::BlockScratch B(max_rows * P.G, Dp);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
      for (int64_t i = 0; i < ntasks; ++i) {
        const int64_t b = order[i / KVH], r0 = starts[b], R = starts[b + 1] - r0;
        if (R == 1)
          fn(P, r0, i % KVH, S);
        else
          bfn(P, r0, R, i % KVH, B);
      }
    }
    return 0;
  }

  // Longest rows first, handed out dynamically: rows arrive sorted by length, and a static split
  // would give one thread all the long ones.
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ctx[a] > ctx[b]; });
  const int64_t ntasks = n * KVH;
  int nt = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, ntasks)));
  if (total * KVH * D < (int64_t(1) << 15)) nt = 1;  // tiny: not worth waking threads
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
  {
    kvs::Scratch S(P.G, Dp);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < ntasks; ++i) fn(P, order[i / KVH], i % KVH, S);
  }
  return 0;
}

// Causal attention of a prompt chunk from position 0 over its own keys: out[t, hq] = softmax_j<=t
// (scale * q[t, hq] . k[j, hq / G]) v[j, hq / G] for t < T, G = H / KVH. float32; q / out [T, H,
// D] and k / v [T, KVH, D] with position strides *_s0 (heads contiguous within a position);
// D % 64 == 0. Needs AVX-512 (returns 1 with a message otherwise, or on bad shapes). Tasks (KV
// head x block of 16 positions, the longest first) are shared by OpenMP threads; each output is
// computed by one task, so results do not depend on the thread count.
extern "C" int kvs_causal_prefill_attention(const float* q, int64_t q_s0, const float* k, int64_t k_s0, const float* v,
                                            int64_t v_s0, float* out, int64_t out_s0, int64_t T, int64_t H,
                                            int64_t KVH, int64_t D, double scale, int num_threads, char* err,
                                            int64_t err_len) {
#if KVS_X86
  if (!kvs::cpu_has_avx512()) {
    std::snprintf(err, size_t(err_len), "causal prefill attention needs AVX-512");
    return 1;
  }
  if (T < 0 || H <= 0 || KVH <= 0 || H % KVH != 0 || D <= 0 || D % 64 != 0) {
    std::snprintf(err, size_t(err_len), "bad shape: T=%lld H=%lld KVH=%lld D=%lld (D %% 64 == 0, H %% KVH == 0)",
                  (long long)T, (long long)H, (long long)KVH, (long long)D);
    return 1;
  }
  const kvs::CausalArgs A{q, q_s0, k, k_s0, v, v_s0, out, out_s0, T, H, KVH, D, float(scale)};
  const int64_t blocks = (T + kvs::kCausalBq - 1) / kvs::kCausalBq, ntasks = blocks * KVH;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, ntasks)));
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
  {
    kvs::CausalScratch W(kvs::kCausalBq * (H / KVH), D);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < ntasks; ++i) {
      const int64_t b = blocks - 1 - i / KVH;  // the longest blocks first
      kvs::causal_block(A, i % KVH, b * kvs::kCausalBq, std::min(T, (b + 1) * kvs::kCausalBq), W);
    }
  }
  return 0;
#else
  std::snprintf(err, size_t(err_len), "causal prefill attention needs an x86-64 CPU with AVX-512");
  return 1;
#endif
}
