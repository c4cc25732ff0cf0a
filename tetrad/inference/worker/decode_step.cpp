// A CPU decode step of a Llama-family model as one op (torch.ops.tetrad.decode_model), and the
// weight-streaming matmul it is built on (torch.ops.tetrad.linear_rows).
//
// Why: at one token per sequence a layer is ~30 small torch ops, each a dispatch and an
// allocation, around four matmuls that only stream their weights; and torch's bf16 matmul at one
// row reads its weights at a fraction of the memory's speed. Here a step is one call: the
// embedding rows and rotary angles; per layer RMSNorm, QKV, rotary, the paged attention
// (paged_decode.cpp), the output projection and residual, RMSNorm, gate/up, SiLU * up, down and
// residual; the final RMSNorm and the output head. The elementwise steps round to the model's
// dtype where torch's eager ops would (a norm's fp32 result cast, then times its weight; SiLU,
// then the product), so the step follows the eager forward's numerics. Projections may be
// int8 or int4 (quant_rows.cpp), read in the layouts tetrad.models.quant holds them in.
// Built with paged_decode.cpp and quant_rows.cpp into one library by cpu_kernels.py.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <utility>

#include "stream_rows.h"

namespace tetrad {
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& context_lens, double scale,
                        const std::optional<at::Tensor>& new_k,
                        const std::optional<at::Tensor>& new_v,
                        const std::optional<at::Tensor>& slots,
                        const std::optional<at::Tensor>& rows_read);
at::Tensor quantized_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales);
}

namespace {

using namespace tetrad::stream;

// x [M, K] @ w [N, K]^T (+ bias) in x's dtype. Few rows stream the weights here (fp32
// accumulation); more rows, or weights this kernel does not read, go to at::linear. With
// `scales`, w is quantized as tetrad.models.quant holds it (quant_rows.cpp).
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_rows: shapes");
  if (scales.has_value()) {
    auto y = tetrad::quantized_rows(x, w, *scales);
    return bias.has_value() ? y.add_(*bias) : y;
  }
  TORCH_CHECK(x.size(1) == w.size(1), "linear_rows: shapes");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  if (M > kMaxStreamedRows || !w.is_contiguous() || w.scalar_type() != x.scalar_type() ||
      x.scalar_type() == at::kDouble)
    return at::linear(x, w, bias);
  const auto xf = as_floats(x);
  auto acc = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* out = acc.data_ptr<float>();
  TETRAD_DISPATCH(w.scalar_type(), "linear_rows", [&] {
    stream_matmul(xf.data(), M, w.data_ptr<scalar_t>(), N, K, out);
  });
  if (bias.has_value()) acc.add_(*bias);
  return x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type());
}

// RMSNorm as tetrad.models.layers.RMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, cast to the
// dtype, times the weight (rounded to the dtype again).
template <typename T>
void rms_norm_rows(const T* x, const T* weight, int64_t rows, int64_t dim, double eps, T* out) {
  for (const auto r : c10::irange(rows)) {
    const T* row = x + r * dim;
    float squares = 0.f;
    for (const auto d : c10::irange(dim)) squares += to_float(row[d]) * to_float(row[d]);
    const float scale = 1.f / std::sqrt(squares / dim + static_cast<float>(eps));
    for (const auto d : c10::irange(dim))
      out[r * dim + d] =
          static_cast<T>(to_float(weight[d]) * to_float(static_cast<T>(to_float(row[d]) * scale)));
  }
}

// Rotary embedding in place, half-split pairs, as layers.apply_rotary: in fp32, then rounded.
template <typename T>
void rotate(T* head, const float* cos, const float* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (const auto d : c10::irange(half)) {
    const float a = to_float(head[d]), b = to_float(head[d + half]);
    head[d] = static_cast<T>(a * cos[d] - b * sin[d]);
    head[d + half] = static_cast<T>(b * cos[d + half] + a * sin[d + half]);
  }
}

// One decoder layer for `T` decode tokens (one per sequence): x [T, hidden] -> [T, hidden].
// qkv_w [(heads + 2 kv_heads) * head_dim, hidden], out_w [hidden, heads * head_dim],
// up_w [2 ffn, hidden] (gate rows first), down_w [hidden, ffn]; cos, sin [T, head_dim] fp32;
// the cache arguments are paged_decode's (the new K/V written at `slots`). A projection with
// scales is quantized (linear_rows), its weight int8 [N, K] or torch's packed int4 [N, K / 2].
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& attn_norm_w, const at::Tensor& qkv_w,
                        const at::Tensor& out_w, const at::Tensor& mlp_norm_w,
                        const at::Tensor& up_w, const at::Tensor& down_w, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                        int64_t num_kv_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& context_lens,
                        const at::Tensor& slots, const std::optional<at::Tensor>& rows_read,
                        const std::optional<at::Tensor>& qkv_scales,
                        const std::optional<at::Tensor>& out_scales,
                        const std::optional<at::Tensor>& up_scales,
                        const std::optional<at::Tensor>& down_scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layer: x [tokens, hidden]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "decode_layer: fp32 cos and sin [tokens, head_dim]");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t head_dim = cos.size(1), q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim, ffn = up_w.size(0) / 2;
  TORCH_CHECK(qkv_w.size(0) == q_size + 2 * kv_size && up_w.size(0) % 2 == 0,
              "decode_layer: projection shapes");
  auto h = at::empty_like(x);
  at::Tensor residual;
  TETRAD_DISPATCH(x.scalar_type(), "decode_layer", [&] {
    using T = scalar_t;
    auto norm = [&](const at::Tensor& from, const at::Tensor& weight) {
      rms_norm_rows(from.data_ptr<T>(), weight.data_ptr<T>(), tokens, hidden, eps,
                    h.data_ptr<T>());
    };
    auto add_into = [&](at::Tensor& into, const at::Tensor& delta) {  // x + f(x), in the dtype
      T* dst = into.data_ptr<T>();
      const T* src = delta.data_ptr<T>();
      for (const auto i : c10::irange(into.numel()))
        dst[i] = static_cast<T>(to_float(dst[i]) + to_float(src[i]));
    };
    norm(x, attn_norm_w);
    auto qkv = linear_rows(h, qkv_w, std::nullopt, qkv_scales);  // [tokens, q + 2 kv]
    T* qkv_data = qkv.data_ptr<T>();
    const int64_t row = q_size + 2 * kv_size;
    for (const auto t : c10::irange(tokens)) {
      const float* c = cos.data_ptr<float>() + t * head_dim;
      const float* s = sin.data_ptr<float>() + t * head_dim;
      for (const auto head : c10::irange(num_heads + num_kv_heads))
        rotate(qkv_data + t * row + head * head_dim, c, s, head_dim);
    }
    // Views in the model's layouts: q [1, heads, tokens, dim], k and v [1, kv_heads, tokens, dim].
    auto q = qkv.narrow(1, 0, q_size).view({1, tokens, num_heads, head_dim}).transpose(1, 2);
    auto k = qkv.narrow(1, q_size, kv_size).unsqueeze(0).unflatten(2, {num_kv_heads, head_dim})
                 .transpose(1, 2);
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).unsqueeze(0)
                 .unflatten(2, {num_kv_heads, head_dim}).transpose(1, 2);
    auto attended = tetrad::paged_decode(q, k_cache, v_cache, tables, context_lens,
                                         1.0 / std::sqrt(static_cast<double>(head_dim)), k, v,
                                         slots, rows_read);  // [1, heads, tokens, dim]
    residual = x.clone();
    add_into(residual, linear_rows(attended.transpose(1, 2).reshape({tokens, q_size}), out_w,
                                   std::nullopt, out_scales));
    norm(residual, mlp_norm_w);
    auto gate_up = linear_rows(h, up_w, std::nullopt, up_scales);  // [tokens, 2 ffn]
    auto act = at::empty({tokens, ffn}, x.options());
    const T* gu = gate_up.data_ptr<T>();
    T* a = act.data_ptr<T>();
    for (const auto t : c10::irange(tokens))
      for (const auto f : c10::irange(ffn)) {
        const float g = to_float(gu[t * 2 * ffn + f]);
        const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
        a[t * ffn + f] = static_cast<T>(to_float(silu) * to_float(gu[t * 2 * ffn + ffn + f]));
      }
    add_into(residual, linear_rows(act, down_w, std::nullopt, down_scales));
  });
  return residual;
}

// cos and sin [tokens, head_dim] fp32 of RotaryEmbedding at `positions`: each angle position *
// inv_freq in fp32 as torch multiplies it, its cosine and sine taken in double and rounded once
// (torch's own are within an ulp of that), times rope scaling's attention factor.
std::pair<at::Tensor, at::Tensor> rotary_rows(const at::Tensor& positions,
                                              const at::Tensor& inv_freq, double factor) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && inv_freq.scalar_type() == at::kFloat,
              "decode_model: int64 positions and fp32 inverse frequencies");
  const auto freqs = inv_freq.contiguous();
  const auto pos = positions.contiguous();
  const int64_t tokens = pos.numel(), half = freqs.numel(), head_dim = 2 * half;
  auto cos = at::empty({tokens, head_dim}, freqs.options());
  auto sin = at::empty({tokens, head_dim}, freqs.options());
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* f = freqs.data_ptr<float>();
  float* c = cos.data_ptr<float>();
  float* s = sin.data_ptr<float>();
  for (const auto t : c10::irange(tokens))
    for (const auto d : c10::irange(half)) {
      const double angle = static_cast<float>(p[t]) * f[d];
      c[t * head_dim + d] = c[t * head_dim + half + d] =
          static_cast<float>(std::cos(angle)) * static_cast<float>(factor);
      s[t * head_dim + d] = s[t * head_dim + half + d] =
          static_cast<float>(std::sin(angle)) * static_cast<float>(factor);
    }
  return {cos, sin};
}

// A whole decode step, one token per sequence: the embedding rows of `ids`, every layer
// (decode_layer, six weights and four optional scales each, in its order; the rotary angles of
// `positions`), the final RMSNorm and the output head -> logits [tokens, vocab]. One call from
// Python per step, where the step was an embedding, rotary angles, a norm and a call per layer
// and for the head (~100 us of small torch ops per step on a 2-core EPYC).
at::Tensor decode_model(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& embed,
                        const at::Tensor& inv_freq, double rotary_factor,
                        at::TensorList layer_weights,
                        const c10::List<std::optional<at::Tensor>>& layer_scales,
                        at::TensorList k_caches, at::TensorList v_caches, double eps,
                        int64_t num_heads, int64_t num_kv_heads, const at::Tensor& tables,
                        const at::Tensor& context_lens, const at::Tensor& slots,
                        const at::Tensor& norm_w, const at::Tensor& head_w,
                        const std::optional<at::Tensor>& head_scales,
                        const std::optional<at::Tensor>& rows_read) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(layer_weights.size()) == 6 * layers &&
                  static_cast<int64_t>(layer_scales.size()) == 4 * layers,
              "decode_model: six weights, four scales and a K and V cache per layer");
  auto x = embed.index_select(0, ids);
  const auto [cos, sin] = rotary_rows(positions, inv_freq, rotary_factor);
  for (const auto l : c10::irange(layers)) {
    const at::Tensor* w = layer_weights.data() + 6 * l;
    x = decode_layer(x, w[0], w[1], w[2], w[3], w[4], w[5], eps, cos, sin, num_heads,
                     num_kv_heads, k_caches[l], v_caches[l], tables, context_lens, slots,
                     rows_read, layer_scales.get(4 * l), layer_scales.get(4 * l + 1),
                     layer_scales.get(4 * l + 2), layer_scales.get(4 * l + 3));
  }
  auto normed = at::empty_like(x);
  TETRAD_DISPATCH(x.scalar_type(), "decode_model", [&] {
    rms_norm_rows(x.data_ptr<scalar_t>(), norm_w.data_ptr<scalar_t>(), x.size(0), x.size(1), eps,
                  normed.data_ptr<scalar_t>());
  });
  return linear_rows(normed, head_w, std::nullopt, head_scales);
}

// How many of torch's threads at::parallel_for hands `items` chunks of work to in this library:
// at::parallel_for is a header template, so it runs in parallel only where the library itself is
// built with OpenMP (-fopenmp), not merely linked against torch's.
int64_t parallel_threads(int64_t items) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (at::get_thread_num() % 64));
  });
  return __builtin_popcountll(seen.load());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tetrad, m) {
  m.def("parallel_threads(int items) -> int");
  m.def("linear_rows(Tensor x, Tensor w, Tensor? bias=None, Tensor? scales=None) -> Tensor");
  m.def("decode_model(Tensor ids, Tensor positions, Tensor embed, Tensor inv_freq, "
        "float rotary_factor, Tensor[] layer_weights, Tensor?[] layer_scales, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, float eps, int num_heads, "
        "int num_kv_heads, Tensor tables, Tensor context_lens, Tensor slots, Tensor norm_w, "
        "Tensor head_w, Tensor? head_scales=None, Tensor(c!)? rows_read=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tetrad, CPU, m) {
  m.impl("linear_rows", linear_rows);
  m.impl("decode_model", decode_model);
}

TORCH_LIBRARY_IMPL(tetrad, CompositeExplicitAutograd, m) {
  m.impl("parallel_threads", parallel_threads);
}
