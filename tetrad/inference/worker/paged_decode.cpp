// Decode attention on a CPU straight from the paged K/V pool: each sequence's one query token
// attends over its context through its block table, reading each cached K and V row once (the
// query heads that share a KV head are served by the same read), with the flash-attention
// running max and sum kept per head, so nothing is gathered, padded or masked.
// Built and loaded by tetrad/inference/worker/cpu_kernels.py as torch.ops.tetrad.paged_decode;
// decode_step.cpp's fused layer calls it directly (tetrad::paged_decode).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Writes row t of `rows` [1, kv_heads, seqs, width] at pool slot slots[t] of `cache`.
template <typename scalar_t>
void write_rows(const at::Tensor& new_rows, const at::Tensor& cache, const int64_t* slots,
                int64_t num_slots) {
  TORCH_CHECK(new_rows.scalar_type() == cache.scalar_type() && new_rows.dim() == 4 &&
                  new_rows.size(1) == cache.size(2) && new_rows.size(2) == num_slots &&
                  new_rows.size(3) == cache.size(3),
              "paged_decode: new rows of the cache's dtype, [1, kv_heads, seqs, width]");
  for (const auto t : c10::irange(num_slots))
    TORCH_CHECK(slots[t] >= 0 && slots[t] < cache.size(0) * cache.size(1),
                "paged_decode: slot outside the pool");
  const auto rows = new_rows.stride(3) == 1 ? new_rows : new_rows.contiguous();
  const auto* src = rows.data_ptr<scalar_t>();
  auto* dst = cache.data_ptr<scalar_t>();
  const int64_t block_size = cache.size(1), width = rows.size(3);
  for (const auto t : c10::irange(rows.size(2)))
    for (const auto h : c10::irange(rows.size(1))) {
      const auto* from = src + h * rows.stride(1) + t * rows.stride(2);
      auto* to = dst + slots[t] / block_size * cache.stride(0) +
                 slots[t] % block_size * cache.stride(1) + h * cache.stride(2);
      std::copy(from, from + width, to);
    }
}

}  // namespace

namespace tetrad {

// In the model's layout, one query per sequence: q [1, heads, seqs, dim] -> [1, heads, seqs,
// value_dim]. k_cache [blocks, block_size, kv_heads, dim] and v_cache [blocks, block_size,
// kv_heads, value_dim], any strides but a unit last one (MLA's values are a column slice of its
// keys); tables [seqs, width] int64; context_lens [seqs] int64: keys 0..len-1 are visible.
// new_k [1, kv_heads, seqs, dim] and new_v (absent for MLA, whose values live in its keys), when
// given, are first written at `slots` (the step's own tokens, which they attend to). rows_read [1]
// int64, when given, gains the K and V rows read (one per token and KV head each): the
// benchmark's and the tests' count of what the kernel touched.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& context_lens, double scale,
                        const std::optional<at::Tensor>& new_k,
                        const std::optional<at::Tensor>& new_v,
                        const std::optional<at::Tensor>& slots,
                        const std::optional<at::Tensor>& rows_read) {
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_decode: shapes");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "paged_decode: unit last stride");
  TORCH_CHECK(tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode: int64 tables and lengths");
  const auto query = q.transpose(1, 2).contiguous();  // [1, seqs, heads, dim]: a no-op or small
  const auto table = tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t heads = q.size(1), seqs = q.size(2), dim = q.size(3);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t value_dim = v_cache.size(3), width = table.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "paged_decode: head shapes");
  const int64_t group = heads / kv_heads;
  // [1, seqs, heads, value_dim] in memory, returned as the model's [1, heads, seqs, value_dim].
  TORCH_CHECK(table.size(0) == seqs && lens.numel() == seqs, "paged_decode: one table per query");
  // Every block a context reaches must be a block of the pool: a bad table fails here, never
  // as a read outside the pool.
  const int64_t* lens_in = lens.data_ptr<int64_t>();
  const int64_t* blocks_in = table.data_ptr<int64_t>();
  for (const auto s : c10::irange(seqs)) {
    const int64_t used = (lens_in[s] + block_size - 1) / block_size;
    TORCH_CHECK(lens_in[s] >= 1 && used <= width, "paged_decode: context longer than its table");
    for (const auto j : c10::irange(used))
      TORCH_CHECK(blocks_in[s * width + j] >= 0 && blocks_in[s * width + j] < k_cache.size(0),
                  "paged_decode: block id outside the pool");
  }
  auto out = at::empty({1, seqs, heads, value_dim}, q.options());
  std::atomic<int64_t> rows{0};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (new_k.has_value()) {
      TORCH_CHECK(slots.has_value() && slots->scalar_type() == at::kLong, "paged_decode: slots");
      const auto slot_ids = slots->contiguous();
      const int64_t* ids = slot_ids.data_ptr<int64_t>();
      write_rows<scalar_t>(*new_k, k_cache, ids, slot_ids.numel());
      if (new_v.has_value()) write_rows<scalar_t>(*new_v, v_cache, ids, slot_ids.numel());
    }
    const scalar_t* q_data = query.data_ptr<scalar_t>();
    const scalar_t* k_data = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_data = v_cache.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    const int64_t* table_data = table.data_ptr<int64_t>();
    const int64_t* len_data = lens.data_ptr<int64_t>();
    const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
    const int64_t vb = v_cache.stride(0), vs = v_cache.stride(1), vh = v_cache.stride(2);
    const float fscale = static_cast<float>(scale);

    at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(group * dim), acc(group * value_dim), scores(group * block_size);
      std::vector<float> row_max(group), row_sum(group), block_max(group);
      int64_t touched = 0;
      for (const auto item : c10::irange(begin, end)) {
        const int64_t s = item / kv_heads, h = item % kv_heads, len = len_data[s];
        const scalar_t* q_heads = q_data + (s * heads + h * group) * dim;  // the group's heads
        for (const auto i : c10::irange(group * dim))
          qf[i] = static_cast<float>(q_heads[i]) * fscale;
        std::fill(acc.begin(), acc.end(), 0.f);
        // The lowest finite float, not -inf: the build uses -ffast-math, which assumes no inf.
        std::fill(row_max.begin(), row_max.end(), std::numeric_limits<float>::lowest());
        std::fill(row_sum.begin(), row_sum.end(), 0.f);
        for (int64_t first = 0; first < len; first += block_size) {
          const int64_t block = table_data[s * width + first / block_size];
          const int64_t n = std::min(block_size, len - first);
          const scalar_t* k_block = k_data + block * kb + h * kh;
          const scalar_t* v_block = v_data + block * vb + h * vh;
          // Each key and value row is loaded once for all the query heads that share it.
          for (const auto t : c10::irange(n)) {
            const scalar_t* key = k_block + t * ks;
            for (const auto g : c10::irange(group)) {
              const float* qg = qf.data() + g * dim;
              float dot = 0.f;
              _Pragma("omp simd reduction(+ : dot)")
              for (int64_t d = 0; d < dim; ++d) dot += qg[d] * static_cast<float>(key[d]);
              scores[g * block_size + t] = dot;
              block_max[g] = std::max(t == 0 ? row_max[g] : block_max[g], dot);
            }
          }
          // Rescale what earlier blocks summed to the new maximum, then add this block.
          for (const auto g : c10::irange(group)) {
            const float correction = std::exp(row_max[g] - block_max[g]);
            row_max[g] = block_max[g];
            row_sum[g] *= correction;
            float* acc_g = acc.data() + g * value_dim;
            for (int64_t d = 0; d < value_dim; ++d) acc_g[d] *= correction;
            float* scores_g = scores.data() + g * block_size;
            _Pragma("omp simd")
            for (int64_t t = 0; t < n; ++t) scores_g[t] = std::exp(scores_g[t] - block_max[g]);
          }
          for (const auto t : c10::irange(n)) {
            const scalar_t* value = v_block + t * vs;
            for (const auto g : c10::irange(group)) {
              const float p = scores[g * block_size + t];
              row_sum[g] += p;
              float* acc_g = acc.data() + g * value_dim;
              _Pragma("omp simd")
              for (int64_t d = 0; d < value_dim; ++d) acc_g[d] += p * static_cast<float>(value[d]);
            }
          }
          touched += 2 * n;
        }
        for (const auto g : c10::irange(group)) {
          scalar_t* dst = out_data + (s * heads + h * group + g) * value_dim;
          const float inv = row_sum[g] > 0.f ? 1.f / row_sum[g] : 0.f;
          for (const auto d : c10::irange(value_dim))
            dst[d] = static_cast<scalar_t>(acc[g * value_dim + d] * inv);
        }
      }
      rows += touched;
    });
  });
  if (rows_read.has_value()) rows_read->add_(rows.load());
  return out.transpose(1, 2);
}

}  // namespace tetrad

TORCH_LIBRARY(tetrad, m) {
  m.def("paged_decode(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor tables, "
        "Tensor context_lens, float scale, Tensor? new_k=None, Tensor? new_v=None, "
        "Tensor? slots=None, Tensor(c!)? rows_read=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tetrad, CPU, m) { m.impl("paged_decode", tetrad::paged_decode); }
