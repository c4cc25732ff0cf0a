// A CPU decode step of a Llama-family model as one op (torch.ops.tetrad.decode_model), and the
// weight-streaming matmul it is built on (torch.ops.tetrad.linear_rows).
//
// Why: at one token per sequence a layer is ~30 small torch ops, each a dispatch and an
// allocation, around four matmuls that only stream their weights; and torch's bf16 matmul at one
// row reads its weights at a fraction of the memory's speed. Here a step is one call: the
// embedding rows and rotary angles; per layer RMSNorm, QKV, rotary, the paged attention
// (attend_rows.h), the output projection and residual, RMSNorm, gate/up, SiLU * up, down and
// residual; the final RMSNorm and the output head. The elementwise steps round to the model's
// dtype where torch's eager ops would (a norm's fp32 result cast, then times its weight; SiLU,
// then the product), so the step follows the eager forward's numerics. Projections may be
// int8 or int4 (quant_rows.cpp), read in the layouts tetrad.models.quant holds them in.
// Built with paged_decode.cpp and quant_rows.cpp into one library by cpu_kernels.py.
// Inside the step no tensor is made per layer: the layers work in the step's own buffers.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>

#include "attend_rows.h"
#include "stream_rows.h"

namespace tetrad {
at::Tensor quantized_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales);
void check_quantized(int64_t K, const at::Tensor& w, const at::Tensor& scales);
bool quantized_rows_into(const float* x, int64_t M, int64_t K, const at::Tensor& w,
                         const at::Tensor& scales, float* out);
}

namespace {

using namespace tetrad::stream;

// Whether a plain weight w is streamed for M rows of `dtype` activations: a decode batch's rows
// (kMaxStreamedRows) against a contiguous weight of their dtype; else at::linear takes them.
bool streams(int64_t M, const at::Tensor& w, at::ScalarType dtype) {
  return M <= (dtype == at::kFloat ? kMaxStreamedRowsFp32 : kMaxStreamedRows) &&
         w.is_contiguous() && w.scalar_type() == dtype && dtype != at::kDouble;
}

// x [M, K] @ w [N, K]^T (+ bias) in x's dtype, streamed (fp32 accumulation) where `streams`
// says, else at::linear. With `scales`, w is quantized as tetrad.models.quant holds it
// (quant_rows.cpp).
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
  if (!streams(M, w, x.scalar_type())) return at::linear(x, w, bias);
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

// A projection's weight as the fused step reads it: plain, of the step's dtype, or quantized
// (`scales` given: int8 [N, K] or torch's packed int4 [N, K / 2], quant_rows.cpp).
struct Projection {
  const at::Tensor& weight;
  const std::optional<at::Tensor>& scales;
};

// The fp32 activations and products of one step, reused by every projection of every layer.
struct Scratch {
  std::vector<float> x, product;
  float* sized(std::vector<float>& buffer, int64_t size) {
    if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    return buffer.data();
  }
};

// y [M, N] = x [M, K] @ w^T in T: the weight streamed (fp32 accumulation, rounded once to T)
// where linear_rows streams it, else torch's product (at::linear, the packed int8/int4 kernels).
template <typename T>
void project(const T* x, int64_t M, int64_t K, const Projection& w, T* y, Scratch& scratch) {
  const int64_t N = w.weight.size(0);
  float* xf = scratch.sized(scratch.x, M * K);
  float* product = scratch.sized(scratch.product, M * N);
  for (const auto i : c10::irange(M * K)) xf[i] = to_float(x[i]);
  constexpr auto dtype = c10::CppTypeToScalarType<T>::value;
  bool streamed;
  if (w.scales.has_value()) {
    tetrad::check_quantized(K, w.weight, *w.scales);
    streamed = tetrad::quantized_rows_into(xf, M, K, w.weight, *w.scales, product);
  } else {
    TORCH_CHECK(w.weight.dim() == 2 && w.weight.size(1) == K, "decode_model: projection shapes");
    streamed = streams(M, w.weight, dtype);
    if (streamed) stream_matmul(xf, M, w.weight.data_ptr<T>(), N, K, product);
  }
  if (streamed) {
    for (const auto i : c10::irange(M * N)) y[i] = static_cast<T>(product[i]);
    return;
  }
  const at::Tensor rows =
      at::from_blob(const_cast<T*>(x), {M, K}, at::TensorOptions().dtype(dtype));
  const at::Tensor result = linear_rows(rows, w.weight, std::nullopt, w.scales).contiguous();
  std::copy(result.data_ptr<T>(), result.data_ptr<T>() + M * N, y);
}

// x + f(x) in place, rounded to the dtype as torch's eager add is.
template <typename T>
void add_into(T* x, const T* delta, int64_t size) {
  for (const auto i : c10::irange(size)) x[i] = static_cast<T>(to_float(x[i]) + to_float(delta[i]));
}

// What every layer of one step shares: its shapes, the rotary angles and the sequences' block
// tables (checked once), and the buffers each layer writes over.
template <typename T>
struct Step {
  int64_t tokens, hidden, heads, kv_heads, head_dim;
  double eps;
  std::vector<float> cos, sin;  // [tokens, head_dim]
  const int64_t *tables, *lens, *slots;
  int64_t width;
  std::vector<T> h, qkv, attended, delta, gate_up, act;
  Scratch scratch;
  int64_t rows_read = 0;
};

// One decoder layer in place on the residual stream x [tokens, hidden]: RMSNorm, QKV, rotary,
// the new K/V rows written at the step's slots, paged attention (attend_rows.h), the output
// projection and residual, RMSNorm, gate/up, SiLU * up, down and residual. `w`: the layer's
// attention norm, qkv [(heads + 2 kv_heads) * head_dim, hidden], out [hidden, heads * head_dim],
// MLP norm, up [2 ffn, hidden] (gate rows first), down [hidden, ffn]; `scales` the four
// projections' (absent for a plain one).
template <typename T>
void decode_layer(Step<T>& step, T* x, const at::Tensor* w,
                  const c10::List<std::optional<at::Tensor>>& scales, int64_t first_scale,
                  const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const int64_t tokens = step.tokens, hidden = step.hidden, head_dim = step.head_dim;
  const int64_t q_size = step.heads * head_dim, kv_size = step.kv_heads * head_dim;
  const int64_t row = q_size + 2 * kv_size, ffn = w[4].size(0) / 2;
  TORCH_CHECK(w[1].size(0) == row && w[4].size(0) % 2 == 0 && w[5].size(0) == hidden,
              "decode_model: projection shapes");
  const std::optional<at::Tensor> qkv_s = scales.get(first_scale),
                                  out_s = scales.get(first_scale + 1),
                                  up_s = scales.get(first_scale + 2),
                                  down_s = scales.get(first_scale + 3);
  T* h = step.h.data();
  T* qkv = step.qkv.data();
  rms_norm_rows(x, w[0].data_ptr<T>(), tokens, hidden, step.eps, h);
  project(h, tokens, hidden, Projection{w[1], qkv_s}, qkv, step.scratch);
  T* k_pool = k_cache.data_ptr<T>();
  T* v_pool = v_cache.data_ptr<T>();
  const int64_t block_size = k_cache.size(1);
  for (const auto t : c10::irange(tokens)) {
    T* token = qkv + t * row;
    for (const auto head : c10::irange(step.heads + step.kv_heads))
      rotate(token + head * head_dim, step.cos.data() + t * head_dim,
             step.sin.data() + t * head_dim, head_dim);
    const int64_t block = step.slots[t] / block_size, slot = step.slots[t] % block_size;
    for (const auto j : c10::irange(step.kv_heads)) {  // the step's own K and V rows
      const T* key = token + q_size + j * head_dim;
      const T* value = token + q_size + kv_size + j * head_dim;
      std::copy(key, key + head_dim, k_pool + block * k_cache.stride(0) +
                                         slot * k_cache.stride(1) + j * k_cache.stride(2));
      std::copy(value, value + head_dim, v_pool + block * v_cache.stride(0) +
                                             slot * v_cache.stride(1) + j * v_cache.stride(2));
    }
  }
  step.rows_read += tetrad::attention::attend_rows(
      qkv, row, step.heads, tokens, tetrad::attention::paged_cache<T>(k_cache, v_cache),
      step.tables, step.width, step.lens,
      static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim))), step.attended.data(),
      q_size);
  project(step.attended.data(), tokens, q_size, Projection{w[2], out_s}, step.delta.data(),
          step.scratch);
  add_into(x, step.delta.data(), tokens * hidden);
  rms_norm_rows(x, w[3].data_ptr<T>(), tokens, hidden, step.eps, h);
  T* gate_up = step.gate_up.data();
  project(h, tokens, hidden, Projection{w[4], up_s}, gate_up, step.scratch);
  T* act = step.act.data();
  for (const auto t : c10::irange(tokens))
    for (const auto f : c10::irange(ffn)) {
      const float g = to_float(gate_up[t * 2 * ffn + f]);
      const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
      act[t * ffn + f] = static_cast<T>(to_float(silu) * to_float(gate_up[t * 2 * ffn + ffn + f]));
    }
  project(act, tokens, ffn, Projection{w[5], down_s}, step.delta.data(), step.scratch);
  add_into(x, step.delta.data(), tokens * hidden);
}

// cos and sin [tokens, head_dim] of RotaryEmbedding at `positions`: each angle position *
// inv_freq in fp32 as torch multiplies it, its cosine and sine taken in double and rounded once
// (torch's own are within an ulp of that), times rope scaling's attention factor.
void rotary_rows(const int64_t* positions, int64_t tokens, const float* inv_freq, int64_t half,
                 double factor, float* cos, float* sin) {
  const int64_t head_dim = 2 * half;
  for (const auto t : c10::irange(tokens))
    for (const auto d : c10::irange(half)) {
      const double angle = static_cast<float>(positions[t]) * inv_freq[d];
      cos[t * head_dim + d] = cos[t * head_dim + half + d] =
          static_cast<float>(std::cos(angle)) * static_cast<float>(factor);
      sin[t * head_dim + d] = sin[t * head_dim + half + d] =
          static_cast<float>(std::sin(angle)) * static_cast<float>(factor);
    }
}

// A whole decode step, one token per sequence: the embedding rows of `ids`, every layer
// (decode_layer, six weights and four optional scales each, in its order; the rotary angles of
// `positions`), the final RMSNorm and the output head -> logits [tokens, vocab]. One call from
// Python per step, and inside it no tensor is made per layer: each layer works in the step's
// own buffers (at 32M the views, copies and attention op's tensors a layer made took
// 0.34-0.49 ms a step, timed inside the op: BENCHMARKS.md).
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
  for (const auto& index : {ids, positions, tables, context_lens, slots})
    TORCH_CHECK(index.scalar_type() == at::kLong && index.is_contiguous(),
                "decode_model: contiguous int64 ids, positions, tables, lengths and slots");
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous(),
              "decode_model: fp32 inverse frequencies");
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(), "decode_model: a contiguous embedding");
  const int64_t tokens = ids.numel(), hidden = embed.size(1), half = inv_freq.numel();
  TORCH_CHECK(positions.numel() == tokens && slots.numel() == tokens &&
                  context_lens.numel() == tokens && tables.dim() == 2 && tables.size(0) == tokens,
              "decode_model: one position, slot, length and table per token");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "decode_model: head counts");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (const auto t : c10::irange(tokens))
    TORCH_CHECK(id[t] >= 0 && id[t] < embed.size(0),
                "decode_model: token id outside the vocabulary");
  const auto dtype = embed.scalar_type();
  for (const auto& cache : {k_caches, v_caches})
    for (const auto& pool : cache)
      TORCH_CHECK(pool.scalar_type() == dtype && pool.dim() == 4 && pool.stride(3) == 1 &&
                      pool.sizes() == k_caches[0].sizes() && pool.size(2) == num_kv_heads &&
                      pool.size(3) == 2 * half,
                  "decode_model: K and V pools [blocks, block_size, kv_heads, head_dim] of the "
                  "model's dtype, the same for every layer");
  for (const auto l : c10::irange(layers))
    for (const auto j : {0, 3})
      TORCH_CHECK(layer_weights[6 * l + j].scalar_type() == dtype &&
                      layer_weights[6 * l + j].numel() == hidden,
                  "decode_model: norm weights [hidden] of the model's dtype");
  TORCH_CHECK(norm_w.scalar_type() == dtype && norm_w.numel() == hidden,
              "decode_model: a final norm [hidden] of the model's dtype");
  const int64_t* slot = slots.data_ptr<int64_t>();
  if (layers > 0) {
    const int64_t pool_slots = k_caches[0].size(0) * k_caches[0].size(1);
    for (const auto t : c10::irange(tokens))
      TORCH_CHECK(slot[t] >= 0 && slot[t] < pool_slots, "paged_decode: slot outside the pool");
    tetrad::attention::check_tables(context_lens.data_ptr<int64_t>(), tables.data_ptr<int64_t>(),
                                    tokens, tables.size(1), k_caches[0].size(1),
                                    k_caches[0].size(0));
  }
  at::Tensor logits;
  TETRAD_DISPATCH(dtype, "decode_model", [&] {
    using T = scalar_t;
    const int64_t head_dim = 2 * half;
    Step<T> step{tokens, hidden, num_heads, num_kv_heads, head_dim, eps,
                 std::vector<float>(tokens * head_dim), std::vector<float>(tokens * head_dim),
                 tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), slot,
                 tables.size(1)};
    rotary_rows(positions.data_ptr<int64_t>(), tokens, inv_freq.data_ptr<float>(), half,
                rotary_factor, step.cos.data(), step.sin.data());
    int64_t widest = 0;  // the longest row a layer's buffers hold
    for (const auto l : c10::irange(layers))
      widest = std::max(widest, layer_weights[6 * l + 4].size(0));
    const int64_t q_size = num_heads * head_dim, row = q_size + 2 * num_kv_heads * head_dim;
    step.h.resize(tokens * hidden);
    step.qkv.resize(tokens * row);
    step.attended.resize(tokens * q_size);
    step.delta.resize(tokens * hidden);
    step.gate_up.resize(tokens * widest);
    step.act.resize(tokens * widest / 2);
    std::vector<T> x(tokens * hidden);
    const T* table = embed.data_ptr<T>();
    for (const auto t : c10::irange(tokens))
      std::copy(table + id[t] * hidden, table + (id[t] + 1) * hidden, x.data() + t * hidden);
    for (const auto l : c10::irange(layers))
      decode_layer(step, x.data(), layer_weights.data() + 6 * l, layer_scales, 4 * l,
                   k_caches[l], v_caches[l]);
    rms_norm_rows(x.data(), norm_w.data_ptr<T>(), tokens, hidden, eps, step.h.data());
    logits = at::empty({tokens, head_w.size(0)}, embed.options());
    project(step.h.data(), tokens, hidden, Projection{head_w, head_scales}, logits.data_ptr<T>(),
            step.scratch);
    if (rows_read.has_value()) rows_read->add_(step.rows_read);
  });
  return logits;
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
