// The arithmetic of paged decode attention on raw rows, shared by the paged_decode op
// (paged_decode.cpp) and the fused decode step (decode_step.cpp), which calls it on its own
// buffers with no tensor made per layer. One query token per sequence attends over its context
// through its block table, reading each cached K and V row once (the query heads that share a KV
// head are served by the same read), with the flash-attention running max and sum kept per head.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace tetrad::attention {

// Where the cached rows are: element [block, slot, head, d] of K at
// k + block * k_strides[0] + slot * k_strides[1] + head * k_strides[2] + d, likewise V.
template <typename T>
struct PagedCache {
  const T* k;
  const T* v;
  int64_t k_strides[3], v_strides[3];
  int64_t block_size, kv_heads, dim, value_dim;
};

// The pools [blocks, block_size, kv_heads, dim] and [..., value_dim], any strides but a unit last.
template <typename T>
PagedCache<T> paged_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  return {k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
          {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)},
          {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)},
          k_cache.size(1), k_cache.size(2), k_cache.size(3), v_cache.size(3)};
}

// Every block a context reaches must be a block of the pool: a bad table fails here, never as a
// read outside the pool.
inline void check_tables(const int64_t* lens, const int64_t* tables, int64_t seqs, int64_t width,
                         int64_t block_size, int64_t pool_blocks) {
  for (const auto s : c10::irange(seqs)) {
    const int64_t used = (lens[s] + block_size - 1) / block_size;
    TORCH_CHECK(lens[s] >= 1 && used <= width, "paged_decode: context longer than its table");
    for (const auto j : c10::irange(used))
      TORCH_CHECK(tables[s * width + j] >= 0 && tables[s * width + j] < pool_blocks,
                  "paged_decode: block id outside the pool");
  }
}

// Query heads of sequence s at q + s * q_stride (head after head, `dim` each), the output's at
// out + s * out_stride (`value_dim` each); tables [seqs, width] and lens [seqs] as paged_decode
// takes them (already checked against the pool). Returns the K and V rows read.
template <typename T>
int64_t attend_rows(const T* q, int64_t q_stride, int64_t heads, int64_t seqs,
                    const PagedCache<T>& cache, const int64_t* tables, int64_t width,
                    const int64_t* lens, float scale, T* out, int64_t out_stride) {
  const int64_t kv_heads = cache.kv_heads, dim = cache.dim, value_dim = cache.value_dim;
  const int64_t block_size = cache.block_size, group = heads / kv_heads;
  std::atomic<int64_t> rows{0};
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * value_dim), scores(group * block_size);
    std::vector<float> row_max(group), row_sum(group), block_max(group);
    int64_t touched = 0;
    for (const auto item : c10::irange(begin, end)) {
      const int64_t s = item / kv_heads, h = item % kv_heads, len = lens[s];
      const T* q_heads = q + s * q_stride + h * group * dim;  // the group's heads
      for (const auto i : c10::irange(group * dim)) qf[i] = static_cast<float>(q_heads[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      // The lowest finite float, not -inf: the build uses -ffast-math, which assumes no inf.
      std::fill(row_max.begin(), row_max.end(), std::numeric_limits<float>::lowest());
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      for (int64_t first = 0; first < len; first += block_size) {
        const int64_t block = tables[s * width + first / block_size];
        const int64_t n = std::min(block_size, len - first);
        const T* k_block = cache.k + block * cache.k_strides[0] + h * cache.k_strides[2];
        const T* v_block = cache.v + block * cache.v_strides[0] + h * cache.v_strides[2];
        // Each key and value row is loaded once for all the query heads that share it.
        for (const auto t : c10::irange(n)) {
          const T* key = k_block + t * cache.k_strides[1];
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
          const T* value = v_block + t * cache.v_strides[1];
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
        T* dst = out + s * out_stride + (h * group + g) * value_dim;
        const float inv = row_sum[g] > 0.f ? 1.f / row_sum[g] : 0.f;
        for (const auto d : c10::irange(value_dim))
          dst[d] = static_cast<T>(acc[g * value_dim + d] * inv);
      }
    }
    rows += touched;
  });
  return rows.load();
}

}  // namespace tetrad::attention
