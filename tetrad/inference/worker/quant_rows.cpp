// The quantized weights of tetrad.models.quant streamed for a few rows of activations, read in
// the very tensors the layers hold (no second copy, so the bytes the planner counts are all
// there is), dequantized in registers, fp32 accumulation, rounded once to the activations'
// dtype: the arithmetic of torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu, which
// the eager forward calls, up to fp32 rounding. Past kMaxStreamedRows rows those kernels run.
//
// int8: values [N, K] int8, one scale per output row: y = (x . values[n]) * scale[n].
// int4: torch's CPU packing of values 0..15 (uint8 [N, K / 2]) and per group of input columns
// scales_and_offsets [K / group, N, 2]: w = (q - 8) * scale + offset. Per group the kernel
// sums x * q and takes y += scale * (sum(x * q) - 8 sum(x)) + offset * sum(x), so only the
// group's end touches the scales.

#include <ATen/core/Tensor.h>
#include <ATen/ops/_convert_weight_to_int4pack_for_cpu.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/empty.h>

#include <utility>

#include "stream_rows.h"

namespace {

using namespace tetrad::stream;

// torch packs int4 rows in blocks (64 rows where it runs AVX512 code, else 32). Within a full
// block of a "split" layout byte j holds row j (low nibble) and row j + rows / 2 (high); in
// "pairs" (torch's plain code, and every block short of full) rows 2j and 2j + 1. A block
// stores its k-th column as rows / 2 consecutive bytes.
enum class Int4Layout { kUnknown, kPairs, kSplit32, kSplit64 };

struct Int4Block {
  int64_t start, rows;
  bool split;
};

Int4Block int4_block(Int4Layout layout, int64_t N, int64_t index) {
  const int64_t full = layout == Int4Layout::kSplit64 ? 64 : 32, start = index * full;
  const int64_t rows = std::min(full, N - start);
  return {start, rows, layout != Int4Layout::kPairs && rows == full};
}

// The byte holding value [n, k] of an [N, K] matrix, and whether it is the high nibble.
std::pair<int64_t, bool> int4_nibble(Int4Layout layout, int64_t N, int64_t K, int64_t n,
                                     int64_t k) {
  const int64_t full = layout == Int4Layout::kSplit64 ? 64 : 32;
  const Int4Block block = int4_block(layout, N, n / full);
  const int64_t j = n - block.start, half = block.rows / 2;
  const int64_t byte = block.start * K / 2 + k * half + (block.split ? j % half : j / 2);
  return {byte, block.split ? j >= half : (j & 1) == 1};
}

// The layout torch packs in, in this process (it follows the CPU code torch dispatches to), read
// off a probe: any layout unlike these three leaves int4 to torch's own kernel.
Int4Layout torch_int4_layout() {
  static const Int4Layout layout = [] {
    constexpr int64_t N = 80, K = 2;  // a full block of either size, then a short one
    auto probe = at::empty({N, K}, at::TensorOptions().dtype(at::kInt));
    int32_t* values = probe.data_ptr<int32_t>();
    for (const auto i : c10::irange(N * K)) values[i] = (7 * (i / K) + 3 * (i % K) + i / 32) % 16;
    const auto packed = at::_convert_weight_to_int4pack_for_cpu(probe, 1).contiguous();
    const uint8_t* bytes = packed.data_ptr<uint8_t>();
    for (const auto candidate : {Int4Layout::kSplit32, Int4Layout::kSplit64, Int4Layout::kPairs}) {
      bool same = true;
      for (int64_t i = 0; i < N * K && same; ++i) {
        const auto [byte, high] = int4_nibble(candidate, N, K, i / K, i % K);
        same = (high ? bytes[byte] >> 4 : bytes[byte] & 15) == values[i];
      }
      if (same) return candidate;
    }
    return Int4Layout::kUnknown;
  }();
  return layout;
}

// One block of int4 rows for M rows of x (fp32 [M, K]): out[m][start + r] for its rows.
// `sums` [M, groups] are sum(x) per group; `pairs` the block's first (scale, offset).
template <int M, int C, bool kSplit, typename T>
void int4_block_rows(const float* x, int64_t K, const float* sums, int64_t group,
                     const uint8_t* w, const T* pairs, int64_t N, float* out, int64_t out_stride) {
  constexpr int R = 16 * C;  // the block's rows; C chunks of 8 bytes per input column
  const int64_t groups = K / group;
  float total[M][R] = {};
  alignas(32) float part[M][R];
  for (int64_t g = 0; g < groups; ++g) {
#ifdef TETRAD_AVX2
    const __m256i nibble = _mm256_set1_epi32(15);
    __m256 acc[M][2 * C];
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < 2 * C; ++v) acc[m][v] = _mm256_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      const uint8_t* column = w + k * 8 * C;
      __m256 xs[M];
      for (int m = 0; m < M; ++m) xs[m] = _mm256_set1_ps(x[m * K + k]);
      for (int c = 0; c < C; ++c) {
        const __m256i b = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(column + 8 * c)));
        const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(b, nibble));
        const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
        for (int m = 0; m < M; ++m) {
          acc[m][2 * c] = _mm256_fmadd_ps(low, xs[m], acc[m][2 * c]);
          acc[m][2 * c + 1] = _mm256_fmadd_ps(high, xs[m], acc[m][2 * c + 1]);
        }
      }
    }
    for (int m = 0; m < M; ++m)  // into row order
      for (int c = 0; c < C; ++c) {
        const __m256 low = acc[m][2 * c], high = acc[m][2 * c + 1];
        if constexpr (kSplit) {
          _mm256_store_ps(part[m] + 8 * c, low);
          _mm256_store_ps(part[m] + R / 2 + 8 * c, high);
        } else {  // low holds rows 16c + 2i, high rows 16c + 2i + 1
          const __m256 a = _mm256_unpacklo_ps(low, high), b = _mm256_unpackhi_ps(low, high);
          _mm256_store_ps(part[m] + 16 * c, _mm256_permute2f128_ps(a, b, 0x20));
          _mm256_store_ps(part[m] + 16 * c + 8, _mm256_permute2f128_ps(a, b, 0x31));
        }
      }
#else
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) part[m][r] = 0.f;
    for (int64_t k = g * group; k < (g + 1) * group; ++k)
      for (int j = 0; j < R / 2; ++j) {
        const uint8_t byte = w[k * 8 * C + j];
        const int low = kSplit ? j : 2 * j, high = kSplit ? j + R / 2 : 2 * j + 1;
        for (int m = 0; m < M; ++m) {
          part[m][low] += x[m * K + k] * (byte & 15);
          part[m][high] += x[m * K + k] * (byte >> 4);
        }
      }
#endif
    const T* scale_offset = pairs + g * N * 2;
    for (int m = 0; m < M; ++m) {
      const float sum = sums[m * groups + g];
      for (int r = 0; r < R; ++r)
        total[m][r] += to_float(scale_offset[2 * r]) * (part[m][r] - 8.f * sum) +
                       to_float(scale_offset[2 * r + 1]) * sum;
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m * out_stride + r] = total[m][r];
}

template <int M, typename T>
void int4_block_dispatch(const Int4Block& block, const float* x, int64_t K, const float* sums,
                         int64_t group, const uint8_t* w, const T* pairs, int64_t N, float* out,
                         int64_t out_stride) {
  const uint8_t* bytes = w + block.start * K / 2;
  const T* first = pairs + block.start * 2;
  float* rows = out + block.start;
  if (block.split && block.rows == 64)
    return int4_block_rows<M, 4, true>(x, K, sums, group, bytes, first, N, rows, out_stride);
  if (block.split)
    return int4_block_rows<M, 2, true>(x, K, sums, group, bytes, first, N, rows, out_stride);
  switch (block.rows) {  // torch's int4 rows come in multiples of 16
    case 16: return int4_block_rows<M, 1, false>(x, K, sums, group, bytes, first, N, rows, out_stride);
    case 32: return int4_block_rows<M, 2, false>(x, K, sums, group, bytes, first, N, rows, out_stride);
    default: return int4_block_rows<M, 3, false>(x, K, sums, group, bytes, first, N, rows, out_stride);
  }
}

// x fp32 [M, K] -> out fp32 [M, N], the packed weight's blocks split over torch's threads.
template <typename T>
void int4_matmul(Int4Layout layout, const float* x, int64_t M, const uint8_t* w, const T* pairs,
                 int64_t N, int64_t K, int64_t group, float* out) {
  const int64_t groups = K / group, full = layout == Int4Layout::kSplit64 ? 64 : 32;
  std::vector<float> sums(M * groups, 0.f);
  for (const auto i : c10::irange(M * K)) sums[i / K * groups + i % K / group] += x[i];
  at::parallel_for(0, (N + full - 1) / full, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const Int4Block block = int4_block(layout, N, b);
      for (int64_t m = 0; m < M; m += kRowsPerPass) {
        const float* xm = x + m * K;
        const float* sm = sums.data() + m * groups;
        float* om = out + m * N;
        switch (std::min(kRowsPerPass, M - m)) {
          case 1: int4_block_dispatch<1>(block, xm, K, sm, group, w, pairs, N, om, N); break;
          case 2: int4_block_dispatch<2>(block, xm, K, sm, group, w, pairs, N, om, N); break;
          case 3: int4_block_dispatch<3>(block, xm, K, sm, group, w, pairs, N, om, N); break;
          default: int4_block_dispatch<4>(block, xm, K, sm, group, w, pairs, N, om, N);
        }
      }
    }
  });
}

}  // namespace

namespace tetrad {

// x [M, K] times a quantized weight (int8 values [N, K] with scales [N], or torch's packed int4
// [N, K / 2] with scales_and_offsets [K / group, N, 2]) -> [M, N] in x's dtype.
at::Tensor quantized_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bool int8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || w.scalar_type() == at::kByte,
              "linear_rows: quantized weights are int8 [N, K] or packed int4 (uint8 [N, K / 2])");
  TORCH_CHECK(scales.scalar_type() == x.scalar_type() && scales.is_contiguous(),
              "linear_rows: contiguous scales in the activations' dtype");
  if (int8) {
    TORCH_CHECK(w.size(1) == K && scales.dim() == 1 && scales.size(0) == N,
                "linear_rows: int8 values [N, K] and scales [N]");
  } else {
    TORCH_CHECK(2 * w.size(1) == K && scales.dim() == 3 && scales.size(1) == N &&
                    scales.size(2) == 2 && K % scales.size(0) == 0,
                "linear_rows: int4 packed [N, K / 2] and scales_and_offsets [K / group, N, 2]");
  }
  const int64_t group = int8 ? 0 : K / scales.size(0);
  const Int4Layout layout = int8 ? Int4Layout::kUnknown : torch_int4_layout();
  if (M > kMaxStreamedRows || !w.is_contiguous() || (!int8 && layout == Int4Layout::kUnknown) ||
      x.scalar_type() == at::kDouble)
    return int8 ? at::_weight_int8pack_mm(x, w, scales)
                : at::_weight_int4pack_mm_for_cpu(x, w, group, scales);
  const auto xf = as_floats(x);
  auto acc = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* out = acc.data_ptr<float>();
  TETRAD_DISPATCH(x.scalar_type(), "quantized_rows", [&] {
    const scalar_t* s = scales.data_ptr<scalar_t>();
    if (int8) {
      stream_matmul(xf.data(), M, w.data_ptr<int8_t>(), N, K, out);
      for (const auto i : c10::irange(M * N)) out[i] *= to_float(s[i % N]);
    } else {
      int4_matmul(layout, xf.data(), M, w.data_ptr<uint8_t>(), s, N, K, group, out);
    }
  });
  return x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type());
}

}  // namespace tetrad
