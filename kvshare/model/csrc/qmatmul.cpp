// Group-quantized int8 matmul for small batches: y[m, n] = sum_k x[m, k] * w[n, k], where
// w[n, k] = q[n, k] * scales[n, k / g] (+ zeros[n, k / g]). x float32 or bfloat16 [M, K] (unit
// column stride, any row stride), q int8 [N, K], scales / zeros float32 [N, K / g], all
// contiguous; y [M, N] in x's dtype (any row stride), float32 accumulation. bf16 x is widened
// to float32 once per call (M x K is small).
//
// Code paths, picked at run time by CPU features: AVX-512 (F/BW/VL/DQ) when g % 16 == 0, AVX2 +
// FMA when g % 8 == 0, a portable scalar path for everything else. All dequantize each weight
// once per tile of x rows (q * scale + zero: one fma on the vector paths; zeros folded into the
// weight, so no extra per-group term) and accumulate x * w in float32. The AVX-512 path works
// on tiles of 4 weight rows x up to 4 x rows: 16 accumulators, each 16 int8 weights loaded and
// widened (_mm512_cvtepi8_epi32, _mm512_cvtepi32_ps) once for 4 rows of x, each x vector loaded
// once for 4 weight rows; weight rows are prefetched into L2 a few KB ahead. N is split into
// contiguous chunks handed to OpenMP threads dynamically (each streams its chunk in order);
// each output is computed by one thread, so results do not depend on the thread count. Plain C ABI, no torch headers; built with -O3 -fopenmp
// and no -march (target attributes + runtime dispatch).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QMM_X86 1
#include <immintrin.h>
#define QMM_INLINE inline __attribute__((always_inline))
#define QMM_UNROLL _Pragma("GCC unroll 16")
#else
#define QMM_X86 0
#endif

namespace qmm {

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
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
  const float* x;  // float32 rows (x itself, or the bf16 x converted once)
  int64_t x_s0;
  const int8_t* q;
  const float* scales;
  const float* zeros;  // null: none
  int64_t M, N, K, g, G;  // G = K / g groups per row
  void* y;
  int64_t y_s0;
  bool y_bf16;
};

static inline void store(const Problem& P, int64_t m, int64_t n, float v) {
  if (P.y_bf16)
    static_cast<uint16_t*>(P.y)[m * P.y_s0 + n] = f32_to_bf16(v);
  else
    static_cast<float*>(P.y)[m * P.y_s0 + n] = v;
}

// ------------------------------------------------------------------------------------------
// Portable scalar path: any K, any group size dividing K. Weight rows [n0, n1).
static void rows_scalar(const Problem& P, int64_t n0, int64_t n1) {
  constexpr int MB = 4;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qr = P.q + n * P.K;
    const float* sr = P.scales + n * P.G;
    const float* zr = P.zeros ? P.zeros + n * P.G : nullptr;
    for (int64_t m0 = 0; m0 < P.M; m0 += MB) {
      const int mb = int(std::min<int64_t>(MB, P.M - m0));
      float acc[MB] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t gi = 0; gi < P.G; ++gi) {
        const float s = sr[gi], z = zr ? zr[gi] : 0.f;
        for (int64_t k = gi * P.g; k < (gi + 1) * P.g; ++k) {
          const float w = float(qr[k]) * s + z;
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
// (int8 -> int32 -> float) and dequantized (q * scale + zero, one fma) once and used for MB rows.
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

constexpr int64_t kPrefetchRows = 16;  // how far ahead (in weight rows) to prefetch

// AVX-512, g % 16 == 0: 16 lanes, tiles of up to 4 x rows by 4 weight rows (16 accumulators).
template <int MB, int NB, bool ZEROS>
QMM_AVX512 static QMM_INLINE void tile_avx512(const Problem& P, int64_t m0, int64_t n0) {
  __m512 acc[MB][NB];
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    QMM_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  const int8_t* qr = P.q + n0 * P.K;
  const float* sr = P.scales + n0 * P.G;
  const float* zr = ZEROS ? P.zeros + n0 * P.G : nullptr;
  const float* xr = P.x + m0 * P.x_s0;
  const int64_t chunks = P.g / 16;
  // The weight rows PF rows ahead, NB * g bytes per group (all of them over the pass): the
  // tiles are contiguous, so this streams the weight into L2 ahead of use.
  const char* pf = reinterpret_cast<const char*>(qr) + kPrefetchRows * P.K;
  for (int64_t gi = 0; gi < P.G; ++gi) {
    for (int64_t b = 0; b < NB * P.g; b += 64) _mm_prefetch(pf + gi * NB * P.g + b, _MM_HINT_T1);
    __m512 s[NB], z[NB];
    QMM_UNROLL for (int j = 0; j < NB; ++j) {
      s[j] = _mm512_set1_ps(sr[j * P.G + gi]);
      z[j] = ZEROS ? _mm512_set1_ps(zr[j * P.G + gi]) : _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = gi * P.g + c * 16;
      __m512 w[NB];
      QMM_UNROLL for (int j = 0; j < NB; ++j) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + j * P.K + k));
        const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
        w[j] = ZEROS ? _mm512_fmadd_ps(qf, s[j], z[j]) : _mm512_mul_ps(qf, s[j]);
      }
      QMM_UNROLL for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_loadu_ps(xr + i * P.x_s0 + k);
        QMM_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
      }
    }
  }
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    QMM_UNROLL for (int j = 0; j < NB; ++j) store(P, m0 + i, n0 + j, _mm512_reduce_add_ps(acc[i][j]));
  }
}

template <int NB, bool ZEROS>
QMM_AVX512 static void ntile_avx512(const Problem& P, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= P.M; m0 += 4) tile_avx512<4, NB, ZEROS>(P, m0, n0);
  switch (P.M - m0) {
    case 3: tile_avx512<3, NB, ZEROS>(P, m0, n0); break;
    case 2: tile_avx512<2, NB, ZEROS>(P, m0, n0); break;
    case 1: tile_avx512<1, NB, ZEROS>(P, m0, n0); break;
    default: break;
  }
}

template <bool ZEROS>
QMM_AVX512 static void rows_avx512_t(const Problem& P, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) ntile_avx512<4, ZEROS>(P, n);
  for (; n < n1; ++n) ntile_avx512<1, ZEROS>(P, n);
}

static void rows_avx512(const Problem& P, int64_t n0, int64_t n1) {
  if (P.zeros)
    rows_avx512_t<true>(P, n0, n1);
  else
    rows_avx512_t<false>(P, n0, n1);
}

// AVX2 + FMA, g % 8 == 0: 8 lanes, tiles of up to 2 x rows by 4 weight rows (8 accumulators of
// the 16 ymm registers).
QMM_AVX2 static QMM_INLINE float hsum256(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

template <int MB, int NB, bool ZEROS>
QMM_AVX2 static QMM_INLINE void tile_avx2(const Problem& P, int64_t m0, int64_t n0) {
  __m256 acc[MB][NB];
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    QMM_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  const int8_t* qr = P.q + n0 * P.K;
  const float* sr = P.scales + n0 * P.G;
  const float* zr = ZEROS ? P.zeros + n0 * P.G : nullptr;
  const float* xr = P.x + m0 * P.x_s0;
  const int64_t chunks = P.g / 8;
  const char* pf = reinterpret_cast<const char*>(qr) + kPrefetchRows * P.K;  // as in tile_avx512
  for (int64_t gi = 0; gi < P.G; ++gi) {
    for (int64_t b = 0; b < NB * P.g; b += 64) _mm_prefetch(pf + gi * NB * P.g + b, _MM_HINT_T1);
    __m256 s[NB], z[NB];
    QMM_UNROLL for (int j = 0; j < NB; ++j) {
      s[j] = _mm256_set1_ps(sr[j * P.G + gi]);
      z[j] = ZEROS ? _mm256_set1_ps(zr[j * P.G + gi]) : _mm256_setzero_ps();
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = gi * P.g + c * 8;
      __m256 w[NB];
      QMM_UNROLL for (int j = 0; j < NB; ++j) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr + j * P.K + k));
        const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        w[j] = ZEROS ? _mm256_fmadd_ps(qf, s[j], z[j]) : _mm256_mul_ps(qf, s[j]);
      }
      QMM_UNROLL for (int i = 0; i < MB; ++i) {
        const __m256 xv = _mm256_loadu_ps(xr + i * P.x_s0 + k);
        QMM_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
      }
    }
  }
  QMM_UNROLL for (int i = 0; i < MB; ++i) {
    QMM_UNROLL for (int j = 0; j < NB; ++j) store(P, m0 + i, n0 + j, hsum256(acc[i][j]));
  }
}

template <int NB, bool ZEROS>
QMM_AVX2 static void ntile_avx2(const Problem& P, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 2 <= P.M; m0 += 2) tile_avx2<2, NB, ZEROS>(P, m0, n0);
  if (m0 < P.M) tile_avx2<1, NB, ZEROS>(P, m0, n0);
}

template <bool ZEROS>
QMM_AVX2 static void rows_avx2_t(const Problem& P, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) ntile_avx2<4, ZEROS>(P, n);
  for (; n < n1; ++n) ntile_avx2<1, ZEROS>(P, n);
}

static void rows_avx2(const Problem& P, int64_t n0, int64_t n1) {
  if (P.zeros)
    rows_avx2_t<true>(P, n0, n1);
  else
    rows_avx2_t<false>(P, n0, n1);
}
#else
static bool cpu_has_avx512() { return false; }
static bool cpu_has_avx2() { return false; }
#endif

static void bf16_rows_to_f32(const uint16_t* src, int64_t s0, int64_t M, int64_t K, float* dst) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) dst[m * K + k] = bf16_to_f32(src[m * s0 + k]);
}

}  // namespace qmm

// ---- C ABI (called through ctypes) ---------------------------------------------------------

// Bit mask of the code paths this CPU can run: 1 scalar, 2 avx512, 4 avx2.
extern "C" int kvs_qmm_cpu_paths() {
  return 1 | (qmm::cpu_has_avx512() ? 2 : 0) | (qmm::cpu_has_avx2() ? 4 : 0);
}

// Shapes, dtypes and strides are checked by the Python wrapper. Returns 0, or 1 with a message
// in err. impl: 0 best, 1 scalar, 2 avx512, 3 avx2; a vector path whose lane count does not
// divide group_size falls back to the next one that does (the scalar path takes any).
extern "C" int kvs_int8_group_matmul(const void* x, int64_t x_s0, int x_bf16, const int8_t* q, const float* scales,
                                     const float* zeros, void* y, int64_t y_s0, int64_t M, int64_t N, int64_t K,
                                     int64_t group_size, int impl, int num_threads, char* err, int64_t err_len) {
  if (group_size < 1 || K % group_size != 0) {
    std::snprintf(err, size_t(err_len), "group_size %lld must be >= 1 and divide K=%lld", (long long)group_size,
                  (long long)K);
    return 1;
  }
  if ((impl == 2 && !qmm::cpu_has_avx512()) || (impl == 3 && !qmm::cpu_has_avx2())) {
    std::snprintf(err, size_t(err_len), "code path %d is not supported by this CPU", impl);
    return 1;
  }
  if (impl < 0 || impl > 3) {
    std::snprintf(err, size_t(err_len), "unknown code path %d", impl);
    return 1;
  }
  if (M <= 0 || N <= 0) return 0;

  qmm::Problem P;
  P.q = q; P.scales = scales; P.zeros = zeros;
  P.M = M; P.N = N; P.K = K; P.g = group_size; P.G = K / group_size;
  P.y = y; P.y_s0 = y_s0; P.y_bf16 = x_bf16 != 0;
  std::vector<float> xf;  // M x K is tiny: one conversion per call
  if (x_bf16) {
    xf.resize(size_t(M * K));
    qmm::bf16_rows_to_f32(static_cast<const uint16_t*>(x), x_s0, M, K, xf.data());
    P.x = xf.data();
    P.x_s0 = K;
  } else {
    P.x = static_cast<const float*>(x);
    P.x_s0 = x_s0;
  }

  void (*rows)(const qmm::Problem&, int64_t, int64_t) = &qmm::rows_scalar;
#if QMM_X86
  if ((impl == 0 || impl == 2) && qmm::cpu_has_avx512() && group_size % 16 == 0)
    rows = &qmm::rows_avx512;
  else if (impl != 1 && qmm::cpu_has_avx2() && group_size % 8 == 0)
    rows = &qmm::rows_avx2;
#endif

  // Tiny problems run on the calling thread (waking the pool costs more than they do).
  const int64_t work = M * N * K;
  int nt = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, (N + 3) / 4)));
  if (work < (int64_t(1) << 16)) nt = 1;
  if (nt == 1) {
    rows(P, 0, N);
    return 0;
  }
  const int64_t tiles = (N + 3) / 4;
#ifdef _OPENMP
  // Chunks of whole tiles, handed out dynamically (a thread that starts late, or shares its
  // core, just takes fewer), about 8 per thread and at least 64 rows each.
  const int64_t chunk = std::max<int64_t>(16, (tiles + 8 * nt - 1) / (8 * nt)) * 4;
  const int64_t nchunks = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t c = 0; c < nchunks; ++c) rows(P, c * chunk, std::min(N, (c + 1) * chunk));
#else
  (void)tiles;
  rows(P, 0, N);
#endif
  return 0;
}
