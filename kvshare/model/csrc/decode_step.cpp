// Every layer of a decode step in one call: the decoder stack of a Llama-family model for a
// batch of decode rows (one new token per sequence), on kvshare's own kernels.
//
// Why: at batch 1 a 30-layer model issues ~450 small PyTorch ops and ~150 kernel calls per
// token; each costs 5-50 us of dispatch and Python, together about as much as the matmuls.
// Here the same arithmetic runs without leaving C++: per layer RMSNorm, the fused q/k/v matmul
// (+ bias), RoPE on q and k, the K/V write into the paged cache, paged attention, the output
// projection and residual, RMSNorm, the fused gate/up matmul, SiLU x up, down and residual.
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
// torch's vectorized order there) and in SiLU's exp, which now and then flips a bfloat16 rounding.
//
// Scope (the Python side, kvshare/model/fused_decode.py, sends nothing else here): float32 or
// bfloat16 activations (hidden state, norms and biases handed over as float32); weights as
// int8-group or int4-group codes; a float32 or bfloat16 KV cache;
// every row a decode row with the same attention for all layers (no sliding-window layers).
// Everything else takes the step-by-step path.

namespace dec {

struct Linear {
  int64_t kind;  // 1: int8 codes [N, K]; 2: 4-bit codes two per byte [N, K / 2]; 3 / 4: the same in VNNI blocks
  const void* q;
  const float* scales;  // [N, K / group]
  const float* zeros;   // [N, K / group] or null
  const float* bias;    // [N] or null
  int64_t N, K, group;
};

struct Layer {
  const float* in_norm;    // [hidden]
  const float* post_norm;  // [hidden]
  Linear qkv, o, gate_up, down;
  void* k_cache;  // [kv_heads, slots, head_dim], slot stride head_dim, head stride slots * head_dim
  void* v_cache;
};

struct Model {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
  int64_t slots;       // cache slots per layer (num_blocks * block_size)
  int64_t block_size;
  int64_t cache_kind;  // 0 float32, 1 bfloat16
  int64_t act_bf16;    // 1: round as bfloat16 activations do (see the top)
  double eps, scale;
  const Layer* layers;
  ShmComm* comm;  // tensor parallel (shm_collectives.cpp): o's and down's outputs are all-reduced; null: one rank
};

// Round to bfloat16 and back (what storing a float32 result in a bfloat16 tensor does).
static inline float rb(float f) { return qmm::bf16_to_f32(qmm::f32_to_bf16(f)); }

static void round_all(float* x, int64_t n, bool bf) {
  if (bf)
    for (int64_t i = 0; i < n; ++i) x[i] = rb(x[i]);
}

// float32: x * inv * w in one pass (F.rms_norm). bfloat16: the normalized row is rounded, then
// multiplied by the weight and rounded again (layers.rms_norm's two ops).
static void rms_norm(const float* x, const float* w, int64_t M, int64_t D, double eps, float* out, bool bf) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * D;
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += double(r[d]) * double(r[d]);
    const float inv = float(1.0 / std::sqrt(ss / double(D) + eps));
    float* o = out + m * D;
    if (bf)
      for (int64_t d = 0; d < D; ++d) o[d] = rb(w[d] * rb(r[d] * inv));
    else
      for (int64_t d = 0; d < D; ++d) o[d] = r[d] * inv * w[d];
  }
}

static int linear(const Linear& L, const float* x, int64_t M, float* y, bool bf, int num_threads, char* err,
                  int64_t err_len) {
  int rc;
  if (L.kind < 1 || L.kind > 4) {
    std::snprintf(err, size_t(err_len), "unknown linear kind %lld", (long long)L.kind);
    return 1;
  }
  const bool blocks = L.kind >= 3;  // (qmatmul.cpp, "VNNI blocks")
  if (L.kind == 1 || L.kind == 3)
    rc = qmm::group_matmul<qmm::I8>(x, L.K, 0, static_cast<const uint8_t*>(L.q), L.scales, L.zeros, y, L.N, M, L.N,
                                    L.K, L.group, 0, num_threads, err, err_len, blocks);
  else
    rc = qmm::group_matmul<qmm::U4>(x, L.K, 0, static_cast<const uint8_t*>(L.q), L.scales, L.zeros, y, L.N, M, L.N,
                                    L.K, L.group, 0, num_threads, err, err_len, blocks);
  if (rc) return rc;
  round_all(y, M * L.N, bf);  // the matmul's output tensor
  if (L.bias != nullptr)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < L.N; ++n) y[m * L.N + n] = bf ? rb(y[m * L.N + n] + L.bias[n]) : y[m * L.N + n] + L.bias[n];
  return 0;
}

// x [D] <- x * cos + rotate_half(x) * signed_sin (the sign of rotate_half folded into sin);
// bfloat16: x * cos rounded, then the addcmul rounded (RotaryEmbedding.rotate's two ops).
static void rope(float* x, const float* cos, const float* ssin, int64_t D, float* tmp, bool bf) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) tmp[d] = x[d < half ? d + half : d - half];
  if (bf)
    for (int64_t d = 0; d < D; ++d) x[d] = rb(rb(x[d] * cos[d]) + tmp[d] * ssin[d]);
  else
    for (int64_t d = 0; d < D; ++d) x[d] = x[d] * cos[d] + tmp[d] * ssin[d];
}

static void write_kv(void* cache, int64_t kind, int64_t slots_per_head, int64_t D, int64_t head, int64_t slot,
                     const float* src) {
  const int64_t off = head * slots_per_head * D + slot * D;
  if (kind == 0) {
    std::memcpy(static_cast<float*>(cache) + off, src, size_t(D) * sizeof(float));
  } else {
    uint16_t* dst = static_cast<uint16_t*>(cache) + off;
    for (int64_t d = 0; d < D; ++d) dst[d] = kvs::to_bf16(src[d]);
  }
}

// Tensor parallel: y [n] (a row-parallel linear's partial output, bfloat16 values when bf) becomes
// the sum over ranks, exchanged in the dtype the step-by-step path's tensor has.
static int all_reduce(ShmComm* comm, float* y, int64_t n, bool bf, std::vector<uint16_t>& y16, char* err,
                      int64_t err_len) {
  if (comm == nullptr) return 0;
  if (!bf) return kvs_shm_allreduce_comm(comm, y, n, 0, err, err_len);
  y16.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) y16[size_t(i)] = qmm::f32_to_bf16(y[i]);
  if (kvs_shm_allreduce_comm(comm, y16.data(), n, 1, err, err_len)) return 1;
  for (int64_t i = 0; i < n; ++i) y[i] = qmm::bf16_to_f32(y16[size_t(i)]);
  return 0;
}

}  // namespace dec

// h [M, hidden] float32 (with act_bf16, values a bfloat16 holds): the embedded tokens in, the last layer's output (before the final
// norm) out. cos, ssin [M, head_dim]: RoPE tables of each row's position (sin signed as
// RotaryEmbedding.tables gives it). slots [M]: where each row's K/V go. tables [M, max_blocks],
// ctx [M]: each row's block table and context length (its own new token included).
// Returns 0, or 1 with a message in err (nothing is written to the cache when an index is bad).
extern "C" int kvs_decode_layers(const dec::Model* mp, float* h, int64_t M, const float* cos, const float* ssin,
                                 const int64_t* slots, const int64_t* tables, int64_t max_blocks, const int64_t* ctx,
                                 int num_threads, char* err, int64_t err_len) {
  const dec::Model& m = *mp;
  const int64_t E = m.hidden, H = m.heads, KVH = m.kv_heads, D = m.head_dim, I = m.intermediate;
  const int64_t qs = H * D, kvs_ = KVH * D, qkv_n = qs + 2 * kvs_;
  if (m.cache_kind != 0 && m.cache_kind != 1) {
    std::snprintf(err, size_t(err_len), "cache kind %lld is not supported here", (long long)m.cache_kind);
    return 1;
  }
  if (M <= 0) return 0;
  // Isolation checks once, before anything is written: each row writes only a real slot and
  // reads only real blocks of its own table (paged attention checks the tables again per layer).
  const int64_t num_blocks = m.slots / m.block_size;
  for (int64_t r = 0; r < M; ++r) {
    if (slots[r] < 0 || slots[r] >= m.slots) {
      std::snprintf(err, size_t(err_len), "row %lld: slot %lld out of range [0, %lld)", (long long)r,
                    (long long)slots[r], (long long)m.slots);
      return 1;
    }
    if (ctx[r] < 1 || ctx[r] > max_blocks * m.block_size) {
      std::snprintf(err, size_t(err_len), "row %lld: context length %lld out of range for a table of %lld blocks",
                    (long long)r, (long long)ctx[r], (long long)max_blocks);
      return 1;
    }
    const int64_t used = (ctx[r] + m.block_size - 1) / m.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = tables[r * max_blocks + b];
      if (id < 0 || id >= num_blocks) {
        std::snprintf(err, size_t(err_len), "row %lld: block id %lld out of range [0, %lld)", (long long)r,
                      (long long)id, (long long)num_blocks);
        return 1;
      }
    }
  }
  const bool bf = m.act_bf16 != 0;
  std::vector<float> x(size_t(M * E)), qkv(size_t(M * qkv_n)), attn(size_t(M * qs)), y(size_t(M * E)),
      gu(size_t(M * 2 * I)), act(size_t(M * I)), tmp(static_cast<size_t>(D));
  // bfloat16 activations: attention reads bfloat16 q and writes bfloat16 out, as there.
  std::vector<uint16_t> q16(bf ? size_t(M * qs) : 0), attn16(bf ? size_t(M * qs) : 0), y16;
  for (int64_t li = 0; li < m.num_layers; ++li) {
    const dec::Layer& L = m.layers[li];
    dec::rms_norm(h, L.in_norm, M, E, m.eps, x.data(), bf);
    if (dec::linear(L.qkv, x.data(), M, qkv.data(), bf, num_threads, err, err_len)) return 1;
    for (int64_t r = 0; r < M; ++r) {
      float* row = qkv.data() + r * qkv_n;
      for (int64_t hh = 0; hh < H + KVH; ++hh)
        dec::rope(row + hh * D, cos + r * D, ssin + r * D, D, tmp.data(), bf);
      for (int64_t g = 0; g < KVH; ++g) {
        dec::write_kv(L.k_cache, m.cache_kind, m.slots, D, g, slots[r], row + qs + g * D);
        dec::write_kv(L.v_cache, m.cache_kind, m.slots, D, g, slots[r], row + qs + kvs_ + g * D);
      }
      if (bf)
        for (int64_t i = 0; i < qs; ++i) q16[size_t(r * qs + i)] = qmm::f32_to_bf16(row[i]);
    }
    const void* q_in = bf ? static_cast<const void*>(q16.data()) : static_cast<const void*>(qkv.data());
    void* a_out = bf ? static_cast<void*>(attn16.data()) : static_cast<void*>(attn.data());
    if (kvs_paged_decode_attention(q_in, bf ? qs : qkv_n, D, bf ? 1 : 0, L.k_cache, m.slots * D, D, L.v_cache,
                                   m.slots * D, D, int(m.cache_kind), nullptr, 0, nullptr, 0, tables, max_blocks, ctx,
                                   nullptr, nullptr, a_out, qs, D, M, H, KVH, D, m.block_size, num_blocks, m.scale, 0,
                                   num_threads, err, err_len))
      return 1;
    if (bf)
      for (int64_t i = 0; i < M * qs; ++i) attn[size_t(i)] = qmm::bf16_to_f32(attn16[size_t(i)]);
    if (dec::linear(L.o, attn.data(), M, y.data(), bf, num_threads, err, err_len)) return 1;
    if (dec::all_reduce(m.comm, y.data(), M * E, bf, y16, err, err_len)) return 1;
    for (int64_t i = 0; i < M * E; ++i) h[i] = bf ? dec::rb(h[i] + y[i]) : h[i] + y[i];
    dec::rms_norm(h, L.post_norm, M, E, m.eps, x.data(), bf);
    if (dec::linear(L.gate_up, x.data(), M, gu.data(), bf, num_threads, err, err_len)) return 1;
    for (int64_t r = 0; r < M; ++r) {
      const float* g = gu.data() + r * 2 * I;
      float* a = act.data() + r * I;
      if (bf)  // F.silu(gate) rounded, then * up rounded
        for (int64_t i = 0; i < I; ++i) a[i] = dec::rb(dec::rb(g[i] / (1.0f + std::exp(-g[i]))) * g[I + i]);
      else
        for (int64_t i = 0; i < I; ++i) a[i] = g[i] / (1.0f + std::exp(-g[i])) * g[I + i];
    }
    if (dec::linear(L.down, act.data(), M, y.data(), bf, num_threads, err, err_len)) return 1;
    if (dec::all_reduce(m.comm, y.data(), M * E, bf, y16, err, err_len)) return 1;
    for (int64_t i = 0; i < M * E; ++i) h[i] = bf ? dec::rb(h[i] + y[i]) : h[i] + y[i];
  }
  return 0;
}
