// Every layer of a decode step in one call: the decoder stack of a Llama-family or Gemma 3 model
// for a batch of decode rows (one new token per sequence), on kvshare's own kernels.
//
// Why: at batch 1 a 30-layer model issues ~450 small PyTorch ops and ~150 kernel calls per
// token; each costs 5-50 us of dispatch and Python, together about as much as the matmuls.
// Here the same arithmetic runs without leaving C++: per layer RMSNorm, the fused q/k/v matmul
// (+ bias), the per-head q/k RMSNorm (Qwen3, Gemma 3), RoPE on q and k (Gemma 3: the layer's own
// table, local or global), the K/V write into the paged cache, paged attention over each row's
// visible keys in that layer, the output projection (Gemma: normalized) and residual, RMSNorm,
// the fused gate/up matmul, SiLU (Gemma: GELU-tanh) x up, down (Gemma: normalized) and residual.
// Rows under a LoRA adapter get its delta after each target linear (see "LoRA adapters" below).
//
// This file is built as one translation unit after qmatmul.cpp and paged_attention.cpp (the
// library's sources are concatenated in that order; see cpu_kernels.DECODE), so the matmuls
// are qmm::group_matmul and the attention is kvs_paged_decode_attention, the very kernels the
// step-by-step path calls: the two paths differ only in the element-wise ops' rounding.
//
// Activations: float32, or bfloat16 (act_bf16). With bfloat16 the arithmetic is float32 and every
// intermediate is rounded to bfloat16 exactly where the step-by-step PyTorch path rounds it (each
// op's output, as torch computes a bfloat16 op in float32 and rounds once), and attention reads
// bfloat16 queries as it does there: so a decode row gets nearly the same numbers whichever path
// its step takes. What differs is float32's last bit in the norm's sum (summed in double here, in
// 16 lanes in a fixed order; in torch's vectorized order there) and in SiLU's exp (a polynomial of
// our own here, torch's there; GELU-tanh's tanh is written through that exp), which now and then
// flips a bfloat16 rounding.
//
// Rows: with token rows (the default mode's rows) a prompt's rows come here too, M up to thousands; a row's
// values never depend on M, its neighbours or the thread count (see "The element-wise work").
//
// Scope (the Python side, kvshare/model/fused_decode.py, sends nothing else here): float32 or
// bfloat16 activations (hidden state, norms and biases handed over as float32); weights as
// int8-group or int4-group codes; a float32 or bfloat16 KV cache; every row a decode row, each
// layer with its own view of the rows (LayerRows: with KV cache groups a group's own slots and
// block tables, with windows each row's visible range in that layer).
// Everything else takes the step-by-step path.

#include <memory>

namespace dec {

struct Linear {
  // 1: int8 codes [N, K]; 2: 4-bit codes two per byte [N, K / 2]; 3 / 4: the same in VNNI blocks;
  // 6 / 7: in VNNI blocks with compact scales and zeros (qmatmul.cpp, kLayoutCompact), 8 / 9: with
  // float16 ones (kLayoutHalf); 5: row blocks kept at their own formats (a Q4_K_M file's Q4_K q/k and Q6_K v), `parts` in
  // output order, each writing its own columns of the one output row; 10 to 19: codes kept at the
  // file's bits in VNNI blocks (IQ4_XS, Q6_K, the 5-bit formats: see `linear`).
  int64_t kind;
  const void* q;
  const float* scales;  // [N, K / group] (kinds 6 to 9: compact or float16, as bytes)
  const float* zeros;   // [N, K / group] or null
  const float* bias;    // [N] or null
  int64_t N, K, group;
  const Linear* parts;  // kind 5
  int64_t num_parts;
  double zero_mul;  // kinds 8 / 9 without zeros: each zero is its scale times this (Q4_0: -8)
};

struct Layer {
  const float* in_norm;    // [hidden]
  const float* post_norm;  // [hidden]
  Linear qkv, o, gate_up, down;
  void* k_cache;  // [kv_heads, slots, head_dim], slot stride head_dim, head stride slots * head_dim
  void* v_cache;
  // [heads + kv_heads, head_dim] or null: each q and k head RMS-normalized before RoPE (Qwen3's
  // q_norm / k_norm, one weight row per head), with the model's norm rounding.
  const float* qk_norm;
  int64_t rope_table;  // which of the call's RoPE tables rotates this layer (Gemma 3: local or global)
  // [hidden] or null: Gemma normalizes the attention block's and the MLP's output (o's, down's)
  // before it joins the residual stream.
  const float* attn_out_norm;
  const float* mlp_out_norm;
};

// One layer's view of a call's rows: where each row's K and V go and which keys it reads. Layers
// that attend alike share one view's arrays; with KV cache groups each group has its own slots and
// tables, and a windowed layer (Mistral, Qwen2, Phi-3, Gemma's local layers, attention sinks) its
// rows' visible ranges, as kvs_paged_decode_attention takes them.
struct LayerRows {
  const int64_t* slots;      // [M]
  const int64_t* tables;     // [M, max_blocks]
  int64_t max_blocks;
  const int64_t* ctx;        // [M] keys per row, its own new one included
  const int64_t* sink_end;   // [M] or null: row r sees [0, sink_end) and [win_start, ctx) only
  const int64_t* win_start;  // [M] or null (both null, or win_start <= sink_end: every key)
};

static bool same_rows(const LayerRows& a, const LayerRows& b) {
  return a.slots == b.slots && a.tables == b.tables && a.max_blocks == b.max_blocks && a.ctx == b.ctx &&
         a.sink_end == b.sink_end && a.win_start == b.win_start;
}

struct Model {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
  int64_t slots;       // cache slots per layer (num_blocks * block_size)
  int64_t block_size;
  int64_t cache_kind;  // 0 float32, 1 bfloat16
  int64_t act_bf16;    // 1: round as bfloat16 activations do (see the top)
  double eps, scale;
  const Layer* layers;
  ShmComm* comm;  // tensor parallel (shm_collectives.cpp): o's and down's outputs are all-reduced; null: one rank
  int64_t portable;  // 1: the scalar element-wise code even where AVX-512 runs (tests: both give the same bits)
  int64_t norm_once;  // 1: Gemma's RMSNorm (float32 throughout, rounded to bfloat16 once); 0: Llama's (see norm_row_s)
  int64_t gelu_tanh;  // 1: the MLP's gate is GELU, tanh approximation (Gemma); 0: SiLU
  // RoPE turns the first rope_dims of each head (a partial rotary embedding, Phi-4-mini's 0.75:
  // the rotate-half over those dims only); the rest pass through, as RotaryEmbedding.rotate does.
  int64_t rope_dims;
};

// ---- The element-wise work, one row at a time ---------------------------------------------------
//
// Every row of a call is a row of its own (with token rows a prompt's rows come here too, M up to
// thousands), so its values must not depend on M, on its neighbours, or on which thread took it:
// each function below computes one row from that row alone, with the same operations in the same
// order whatever the row's index, and rows are spread over threads whole (for_rows).
//
// Each comes twice: an AVX-512 version and a portable scalar one, which compute THE SAME VALUES
// (tests/test_fused_decode.py checks it bitwise): the same IEEE operations per element in the same
// order. Hence: a row's tail is done with masked vector ops (the same formula on fewer lanes), the
// norm's sum goes into 16 double lanes in a fixed order in both, exp is one polynomial of our own
// (dec::exp_s / exp_v, not std::exp), and the vector code multiplies and adds with the *_round_*
// intrinsics, which GCC never contracts into an FMA (it may contract _mm512_mul_ps +
// _mm512_add_ps, which would round once where the scalar code rounds twice). The scalar code has
// no FMA to contract into: the library is built without -march (kernels/build.py).

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DEC_X86 1
#define DEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define DEC_INLINE inline __attribute__((always_inline))
#else
#define DEC_X86 0
#endif

// Rows per call from which the element-wise passes are spread over the threads (whole rows per
// thread; only speed depends on it). Measured on the quiet 2-core machine, cpu_decode.py's
// 512-token prompt, three alternations: 2436-2556 prompt tok/s with 64 against 2255-2312 with the
// passes on one thread (+10%); a decode step (M = 1) never pays the fork/joins. (On a machine
// loaded ~10 deep the extra fork/joins cost more than they saved.)
constexpr int64_t kParallelRows = 64;

template <class F>
static void for_rows(int64_t M, int num_threads, const F& f) {
  if (num_threads > 1 && M >= kParallelRows) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < M; ++r) f(r);
  } else {
    for (int64_t r = 0; r < M; ++r) f(r);
  }
}

static bool has_avx512() {
#if DEC_X86
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
#else
  return false;
#endif
}

// exp's constants (Cephes' expf): x = n ln2 + r with ln2 split in two so n * kC1 is exact.
constexpr float kLog2e = 1.44269504088896341f, kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
// x is clamped to +-87 so that 2^n (|n| <= 126) is a normal float built from its bits in both
// versions: exp(-87) is far below what 1 + exp(-x) or a bfloat16 SiLU output can resolve.
constexpr float kExpLimit = 87.f;

// _mm512_max_ps / _mm512_min_ps semantics (the second operand when either is NaN).
static inline float max_s(float a, float b) { return a > b ? a : b; }
static inline float min_s(float a, float b) { return a < b ? a : b; }

// Round to bfloat16 and back (what storing a float32 result in a bfloat16 tensor does).
static inline float rb(float f) { return qmm::bf16_to_f32(qmm::f32_to_bf16(f)); }

static inline float exp_s(float x) {
  x = min_s(max_s(x, -kExpLimit), kExpLimit);
  const float n = std::nearbyint(x * kLog2e);  // to nearest even, as roundscale below
  float r = x - n * kC1;
  r = r - n * kC2;
  float p = kP0;
  p = p * r + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  const float r2 = r * r;
  p = p * r2 + (r + 1.f);
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Scalar versions (the reference; the AVX-512 ones below mirror them op for op).

// Sum of squares of r[0..D) in double, element d in lane d % 16, lanes folded 16 -> 8 -> 4 -> 2 -> 1
// (each product is exact in double; only the additions round, in this fixed order).
static double sum_squares_s(const float* r, int64_t D) {
  double acc[16] = {0};
  for (int64_t d = 0; d < D; ++d) acc[d % 16] += double(r[d]) * double(r[d]);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) acc[i] = acc[i] + acc[i + w];
  return acc[0];
}

static inline float inv_rms(double ss, int64_t D, double eps) { return float(1.0 / std::sqrt(ss / double(D) + eps)); }

// float32: x * inv * w (F.rms_norm). bfloat16: the normalized row is rounded, then multiplied by
// the weight and rounded again (layers.rms_norm's two ops); with `once` (Gemma, ops.norm_f32:
// F.rms_norm in float32, then cast) x * inv * w rounded once.
static void norm_row_s(const float* r, const float* w, int64_t D, double eps, float* o, bool bf, bool once) {
  const float inv = inv_rms(sum_squares_s(r, D), D, eps);
  for (int64_t d = 0; d < D; ++d)
    o[d] = !bf ? r[d] * inv * w[d] : once ? rb(r[d] * inv * w[d]) : rb(w[d] * rb(r[d] * inv));
}

// A linear's output row y [N]: rounded as its output tensor (bfloat16), plus the bias (rounded).
static void out_row_s(float* y, const float* bias, int64_t N, bool bf) {
  for (int64_t n = 0; n < N; ++n) {
    float v = bf ? rb(y[n]) : y[n];
    if (bias != nullptr) v = bf ? rb(v + bias[n]) : v + bias[n];
    y[n] = v;
  }
}

// x [D] <- x * cos + rotate_half(x) * signed_sin (the sign of rotate_half folded into sin);
// bfloat16: x * cos rounded, then the addcmul rounded (RotaryEmbedding.rotate's two ops).
static void rope_s(float* x, const float* cos, const float* ssin, int64_t D, bool bf) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d], b = x[d + half];
    const float lo = bf ? rb(rb(a * cos[d]) + b * ssin[d]) : a * cos[d] + b * ssin[d];
    const float hi = bf ? rb(rb(b * cos[d + half]) + a * ssin[d + half]) : b * cos[d + half] + a * ssin[d + half];
    x[d] = lo;
    x[d + half] = hi;
  }
}

static void to_bf16_s(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = qmm::f32_to_bf16(x[i]);
}

static void widen_s(const uint16_t* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = qmm::bf16_to_f32(x[i]);
}

// h += y (y rounded first: the linear's output tensor; bfloat16: the sum rounded too).
static void residual_s(float* h, const float* y, int64_t n, bool bf) {
  for (int64_t i = 0; i < n; ++i) h[i] = bf ? rb(h[i] + rb(y[i])) : h[i] + y[i];
}

// GELU, tanh approximation: 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), written
// as x / (1 + exp(-2 u)) (the same function: 1 + tanh(u) = 2 / (1 + exp(-2 u))) so that it takes
// the same exp as SiLU; -2 sqrt(2 / pi) is one constant.
constexpr float kGeluKappa = 0.044715f, kGeluNeg2Beta = -1.5957691216057308f;

// a = act(gate) * up from the gate_up output row g [2 I], act SiLU or (gelu) GELU-tanh;
// bfloat16: gate and up rounded (the matmul's output), the activation's output rounded, the
// product rounded.
static void act_row_s(const float* g, int64_t I, float* a, bool bf, bool gelu) {
  for (int64_t i = 0; i < I; ++i) {
    const float gate = bf ? rb(g[i]) : g[i], up = bf ? rb(g[I + i]) : g[I + i];
    const float e = gelu ? exp_s(kGeluNeg2Beta * (gate + kGeluKappa * (gate * gate * gate))) : exp_s(-gate);
    const float s = gate / (1.f + e);
    a[i] = bf ? rb(rb(s) * up) : s * up;
  }
}

#if DEC_X86
// AVX-512 versions. The *_round_* forms with _MM_FROUND_CUR_DIRECTION are the plain instructions
// (MXCSR's rounding, as the scalar code), kept out of GCC's FMA contraction.
#define DEC_CUR _MM_FROUND_CUR_DIRECTION
DEC_AVX512 static DEC_INLINE __m512 vmul(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, DEC_CUR); }
DEC_AVX512 static DEC_INLINE __m512 vadd(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, DEC_CUR); }
DEC_AVX512 static DEC_INLINE __m512 vsub(__m512 a, __m512 b) { return _mm512_sub_round_ps(a, b, DEC_CUR); }
DEC_AVX512 static DEC_INLINE __m512 vdiv(__m512 a, __m512 b) { return _mm512_div_round_ps(a, b, DEC_CUR); }
DEC_AVX512 static DEC_INLINE __m512 vset(float f) { return _mm512_set1_ps(f); }

static inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1);
}
DEC_AVX512 static DEC_INLINE __m512 vload(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
DEC_AVX512 static DEC_INLINE void vstore(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }

// qmm::f32_to_bf16's bits (round to nearest even; NaN -> 0x7fc0), in the upper half of each lane.
DEC_AVX512 static DEC_INLINE __m512i bf16_bits_hi(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(int32_t(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}
DEC_AVX512 static DEC_INLINE __m512 vrb(__m512 x) { return _mm512_castsi512_ps(bf16_bits_hi(x)); }
DEC_AVX512 static DEC_INLINE void store_bf16(uint16_t* p, __m512 x, __mmask16 k) {
  _mm512_mask_cvtepi32_storeu_epi16(p, k, _mm512_srli_epi32(bf16_bits_hi(x), 16));
}

DEC_AVX512 static DEC_INLINE __m512 exp_v(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, vset(-kExpLimit)), vset(kExpLimit));
  const __m512 n = _mm512_roundscale_ps(vmul(x, vset(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = vsub(x, vmul(n, vset(kC1)));
  r = vsub(r, vmul(n, vset(kC2)));
  __m512 p = vset(kP0);
  p = vadd(vmul(p, r), vset(kP1));
  p = vadd(vmul(p, r), vset(kP2));
  p = vadd(vmul(p, r), vset(kP3));
  p = vadd(vmul(p, r), vset(kP4));
  p = vadd(vmul(p, r), vset(kP5));
  const __m512 r2 = vmul(r, r);
  p = vadd(vmul(p, r2), vadd(r, vset(1.f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return vmul(p, _mm512_castsi512_ps(bits));
}

// Lane d % 16 of two double accumulators (0-7, 8-15); masked-off tail lanes add exact zeros.
// (Contraction into an FMA would not change a bit here: each product is exact in double.)
DEC_AVX512 static double sum_squares_v(const float* r, int64_t D) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 x = vload(r + d, tail_mask(D - d));
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    a0 = _mm512_add_pd(a0, _mm512_mul_pd(lo, lo));
    a1 = _mm512_add_pd(a1, _mm512_mul_pd(hi, hi));
  }
  const __m512d s8 = _mm512_add_pd(a0, a1);
  const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
  const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}

DEC_AVX512 static void norm_row_v(const float* r, const float* w, int64_t D, double eps, float* o, bool bf,
                                  bool once) {
  const __m512 inv = vset(inv_rms(sum_squares_v(r, D), D, eps));
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 k = tail_mask(D - d);
    const __m512 x = vload(r + d, k), wv = vload(w + d, k);
    vstore(o + d, !bf ? vmul(vmul(x, inv), wv) : once ? vrb(vmul(vmul(x, inv), wv)) : vrb(vmul(wv, vrb(vmul(x, inv)))),
           k);
  }
}

DEC_AVX512 static void out_row_v(float* y, const float* bias, int64_t N, bool bf) {
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 k = tail_mask(N - n);
    __m512 v = vload(y + n, k);
    if (bf) v = vrb(v);
    if (bias != nullptr) {
      v = vadd(v, vload(bias + n, k));
      if (bf) v = vrb(v);
    }
    vstore(y + n, v, k);
  }
}

DEC_AVX512 static void rope_v(float* x, const float* cos, const float* ssin, int64_t D, bool bf) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; d += 16) {
    const __mmask16 k = tail_mask(half - d);
    const __m512 a = vload(x + d, k), b = vload(x + d + half, k);
    const __m512 cl = vload(cos + d, k), sl = vload(ssin + d, k), ch = vload(cos + d + half, k),
                 sh = vload(ssin + d + half, k);
    __m512 lo, hi;
    if (bf) {
      lo = vrb(vadd(vrb(vmul(a, cl)), vmul(b, sl)));
      hi = vrb(vadd(vrb(vmul(b, ch)), vmul(a, sh)));
    } else {
      lo = vadd(vmul(a, cl), vmul(b, sl));
      hi = vadd(vmul(b, ch), vmul(a, sh));
    }
    vstore(x + d, lo, k);
    vstore(x + d + half, hi, k);
  }
}

DEC_AVX512 static void to_bf16_v(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    store_bf16(out + i, vload(x + i, k), k);
  }
}

DEC_AVX512 static void widen_v(const uint16_t* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, x + i));
    vstore(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)), k);
  }
}

DEC_AVX512 static void residual_v(float* h, const float* y, int64_t n, bool bf) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 hv = vload(h + i, k), yv = vload(y + i, k);
    vstore(h + i, bf ? vrb(vadd(hv, vrb(yv))) : vadd(hv, yv), k);
  }
}

DEC_AVX512 static void act_row_v(const float* g, int64_t I, float* a, bool bf, bool gelu) {
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 k = tail_mask(I - i);
    __m512 gate = vload(g + i, k), up = vload(g + I + i, k);
    if (bf) gate = vrb(gate), up = vrb(up);
    __m512 arg;
    if (gelu) {
      const __m512 cube = vmul(vmul(gate, gate), gate);
      arg = vmul(vset(kGeluNeg2Beta), vadd(gate, vmul(vset(kGeluKappa), cube)));
    } else {
      arg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gate), _mm512_set1_epi32(int32_t(0x80000000u))));
    }
    const __m512 s = vdiv(gate, vadd(vset(1.f), exp_v(arg)));
    vstore(a + i, bf ? vrb(vmul(vrb(s), up)) : vmul(s, up), k);
  }
}
#undef DEC_CUR
#endif  // DEC_X86

// One version or the other for a whole call (simd: AVX-512 present and not turned off).
struct Ops {
  bool simd;
  bool norm_once;  // Model::norm_once
  bool gelu;       // Model::gelu_tanh
#if DEC_X86
#define DEC_PICK(name, ...) (simd ? name##_v(__VA_ARGS__) : name##_s(__VA_ARGS__))
#else
#define DEC_PICK(name, ...) name##_s(__VA_ARGS__)
#endif
  void norm_row(const float* r, const float* w, int64_t D, double eps, float* o, bool bf) const {
    DEC_PICK(norm_row, r, w, D, eps, o, bf, norm_once);
  }
  void out_row(float* y, const float* bias, int64_t N, bool bf) const { DEC_PICK(out_row, y, bias, N, bf); }
  void rope(float* x, const float* cos, const float* ssin, int64_t D, bool bf) const {
    DEC_PICK(rope, x, cos, ssin, D, bf);
  }
  void to_bf16(const float* x, int64_t n, uint16_t* out) const { DEC_PICK(to_bf16, x, n, out); }
  void widen(const uint16_t* x, int64_t n, float* out) const { DEC_PICK(widen, x, n, out); }
  void residual(float* h, const float* y, int64_t n, bool bf) const { DEC_PICK(residual, h, y, n, bf); }
  void act_row(const float* g, int64_t I, float* a, bool bf) const { DEC_PICK(act_row, g, I, a, bf, gelu); }
#undef DEC_PICK
};

// ---- LoRA adapters (kvshare/model/lora.py) -----------------------------------------------------
//
// A row under an adapter gets, after each target linear, y += scale * (x A^T) B^T for each module
// of that linear's site (q, k, v of qkv; o; gate, up of gate_up; down). The same function serves
// the fused step and the step-by-step path (kvs_lora_apply), so an adapter row's delta is the same
// bits on either, and, being computed from the row alone in a fixed order (below), whatever shares
// its step. A step's rows may each use another adapter (or none).

constexpr int64_t kLoraModules = 7;  // q k v o gate up down, in this order per layer
constexpr int64_t kLoraMaxRank = 512;
enum LoraSite : int64_t { kSiteQkv = 0, kSiteO = 3, kSiteGateUp = 4, kSiteDown = 6 };  // first module

struct LoraModule {
  const float* a;   // [rank, K] (A) or null: the adapter does not target this module
  const float* bt;  // [rank, N] (B transposed)
};

struct LoraAdapter {
  const LoraModule* modules;  // [num_layers * kLoraModules]
  int64_t num_layers, rank;
  double scale;  // rounded to float32 where it multiplies
};

struct LoraRows {
  const LoraAdapter* adapters;
  int64_t num_adapters;
  const int64_t* row_adapter;  // [M]: the row's adapter index, or -1 for none
};

// dot(x, a) over K: element k into float lane k % 16 (a product rounded, then added), the lanes
// folded 16 -> 8 -> 4 -> 2 -> 1; the same order in both versions.
static float lora_dot_s(const float* x, const float* a, int64_t K) {
  float acc[16] = {0};
  for (int64_t k = 0; k < K; ++k) acc[k % 16] = acc[k % 16] + x[k] * a[k];
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) acc[i] = acc[i] + acc[i + w];
  return acc[0];
}

// y[n] += scale * sum_j t[j] * bt[j][n] (j in order from 0), the delta rounded as the
// step-by-step path's tensors are (bfloat16: the delta, then the sum).
static void lora_add_s(const float* t, const float* bt, int64_t rank, int64_t N, float scale, float* y, bool bf) {
  for (int64_t n = 0; n < N; ++n) {
    float d = t[0] * bt[n];
    for (int64_t j = 1; j < rank; ++j) d = d + t[j] * bt[j * N + n];
    d = d * scale;
    y[n] = bf ? rb(y[n] + rb(d)) : y[n] + d;
  }
}

#if DEC_X86
#define DEC_CUR _MM_FROUND_CUR_DIRECTION
DEC_AVX512 static float lora_dot_v(const float* x, const float* a, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail_mask(K - k);  // masked-off lanes add +0 to their partial sums: no change
    acc = _mm512_add_round_ps(acc, _mm512_mul_round_ps(vload(x + k, m), vload(a + k, m), DEC_CUR), DEC_CUR);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) lanes[i] = lanes[i] + lanes[i + w];
  return lanes[0];
}

DEC_AVX512 static void lora_add_v(const float* t, const float* bt, int64_t rank, int64_t N, float scale, float* y,
                                  bool bf) {
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 m = tail_mask(N - n);
    __m512 d = _mm512_mul_round_ps(vset(t[0]), vload(bt + n, m), DEC_CUR);
    for (int64_t j = 1; j < rank; ++j)
      d = _mm512_add_round_ps(d, _mm512_mul_round_ps(vset(t[j]), vload(bt + j * N + n, m), DEC_CUR), DEC_CUR);
    d = _mm512_mul_round_ps(d, vset(scale), DEC_CUR);
    const __m512 yv = vload(y + n, m);
    vstore(y + n, bf ? vrb(_mm512_add_round_ps(yv, vrb(d), DEC_CUR)) : _mm512_add_round_ps(yv, d, DEC_CUR), m);
  }
}
#undef DEC_CUR
#endif  // DEC_X86

// One row's delta over one site: modules [first, first + num_modules) of `layer`, module i writing
// the `widths[i]` outputs after those of the modules before it. y: the linear's output row, already
// rounded as its tensor (and its bias added).
static void lora_row(bool simd, const LoraAdapter& ad, int64_t layer, int64_t first, const int64_t* widths,
                     int64_t num_modules, const float* x, int64_t K, float* y, bool bf) {
  float t[kLoraMaxRank];
  const float scale = float(ad.scale);
  int64_t col = 0;
  for (int64_t i = 0; i < num_modules; ++i) {
    const LoraModule& mod = ad.modules[layer * kLoraModules + first + i];
    if (mod.a != nullptr) {
#if DEC_X86
      if (simd) {
        for (int64_t j = 0; j < ad.rank; ++j) t[j] = lora_dot_v(x, mod.a + j * K, K);
        lora_add_v(t, mod.bt, ad.rank, widths[i], scale, y + col, bf);
        col += widths[i];
        continue;
      }
#endif
      for (int64_t j = 0; j < ad.rank; ++j) t[j] = lora_dot_s(x, mod.a + j * K, K);
      lora_add_s(t, mod.bt, ad.rank, widths[i], scale, y + col, bf);
    }
    col += widths[i];
  }
}

// Whether a call's adapters are usable: every row's index in range, every rank in (0, kLoraMaxRank].
static int check_lora(const LoraRows& lr, int64_t M, int64_t num_layers, char* err, int64_t err_len) {
  for (int64_t i = 0; i < lr.num_adapters; ++i) {
    const LoraAdapter& ad = lr.adapters[i];
    if (ad.rank < 1 || ad.rank > kLoraMaxRank || ad.num_layers != num_layers) {
      std::snprintf(err, size_t(err_len), "adapter %lld: rank %lld over %lld layers (allowed: rank 1..%lld, %lld layers)",
                    (long long)i, (long long)ad.rank, (long long)ad.num_layers, (long long)kLoraMaxRank,
                    (long long)num_layers);
      return 1;
    }
  }
  for (int64_t r = 0; r < M; ++r)
    if (lr.row_adapter[r] < -1 || lr.row_adapter[r] >= lr.num_adapters) {
      std::snprintf(err, size_t(err_len), "row %lld: adapter index %lld out of range [-1, %lld)", (long long)r,
                    (long long)lr.row_adapter[r], (long long)lr.num_adapters);
      return 1;
    }
  return 0;
}

// Row r's delta over a site, when the row has an adapter (lr may be null: no adapters in the call).
// y: the linear's raw output row [N]; rounded first as its tensor is (the delta is added to that).
static inline void lora_site(const Ops& ops, const LoraRows* lr, int64_t r, int64_t layer, int64_t first,
                             const int64_t* widths, int64_t num_modules, const float* x, int64_t K, float* y,
                             int64_t N, bool bf) {
  if (lr == nullptr || lr->row_adapter[r] < 0) return;
  ops.out_row(y, nullptr, N, bf);
  lora_row(ops.simd, lr->adapters[lr->row_adapter[r]], layer, first, widths, num_modules, x, K, y, bf);
}

// y [M, y_stride]: the output's row stride (the whole stacked width for a row block).
static int linear(const Linear& L, const float* x, int64_t M, float* y, int num_threads, char* err, int64_t err_len,
                  int64_t y_stride = -1) {
  if (y_stride < 0) y_stride = L.N;
  if (L.kind == 5) {  // each block writes its columns; a row's outputs are what each block gives it alone
    int64_t col = 0;
    for (int64_t p = 0; p < L.num_parts; ++p) {
      const Linear& part = L.parts[p];
      if (part.kind == 5 || part.K != L.K || col + part.N > L.N) {
        std::snprintf(err, size_t(err_len), "row block %lld does not fit its stacked linear", (long long)p);
        return 1;
      }
      if (linear(part, x, M, y + col, num_threads, err, err_len, y_stride)) return 1;
      col += part.N;
    }
    if (col != L.N) {
      std::snprintf(err, size_t(err_len), "row blocks cover %lld of %lld outputs", (long long)col, (long long)L.N);
      return 1;
    }
    return 0;
  }
  int rc;
  if (L.kind < 1 || L.kind > 19) {
    std::snprintf(err, size_t(err_len), "unknown linear kind %lld", (long long)L.kind);
    return 1;
  }
  // Kinds 10 / 11: IQ4_XS's 4-bit table indices (qmatmul.cpp NL4) in VNNI blocks, with float32 /
  // compact scales; 12 / 13: Q6_K's 4-bit and 2-bit planes (I6) likewise; 14 / 15 / 16: the
  // unsigned 5-bit codes' 4-bit and 1-bit planes (I5: Q5_1, Q5_K) with float32 / compact /
  // float16 scales, 17 / 18 / 19: Q5_0's signed ones (I5S) likewise.
  if (L.kind >= 14) {
    const int64_t form = (L.kind - 14) % 3;
    const int layout = form == 0 ? qmm::kLayoutBlocks : form == 1 ? qmm::kLayoutCompact : qmm::kLayoutHalf;
    const auto* q = static_cast<const uint8_t*>(L.q);
    if (L.kind >= 17)
      return qmm::group_matmul<qmm::I5S>(x, L.K, 0, q, L.scales, L.zeros, y, y_stride, M, L.N, L.K, L.group, 0,
                                         num_threads, err, err_len, layout, float(L.zero_mul));
    return qmm::group_matmul<qmm::I5>(x, L.K, 0, q, L.scales, L.zeros, y, y_stride, M, L.N, L.K, L.group, 0,
                                      num_threads, err, err_len, layout, float(L.zero_mul));
  }
  if (L.kind >= 12)
    return qmm::group_matmul<qmm::I6>(x, L.K, 0, static_cast<const uint8_t*>(L.q), L.scales, L.zeros, y, y_stride,
                                      M, L.N, L.K, L.group, 0, num_threads, err, err_len,
                                      L.kind == 13 ? qmm::kLayoutCompact : qmm::kLayoutBlocks, float(L.zero_mul));
  if (L.kind >= 10)
    return qmm::group_matmul<qmm::NL4>(x, L.K, 0, static_cast<const uint8_t*>(L.q), L.scales, L.zeros, y, y_stride,
                                       M, L.N, L.K, L.group, 0, num_threads, err, err_len,
                                       L.kind == 11 ? qmm::kLayoutCompact : qmm::kLayoutBlocks, float(L.zero_mul));
  // (qmatmul.cpp's layouts: rows, "VNNI blocks", compact scales)
  const int layout = L.kind >= 8   ? qmm::kLayoutHalf
                     : L.kind >= 6 ? qmm::kLayoutCompact
                     : L.kind >= 3 ? qmm::kLayoutBlocks
                                   : qmm::kLayoutRows;
  if (L.kind == 1 || L.kind == 3 || L.kind == 6 || L.kind == 8)  // int8 codes (2, 4, 7, 9: 4-bit)
    rc = qmm::group_matmul<qmm::I8>(x, L.K, 0, static_cast<const uint8_t*>(L.q), L.scales, L.zeros, y, y_stride, M,
                                    L.N, L.K, L.group, 0, num_threads, err, err_len, layout, float(L.zero_mul));
  else
    rc = qmm::group_matmul<qmm::U4>(x, L.K, 0, static_cast<const uint8_t*>(L.q), L.scales, L.zeros, y, y_stride, M,
                                    L.N, L.K, L.group, 0, num_threads, err, err_len, layout, float(L.zero_mul));
  return rc;  // the output's rounding and the bias: out_row, per row
}

// A linear's output row y [N] normalized in place when the layer has a norm there (Gemma's
// post-attention / post-feed-forward norms): rounded first as the linear's output tensor is.
static void out_norm(const Ops& ops, float* y, const float* w, int64_t N, double eps, bool bf) {
  if (w == nullptr) return;
  ops.out_row(y, nullptr, N, bf);
  ops.norm_row(y, w, N, eps, y, bf);
}

// One row's K or V heads [KVH, D] into its slot.
static void write_kv(const Ops& ops, void* cache, int64_t kind, int64_t slots_per_head, int64_t D, int64_t KVH,
                     int64_t slot, const float* src) {
  for (int64_t g = 0; g < KVH; ++g) {
    const int64_t off = g * slots_per_head * D + slot * D;
    if (kind == 0)
      std::memcpy(static_cast<float*>(cache) + off, src + g * D, size_t(D) * sizeof(float));
    else
      ops.to_bf16(src + g * D, D, static_cast<uint16_t*>(cache) + off);
  }
}

// Tensor parallel: y [n] (a row-parallel linear's partial output, bfloat16 values when bf) becomes
// the sum over ranks, exchanged in the dtype the step-by-step path's tensor has.
static int all_reduce(const Ops& ops, ShmComm* comm, float* y, int64_t n, bool bf, std::vector<uint16_t>& y16,
                      char* err, int64_t err_len) {
  if (comm == nullptr) return 0;
  if (!bf) return kvs_shm_allreduce_comm(comm, y, n, 0, err, err_len);
  y16.resize(size_t(n));
  ops.to_bf16(y, n, y16.data());  // y unrounded: converting rounds it as rounding first would
  if (kvs_shm_allreduce_comm(comm, y16.data(), n, 1, err, err_len)) return 1;
  ops.widen(y16.data(), n, y);
  return 0;
}

// Whether every index of one layer's view is in range: each row writes only a real slot and reads
// only real blocks of its own table, those holding positions it sees (kvs_paged_decode_attention's
// rule; a block wholly between its sinks and its window may be released, its entry never read).
static int check_rows(const LayerRows& R, int64_t M, int64_t slots, int64_t block_size, int64_t li, char* err,
                      int64_t err_len) {
  const int64_t num_blocks = slots / block_size;
  for (int64_t r = 0; r < M; ++r) {
    if (R.slots[r] < 0 || R.slots[r] >= slots) {
      std::snprintf(err, size_t(err_len), "layer %lld row %lld: slot %lld out of range [0, %lld)", (long long)li,
                    (long long)r, (long long)R.slots[r], (long long)slots);
      return 1;
    }
    const int64_t c = R.ctx[r];
    if (c < 1 || c > R.max_blocks * block_size) {
      std::snprintf(err, size_t(err_len),
                    "layer %lld row %lld: context length %lld out of range for a table of %lld blocks", (long long)li,
                    (long long)r, (long long)c, (long long)R.max_blocks);
      return 1;
    }
    const int64_t s = R.sink_end ? std::max<int64_t>(0, std::min(R.sink_end[r], c)) : 0;
    const int64_t w = R.win_start ? std::max<int64_t>(0, std::min(R.win_start[r], c)) : 0;
    const int64_t gap_first = w > s ? (s + block_size - 1) / block_size : 0, gap_end = w > s ? w / block_size : 0;
    const int64_t used = (c + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      if (b >= gap_first && b < gap_end) continue;
      const int64_t id = R.tables[r * R.max_blocks + b];
      if (id < 0 || id >= num_blocks) {
        std::snprintf(err, size_t(err_len), "layer %lld row %lld: block id %lld out of range [0, %lld)",
                      (long long)li, (long long)r, (long long)id, (long long)num_blocks);
        return 1;
      }
    }
  }
  return 0;
}

}  // namespace dec

// h [M, hidden] float32 (with act_bf16, values a bfloat16 holds): the embedded tokens in, the last layer's output (before the final
// norm) out. cos, ssin [tables, M, rope_dims]: each RoPE table's rows for each row's position (sin
// signed as RotaryEmbedding.tables gives it; a layer reads table rope_table). rows [num_layers]:
// each layer's view of the rows (LayerRows). lora: the rows' adapters, or null (none).
// Returns 0, or 1 with a message in err (nothing is written to the cache when an index is bad).
extern "C" int kvs_decode_layers(const dec::Model* mp, float* h, int64_t M, const float* cos, const float* ssin,
                                 const dec::LayerRows* rows, const dec::LoraRows* lora, int num_threads, char* err,
                                 int64_t err_len) {
  const dec::Model& m = *mp;
  const int64_t E = m.hidden, H = m.heads, KVH = m.kv_heads, D = m.head_dim, I = m.intermediate;
  const int64_t qs = H * D, kvs_ = KVH * D, qkv_n = qs + 2 * kvs_;
  if (m.cache_kind != 0 && m.cache_kind != 1) {
    std::snprintf(err, size_t(err_len), "cache kind %lld is not supported here", (long long)m.cache_kind);
    return 1;
  }
  if (m.rope_dims < 2 || m.rope_dims > D || m.rope_dims % 2) {
    std::snprintf(err, size_t(err_len), "rope_dims %lld is not an even number in [2, head_dim %lld]",
                  (long long)m.rope_dims, (long long)D);
    return 1;
  }
  if (M <= 0) return 0;
  if (lora != nullptr) {
    if (m.comm != nullptr) {
      std::snprintf(err, size_t(err_len), "LoRA adapters are not served under tensor parallelism");
      return 1;
    }
    if (dec::check_lora(*lora, M, m.num_layers, err, err_len)) return 1;
  }
  // Isolation checks once, before anything is written, on every distinct layer view (paged
  // attention checks the tables again per layer).
  const int64_t num_blocks = m.slots / m.block_size;
  for (int64_t li = 0; li < m.num_layers; ++li) {
    if (li > 0 && dec::same_rows(rows[li], rows[li - 1])) continue;
    if (dec::check_rows(rows[li], M, m.slots, m.block_size, li, err, err_len)) return 1;
  }
  const bool bf = m.act_bf16 != 0;
  const dec::Ops ops{dec::has_avx512() && m.portable == 0, m.norm_once != 0, m.gelu_tanh != 0};
  // Scratch, not zeroed (every element is written before it is read).
  auto buf = [](int64_t n) { return std::unique_ptr<float[]>(new float[size_t(n)]); };
  const auto x = buf(M * E), qkv = buf(M * qkv_n), attn = buf(M * qs), y = buf(M * E), gu = buf(M * 2 * I),
             act = buf(M * I);
  // bfloat16 activations: attention reads bfloat16 q and writes bfloat16 out, as there.
  std::unique_ptr<uint16_t[]> q16(bf ? new uint16_t[size_t(M * qs)] : nullptr),
      attn16(bf ? new uint16_t[size_t(M * qs)] : nullptr);
  std::vector<uint16_t> y16;
  const int64_t qkv_widths[3] = {qs, kvs_, kvs_}, gate_up_widths[2] = {I, I}, e_width[1] = {E};
  // Each pass below is per row (dec::for_rows): a row's values come from that row alone.
  dec::for_rows(M, num_threads, [&](int64_t r) { ops.norm_row(h + r * E, m.layers[0].in_norm, E, m.eps, x.get() + r * E, bf); });
  for (int64_t li = 0; li < m.num_layers; ++li) {
    const dec::Layer& L = m.layers[li];
    const dec::LayerRows& R = rows[li];
    if (dec::linear(L.qkv, x.get(), M, qkv.get(), num_threads, err, err_len)) return 1;
    dec::for_rows(M, num_threads, [&](int64_t r) {
      float* row = qkv.get() + r * qkv_n;
      dec::lora_site(ops, lora, r, li, dec::kSiteQkv, qkv_widths, 3, x.get() + r * E, E, row, qkv_n, bf);
      ops.out_row(row, L.qkv.bias, qkv_n, bf);
      if (L.qk_norm != nullptr)  // in place: norm_row reads the whole head (its sum) before it writes
        for (int64_t hh = 0; hh < H + KVH; ++hh)
          ops.norm_row(row + hh * D, L.qk_norm + hh * D, D, m.eps, row + hh * D, bf);
      const int64_t RD = m.rope_dims, at = (L.rope_table * M + r) * RD;
      for (int64_t hh = 0; hh < H + KVH; ++hh) ops.rope(row + hh * D, cos + at, ssin + at, RD, bf);
      dec::write_kv(ops, L.k_cache, m.cache_kind, m.slots, D, KVH, R.slots[r], row + qs);
      dec::write_kv(ops, L.v_cache, m.cache_kind, m.slots, D, KVH, R.slots[r], row + qs + kvs_);
      if (bf) ops.to_bf16(row, qs, q16.get() + r * qs);
    });
    const void* q_in = bf ? static_cast<const void*>(q16.get()) : static_cast<const void*>(qkv.get());
    void* a_out = bf ? static_cast<void*>(attn16.get()) : static_cast<void*>(attn.get());
    if (kvs_paged_decode_attention(q_in, bf ? qs : qkv_n, D, bf ? 1 : 0, L.k_cache, m.slots * D, D, L.v_cache,
                                   m.slots * D, D, int(m.cache_kind), nullptr, 0, nullptr, 0, R.tables, R.max_blocks,
                                   R.ctx, R.sink_end, R.win_start, a_out, qs, D, M, H, KVH, D, m.block_size, num_blocks,
                                   m.scale, 0, num_threads, err, err_len))
      return 1;
    if (bf) dec::for_rows(M, num_threads, [&](int64_t r) { ops.widen(attn16.get() + r * qs, qs, attn.get() + r * qs); });
    if (dec::linear(L.o, attn.get(), M, y.get(), num_threads, err, err_len)) return 1;
    if (dec::all_reduce(ops, m.comm, y.get(), M * E, bf, y16, err, err_len)) return 1;
    // h += o's output (rounded: its tensor; Gemma: normalized first), then the norm before the MLP.
    dec::for_rows(M, num_threads, [&](int64_t r) {
      dec::lora_site(ops, lora, r, li, dec::kSiteO, e_width, 1, attn.get() + r * qs, qs, y.get() + r * E, E, bf);
      dec::out_norm(ops, y.get() + r * E, L.attn_out_norm, E, m.eps, bf);
      ops.residual(h + r * E, y.get() + r * E, E, bf);
      ops.norm_row(h + r * E, L.post_norm, E, m.eps, x.get() + r * E, bf);
    });
    if (dec::linear(L.gate_up, x.get(), M, gu.get(), num_threads, err, err_len)) return 1;
    dec::for_rows(M, num_threads, [&](int64_t r) {
      dec::lora_site(ops, lora, r, li, dec::kSiteGateUp, gate_up_widths, 2, x.get() + r * E, E, gu.get() + r * 2 * I,
                     2 * I, bf);
      ops.act_row(gu.get() + r * 2 * I, I, act.get() + r * I, bf);
    });
    if (dec::linear(L.down, act.get(), M, y.get(), num_threads, err, err_len)) return 1;
    if (dec::all_reduce(ops, m.comm, y.get(), M * E, bf, y16, err, err_len)) return 1;
    // h += down's output (Gemma: normalized first), then the next layer's input norm.
    const float* next_norm = li + 1 < m.num_layers ? m.layers[li + 1].in_norm : nullptr;
    dec::for_rows(M, num_threads, [&](int64_t r) {
      dec::lora_site(ops, lora, r, li, dec::kSiteDown, e_width, 1, act.get() + r * I, I, y.get() + r * E, E, bf);
      dec::out_norm(ops, y.get() + r * E, L.mlp_out_norm, E, m.eps, bf);
      ops.residual(h + r * E, y.get() + r * E, E, bf);
      if (next_norm != nullptr) ops.norm_row(h + r * E, next_norm, E, m.eps, x.get() + r * E, bf);
    });
  }
  return 0;
}

// The step-by-step path's LoRA delta (kvshare/model/lora.py), the fused step's function: x [M, K] a
// site's input rows, y [M, N] its linear's output rows (rounded as their tensor, no bias yet), both
// float32 (values a bfloat16 holds when act_bf16); y gets each adapter row's delta over modules
// [first, first + num_modules) of `layer`, module i over `widths[i]` columns. Rows are independent;
// the thread count changes only the speed.
extern "C" int kvs_lora_apply(const dec::LoraRows* lora, int64_t num_layers, int64_t layer, int64_t first,
                              const int64_t* widths, int64_t num_modules, const float* x, int64_t K, float* y,
                              int64_t N, int64_t M, int act_bf16, int portable, int num_threads, char* err,
                              int64_t err_len) {
  if (dec::check_lora(*lora, M, num_layers, err, err_len)) return 1;
  int64_t total = 0;
  for (int64_t i = 0; i < num_modules; ++i) total += widths[i];
  if (layer < 0 || layer >= num_layers || first < 0 || num_modules < 1 || first + num_modules > dec::kLoraModules ||
      total != N) {
    std::snprintf(err, size_t(err_len), "site: layer %lld, modules [%lld, %lld) over %lld of %lld columns",
                  (long long)layer, (long long)first, (long long)(first + num_modules), (long long)total, (long long)N);
    return 1;
  }
  const dec::Ops ops{dec::has_avx512() && portable == 0, false, false};
  // Rows are whole units of work here (no shared scratch), so any M is spread over the threads.
  const int threads = M >= 16 ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < M; ++r)
    dec::lora_site(ops, lora, r, layer, first, widths, num_modules, x + r * K, K, y + r * N, N, act_bf16 != 0);
  return 0;
}
