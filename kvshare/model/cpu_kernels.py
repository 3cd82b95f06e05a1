"""Optional C++ CPU kernels, compiled on first use with `torch.utils.cpp_extension.load_inline`.

`paged_decode_attention` computes attention for decode rows (one query per sequence) straight
from the paged KV cache: each (row, kv head) task walks its own block table, reads every K and V
vector of its context exactly once, and keeps an online softmax with float32 accumulation. No
padded gather, no score matrix in memory. GQA/MQA/MHA, float32 or bfloat16 caches and queries,
any block size >= 1, any head_dim. An AVX-512 path (chosen at run time, CPUs without it use the
portable scalar path) handles head_dim <= 128; larger head dims use the scalar path.

The build is lazy and optional: `available()` compiles (or loads the cached build of) the
extension the first time it is asked, and answers False, with the reason logged once at INFO,
when it cannot (no compiler, no ninja, non-POSIX, ...). Nothing here raises at import.
Build artifacts go to torch's extension cache (`TORCH_EXTENSIONS_DIR`, by default
~/.cache/torch_extensions), never into the source tree.

Set KVSHARE_DISABLE_CPP_KERNELS=1 to force the pure-PyTorch paths.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

import torch

logger = logging.getLogger("kvshare")

DISABLE_ENV = "KVSHARE_DISABLE_CPP_KERNELS"

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVS_X86 1
#include <immintrin.h>
#define KVS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#else
#define KVS_X86 0
#endif

namespace kvs {

constexpr int kTile = 64;  // tokens per online-softmax step
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// bfloat16 caches are read as raw uint16_t bit patterns.
static inline float to_f32(float x) { return x; }
static inline float to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
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
  const int64_t* tables;
  int64_t tbl_s0;
  const int64_t* ctx;
  void* out;
  int64_t o_s0, o_s1;
};

struct Scratch {
  int64_t Dp;  // padded head dim (row pitch of qf / acc)
  std::vector<float> qf, acc, s, m, l;
  std::vector<int64_t> slots;
  Scratch(int64_t G, int64_t Dp_)
      : Dp(Dp_), qf(G * Dp_), acc(G * Dp_), s(G * kTile), m(G), l(G), slots(kTile) {}
};

// q row (G heads of kv head h), scaled, into fp32 scratch (zero padded to Dp).
static void load_q(const Problem& P, int64_t row, int64_t h, Scratch& S) {
  std::fill(S.qf.begin(), S.qf.end(), 0.f);
  for (int64_t g = 0; g < P.G; ++g) {
    const int64_t off = row * P.q_s0 + (h * P.G + g) * P.q_s1;
    float* dst = S.qf.data() + g * S.Dp;
    if (P.q_bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(P.q) + off;
      for (int64_t d = 0; d < P.D; ++d) dst[d] = to_f32(src[d]) * P.scale;
    } else {
      const float* src = static_cast<const float*>(P.q) + off;
      for (int64_t d = 0; d < P.D; ++d) dst[d] = src[d] * P.scale;
    }
  }
  std::fill(S.acc.begin(), S.acc.end(), 0.f);
  std::fill(S.m.begin(), S.m.end(), kNegInf);
  std::fill(S.l.begin(), S.l.end(), 0.f);
}

static void store_out(const Problem& P, int64_t row, int64_t h, const Scratch& S) {
  for (int64_t g = 0; g < P.G; ++g) {
    const float l = S.l[g];
    const float inv = l > 0.f ? 1.f / l : 0.f;  // empty context: zeros
    const float* a = S.acc.data() + g * S.Dp;
    const int64_t off = row * P.o_s0 + (h * P.G + g) * P.o_s1;
    if (P.q_bf16) {
      c10::BFloat16* dst = static_cast<c10::BFloat16*>(P.out) + off;
      for (int64_t d = 0; d < P.D; ++d) dst[d] = c10::BFloat16(a[d] * inv);
    } else {
      float* dst = static_cast<float*>(P.out) + off;
      for (int64_t d = 0; d < P.D; ++d) dst[d] = a[d] * inv;
    }
  }
}

// Slots of tokens t0 .. t0+tn-1, walking the table; (blk, off) is the cursor.
static inline void tile_slots(const int64_t* table, int64_t bs, int tn, int64_t& blk, int64_t& off,
                              int64_t* slots) {
  int64_t base = table[blk] * bs;
  for (int j = 0; j < tn; ++j) {
    slots[j] = base + off;
    if (++off == bs) {
      off = 0;
      ++blk;
      if (j + 1 < tn) base = table[blk] * bs;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Portable scalar path.
template <typename KT>
static void task_scalar(const Problem& P, int64_t row, int64_t h, Scratch& S) {
  const int64_t ctx = P.ctx[row];
  const int64_t G = P.G, D = P.D, Dp = S.Dp;
  load_q(P, row, h, S);
  const int64_t* table = P.tables + row * P.tbl_s0;
  const KT* kb = static_cast<const KT*>(P.k) + h * P.k_s0;
  const KT* vb = static_cast<const KT*>(P.v) + h * P.v_s0;
  float* s = S.s.data();
  int64_t blk = 0, off = 0;
  for (int64_t t0 = 0; t0 < ctx; t0 += kTile) {
    const int tn = int(std::min<int64_t>(kTile, ctx - t0));
    tile_slots(table, P.bs, tn, blk, off, S.slots.data());
    for (int j = 0; j < tn; ++j) {
      const KT* kp = kb + S.slots[j] * P.k_s1;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = S.qf.data() + g * Dp;
        float a = 0.f;
        for (int64_t d = 0; d < D; ++d) a += qg[d] * to_f32(kp[d]);
        s[g * kTile + j] = a;
      }
    }
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
// AVX-512 path: head_dim in NC chunks of 16 lanes (masked at the tail), up to GB query heads
// of the group held in registers at once.
#if KVS_X86
KVS_AVX512 static inline __m512 ld16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
KVS_AVX512 static inline __m512 ld16(const uint16_t* p, __mmask16 m) {
  __m256i x = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

template <typename KT>
KVS_AVX512 static inline void prefetch_row(const KT* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * int64_t(sizeof(KT)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// exp(x) for x <= 0 mostly: Cephes-style polynomial, ~1 ulp; underflows cleanly to 0.
KVS_AVX512 static inline __m512 exp16(__m512 x) {
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

static inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : remaining <= 0 ? __mmask16(0) : __mmask16((1u << remaining) - 1);
}

template <typename KT, int NC, int GB>
KVS_AVX512 static void qk_group(const float* qf, int64_t Dp, const KT* kb, int64_t ks1, const KT* vb,
                                int64_t vs1, bool prefetch_v, int64_t D, const int64_t* slots, int tn,
                                const __mmask16* mk, float* s) {
  __m512 qr[GB][NC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) qr[g][c] = _mm512_loadu_ps(qf + g * Dp + 16 * c);
  constexpr int kAhead = 4;
  for (int j = 0; j < tn; ++j) {
    if (j + kAhead < tn) prefetch_row(kb + slots[j + kAhead] * ks1, D);
    if (prefetch_v) prefetch_row(vb + slots[j] * vs1, D);
    const KT* kp = kb + slots[j] * ks1;
    __m512 kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = ld16(kp + 16 * c, mk[c]);
    for (int g = 0; g < GB; ++g) {
      __m512 a = _mm512_mul_ps(qr[g][0], kv[0]);
      for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qr[g][c], kv[c], a);
      s[g * kTile + j] = _mm512_reduce_add_ps(a);
    }
  }
}

template <typename KT, int NC, int GB>
KVS_AVX512 static void pv_group(float* acc, int64_t Dp, const KT* vb, int64_t vs1, const int64_t* slots,
                                int tn, const __mmask16* mk, const float* s) {
  __m512 ar[GB][NC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) ar[g][c] = _mm512_loadu_ps(acc + g * Dp + 16 * c);
  for (int j = 0; j < tn; ++j) {
    const KT* vp = vb + slots[j] * vs1;
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = ld16(vp + 16 * c, mk[c]);
    for (int g = 0; g < GB; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * kTile + j]);
      for (int c = 0; c < NC; ++c) ar[g][c] = _mm512_fmadd_ps(p, vv[c], ar[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * Dp + 16 * c, ar[g][c]);
}

KVS_AVX512 static void softmax_tile(float* sg, int tn, float& m, float& l, float* acc, int64_t Dp) {
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 vmax = ninf;
  for (int j = 0; j < tn; j += 16)
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, tail_mask(tn - j), sg + j));
  const float mnew = std::max(m, _mm512_reduce_max_ps(vmax));
  if (mnew > m) {
    const __m512 alpha = _mm512_set1_ps(std::exp(m - mnew));
    l *= std::exp(m - mnew);
    for (int64_t d = 0; d < Dp; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(alpha, _mm512_loadu_ps(acc + d)));
    m = mnew;
  }
  const __m512 vm = _mm512_set1_ps(mnew);
  __m512 vsum = _mm512_setzero_ps();
  for (int j = 0; j < tn; j += 16) {
    const __mmask16 mk = tail_mask(tn - j);
    __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + j), vm));
    e = _mm512_maskz_mov_ps(mk, e);
    _mm512_mask_storeu_ps(sg + j, mk, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  l += _mm512_reduce_add_ps(vsum);
}

template <typename KT, int NC, int GB>
static void for_groups_qk(const Problem& P, Scratch& S, const KT* kb, const KT* vb, int tn, const __mmask16* mk) {
  for (int64_t g0 = 0; g0 < P.G; g0 += GB) {
    const int64_t gb = std::min<int64_t>(GB, P.G - g0);
    const float* qf = S.qf.data() + g0 * S.Dp;
    float* s = S.s.data() + g0 * kTile;
    const bool pv = g0 == 0;
    switch (gb) {
      case 1: qk_group<KT, NC, 1>(qf, S.Dp, kb, P.k_s1, vb, P.v_s1, pv, P.D, S.slots.data(), tn, mk, s); break;
      case 2: qk_group<KT, NC, 2>(qf, S.Dp, kb, P.k_s1, vb, P.v_s1, pv, P.D, S.slots.data(), tn, mk, s); break;
      case 3: if constexpr (GB >= 3) qk_group<KT, NC, 3>(qf, S.Dp, kb, P.k_s1, vb, P.v_s1, pv, P.D, S.slots.data(), tn, mk, s); break;
      default: if constexpr (GB >= 4) qk_group<KT, NC, 4>(qf, S.Dp, kb, P.k_s1, vb, P.v_s1, pv, P.D, S.slots.data(), tn, mk, s); break;
    }
  }
}

template <typename KT, int NC, int GB>
static void for_groups_pv(const Problem& P, Scratch& S, const KT* vb, int tn, const __mmask16* mk) {
  for (int64_t g0 = 0; g0 < P.G; g0 += GB) {
    const int64_t gb = std::min<int64_t>(GB, P.G - g0);
    float* acc = S.acc.data() + g0 * S.Dp;
    const float* s = S.s.data() + g0 * kTile;
    switch (gb) {
      case 1: pv_group<KT, NC, 1>(acc, S.Dp, vb, P.v_s1, S.slots.data(), tn, mk, s); break;
      case 2: pv_group<KT, NC, 2>(acc, S.Dp, vb, P.v_s1, S.slots.data(), tn, mk, s); break;
      case 3: if constexpr (GB >= 3) pv_group<KT, NC, 3>(acc, S.Dp, vb, P.v_s1, S.slots.data(), tn, mk, s); break;
      default: if constexpr (GB >= 4) pv_group<KT, NC, 4>(acc, S.Dp, vb, P.v_s1, S.slots.data(), tn, mk, s); break;
    }
  }
}

template <typename KT, int NC>
static void task_avx512(const Problem& P, int64_t row, int64_t h, Scratch& S) {
  constexpr int GB = NC <= 4 ? 4 : 2;
  const int64_t ctx = P.ctx[row];
  load_q(P, row, h, S);
  __mmask16 mk[NC];
  for (int c = 0; c < NC; ++c) mk[c] = tail_mask(P.D - 16 * c);
  const int64_t* table = P.tables + row * P.tbl_s0;
  const KT* kb = static_cast<const KT*>(P.k) + h * P.k_s0;
  const KT* vb = static_cast<const KT*>(P.v) + h * P.v_s0;
  int64_t blk = 0, off = 0;
  for (int64_t t0 = 0; t0 < ctx; t0 += kTile) {
    const int tn = int(std::min<int64_t>(kTile, ctx - t0));
    tile_slots(table, P.bs, tn, blk, off, S.slots.data());
    for_groups_qk<KT, NC, GB>(P, S, kb, vb, tn, mk);
    for (int64_t g = 0; g < P.G; ++g)
      softmax_tile(S.s.data() + g * kTile, tn, S.m[g], S.l[g], S.acc.data() + g * S.Dp, S.Dp);
    for_groups_pv<KT, NC, GB>(P, S, vb, tn, mk);
  }
  store_out(P, row, h, S);
}

static bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("fma");
  return ok;
}
#else
static bool cpu_has_avx512() { return false; }
#endif

using TaskFn = void (*)(const Problem&, int64_t, int64_t, Scratch&);

template <typename KT>
static TaskFn pick(int64_t D, bool vec, int64_t& Dp) {
#if KVS_X86
  if (vec) {
    const int64_t nc = (D + 15) / 16;
    if (nc <= 1) { Dp = 16; return &task_avx512<KT, 1>; }
    if (nc <= 2) { Dp = 32; return &task_avx512<KT, 2>; }
    if (nc <= 4) { Dp = 64; return &task_avx512<KT, 4>; }
    if (nc <= 8) { Dp = 128; return &task_avx512<KT, 8>; }
  }
#endif
  Dp = D;
  return &task_scalar<KT>;
}

}  // namespace kvs

std::string cpu_path() { return kvs::cpu_has_avx512() ? "avx512" : "scalar"; }

// impl: 0 = best available, 1 = scalar, 2 = avx512 (error where unsupported).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale, c10::optional<torch::Tensor> out,
                                     int64_t impl) {
  TORCH_CHECK(q.dim() == 3, "q must be [n, heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3, "caches must be [kv_heads, slots, head_dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16, "q must be float32 or bfloat16, got ", qt);
  TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16, "cache must be float32 or bfloat16, got ", ct);
  TORCH_CHECK(v_cache.scalar_type() == ct, "k_cache and v_cache dtypes differ");
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1");
  TORCH_CHECK(impl >= 0 && impl <= 2, "impl must be 0, 1 or 2");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), slots = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D, "head_dim of q (", D, ") and cache (", k_cache.size(2), ") differ");
  TORCH_CHECK(KVH >= 1 && H % KVH == 0, "heads (", H, ") must be a multiple of kv_heads (", KVH, ")");
  TORCH_CHECK(slots % block_size == 0, "cache slots (", slots, ") not a multiple of block_size");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == n, "block_tables must be [n, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == n, "context_lens must be [n]");
  TORCH_CHECK(!block_tables.is_floating_point() && !context_lens.is_floating_point(), "integer tables/lengths");
  if (q.stride(2) != 1) q = q.contiguous();
  if (k_cache.stride(2) != 1) k_cache = k_cache.contiguous();
  if (v_cache.stride(2) != 1) v_cache = v_cache.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto ctx = context_lens.to(at::kLong).contiguous();
  torch::Tensor o;
  if (out.has_value()) {
    o = *out;
    TORCH_CHECK(o.sizes() == q.sizes() && o.scalar_type() == qt && o.device().is_cpu() && o.stride(2) == 1,
                "out must be a CPU tensor shaped and typed like q with unit last stride");
  } else {
    o = torch::empty({n, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  }
  // Isolation: a row reads table entries 0 .. ceil(ctx / bs) - 1 only, and each must be a real block.
  const int64_t max_blocks = tables.size(1), num_blocks = slots / block_size;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(cp[r] >= 0 && cp[r] <= max_blocks * block_size, "row ", r, ": context length ", cp[r],
                " out of range for a table of ", max_blocks, " blocks of ", block_size);
    const int64_t used = (cp[r] + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(tp[r * max_blocks + b] >= 0 && tp[r * max_blocks + b] < num_blocks, "row ", r,
                  ": block id ", tp[r * max_blocks + b], " out of range [0, ", num_blocks, ")");
  }
  if (n == 0 || H == 0 || D == 0) return o;

  kvs::Problem P;
  P.n = n; P.H = H; P.KVH = KVH; P.G = H / KVH; P.D = D; P.bs = block_size; P.scale = float(scale);
  P.q = q.data_ptr(); P.q_s0 = q.stride(0); P.q_s1 = q.stride(1); P.q_bf16 = qt == at::kBFloat16;
  P.k = k_cache.data_ptr(); P.v = v_cache.data_ptr();
  P.k_s0 = k_cache.stride(0); P.k_s1 = k_cache.stride(1); P.v_s0 = v_cache.stride(0); P.v_s1 = v_cache.stride(1);
  P.tables = tp; P.tbl_s0 = max_blocks; P.ctx = cp;
  P.out = o.data_ptr(); P.o_s0 = o.stride(0); P.o_s1 = o.stride(1);

  const bool has_vec = kvs::cpu_has_avx512();
  TORCH_CHECK(impl != 2 || has_vec, "impl=2 (avx512) requested but this CPU lacks AVX-512");
  const bool vec = impl == 2 || (impl == 0 && has_vec);
  int64_t Dp = D;
  kvs::TaskFn fn = ct == at::kBFloat16 ? kvs::pick<uint16_t>(D, vec, Dp) : kvs::pick<float>(D, vec, Dp);

  // Longest rows first, handed out dynamically: rows arrive sorted by length, and a static split
  // would give one thread all the long ones.
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cp[a] > cp[b]; });
  const int64_t ntasks = n * KVH;
  int64_t total = 0;
  for (int64_t r = 0; r < n; ++r) total += cp[r];
  int nt = int(std::min<int64_t>(at::get_num_threads(), ntasks));
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
  return o;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, py::call_guard<py::gil_scoped_release>(),
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("out") = py::none(), py::arg("impl") = 0);
  m.def("cpu_path", &cpu_path);
}
"""

_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict = {"tried": False, "module": None, "error": None, "build_seconds": None}


def disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _ensure_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv's pip-installed ninja is not there unless activated."""
    from torch.utils import cpp_extension

    if cpp_extension.is_ninja_available():
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and os.path.isdir(bin_dir):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _build():
    if os.name != "posix":
        raise RuntimeError(f"C++ kernels are only built on POSIX systems (os.name={os.name!r})")
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    # The name carries the source hash: checkouts with different sources never fight over one dir.
    digest = hashlib.sha256((_CPP_SOURCE + " ".join(_CFLAGS + _LDFLAGS) + torch.__version__).encode()).hexdigest()
    name = f"kvshare_cpu_kernels_{digest[:12]}"
    return cpp_extension.load_inline(
        name=name,
        cpp_sources=[_CPP_SOURCE],
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        verbose=False,
    )


def _load():
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if not _state["tried"]:
            t0 = time.perf_counter()
            try:
                _state["module"] = _build()
                _state["build_seconds"] = time.perf_counter() - t0
                logger.debug("kvshare C++ CPU kernels ready in %.1f s (%s path)", _state["build_seconds"],
                             _state["module"].cpu_path())
            except Exception as e:  # noqa: BLE001 - any failure just means "not available"
                msg = f"{type(e).__name__}: {e}".strip()
                _state["error"] = msg
                short = msg if len(msg) <= 600 else msg[:600] + " ..."
                logger.info("kvshare C++ CPU kernels unavailable, using pure-PyTorch attention: %s", short)
            finally:
                _state["tried"] = True
    return _state["module"]


def available() -> bool:
    """True when the kernels are built and usable (building them on the first call), and not
    disabled by KVSHARE_DISABLE_CPP_KERNELS=1."""
    if disabled_by_env():
        return False
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False, or None when it is True."""
    if disabled_by_env():
        return f"disabled by {DISABLE_ENV}={os.environ.get(DISABLE_ENV)}"
    if _load() is None:
        return _state["error"] or "build failed"
    return None


def build_seconds() -> float | None:
    """Wall time of the build (or of loading the cached build) in this process."""
    return _state["build_seconds"]


def cpu_path() -> str:
    """Which code path the kernel picks on this CPU: 'avx512' or 'scalar'."""
    mod = _load()
    if mod is None:
        raise RuntimeError(f"C++ CPU kernels unavailable: {_state['error']}")
    return mod.cpu_path()


_IMPLS = {"auto": 0, "scalar": 1, "avx512": 2}


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, *, out: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """Attention of one query per row over that row's paged context.

    q [n, H, D]; k_cache, v_cache [KVH, num_blocks * block_size, D] (H % KVH == 0); block_tables
    [n, max_blocks] (int64 or int32; entries past a row's last needed block are never read);
    context_lens [n]: row r attends to positions 0 .. context_lens[r] - 1, position p living in
    slot block_tables[r, p // block_size] * block_size + p % block_size. Returns [n, H, D] in q's
    dtype (written into `out` when given). float32 or bfloat16 q and caches, float32 math.
    `impl` forces a code path ("scalar" or "avx512") for testing.
    """
    mod = _load()
    if mod is None:
        raise RuntimeError(f"C++ CPU kernels unavailable: {_state['error']}")
    return mod.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, int(block_size),
                                      float(scale), out, _IMPLS[impl])
