// Decode attention on a CPU straight from the paged K/V pool: each sequence's one query token
// attends over its context through its block table, reading each cached K and V row once (the
// query heads that share a KV head are served by the same read), with the flash-attention
// running max and sum kept per head, so nothing is gathered, padded or masked (the arithmetic is
// attend_rows.h's, which decode_step.cpp's fused step calls on its own buffers).
// Built and loaded by tetrad/inference/worker/cpu_kernels.py as torch.ops.tetrad.paged_decode.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>

#include "attend_rows.h"

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
  // [1, seqs, heads, value_dim] in memory, returned as the model's [1, heads, seqs, value_dim].
  TORCH_CHECK(table.size(0) == seqs && lens.numel() == seqs, "paged_decode: one table per query");
  tetrad::attention::check_tables(lens.data_ptr<int64_t>(), table.data_ptr<int64_t>(), seqs,
                                  width, block_size, k_cache.size(0));
  auto out = at::empty({1, seqs, heads, value_dim}, q.options());
  int64_t rows = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (new_k.has_value()) {
      TORCH_CHECK(slots.has_value() && slots->scalar_type() == at::kLong, "paged_decode: slots");
      const auto slot_ids = slots->contiguous();
      const int64_t* ids = slot_ids.data_ptr<int64_t>();
      write_rows<scalar_t>(*new_k, k_cache, ids, slot_ids.numel());
      if (new_v.has_value()) write_rows<scalar_t>(*new_v, v_cache, ids, slot_ids.numel());
    }
    rows = tetrad::attention::attend_rows(
        query.data_ptr<scalar_t>(), heads * dim, heads, seqs,
        tetrad::attention::paged_cache<scalar_t>(k_cache, v_cache), table.data_ptr<int64_t>(),
        width, lens.data_ptr<int64_t>(), static_cast<float>(scale), out.data_ptr<scalar_t>(),
        heads * value_dim);
  });
  if (rows_read.has_value()) rows_read->add_(rows);
  return out.transpose(1, 2);
}

}  // namespace tetrad

TORCH_LIBRARY(tetrad, m) {
  m.def("paged_decode(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor tables, "
        "Tensor context_lens, float scale, Tensor? new_k=None, Tensor? new_v=None, "
        "Tensor? slots=None, Tensor(c!)? rows_read=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tetrad, CPU, m) { m.impl("paged_decode", tetrad::paged_decode); }
