// The quantized weights of tetrad.models.quant streamed for a few rows of activations, read in
// the very tensors the layers hold (no second copy, so the bytes the planner counts are all
// there is), dequantized in registers, fp32 accumulation, rounded once to the activations'
// dtype: the arithmetic of torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu, which
// the eager forward calls, up to fp32 rounding. Past kMaxStreamedRows rows (a decode batch of
// 64) those kernels run.
//
// int8: values [N, K] int8, one scale per output row: y = (x . values[n]) * scale[n].
// int4: torch's CPU packing of values 0..15 (uint8 [N, K / 2]) and per group of input columns
// scales_and_offsets [K / group, N, 2]: w = (q - 8) * scale + offset. Per group the kernel
// sums x * q and takes y += scale * (sum(x * q) - 8 sum(x)) + offset * sum(x), so only the
// group's end touches the scales. With AVX2 a full block of torch's split packing is summed in
// integers against int16-rounded activations (int4_split_rows_int16).

#include <ATen/core/Tensor.h>
#include <ATen/ops/_convert_weight_to_int4pack_for_cpu.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/empty.h>

#include <cstring>
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

#ifdef TETRAD_AVX2
// The scales and offsets of rows r..r+3 and r+8..r+11 (`p` at row r's pair), in the lane order
// of int4_split_rows_int16's sums. A bf16 pair is one 32-bit word: scale low, offset high.
inline void scales_and_offsets8(const c10::BFloat16* p, __m256& scale, __m256& offset) {
  const __m256i words = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + 16),
                                            reinterpret_cast<const __m128i*>(p));
  scale = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
  offset = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF0000)));
}
template <typename T>
void scales_and_offsets8(const T* p, __m256& scale, __m256& offset) {
  alignas(32) float s[8], o[8];
  for (int l = 0; l < 8; ++l) {
    const int row = l < 4 ? l : l + 4;
    s[l] = to_float(p[2 * row]);
    o[l] = to_float(p[2 * row + 1]);
  }
  scale = _mm256_load_ps(s);
  offset = _mm256_load_ps(o);
}

// A full split block against int16-rounded activations (Int16Rows), in integers: two input
// columns at a time, each byte spread to a 16-bit lane next to the same row's byte of the next
// column (vpermq + vpshufb), its nibbles masked and shifted in place, and one
// _mm256_madd_epi16 per 8 rows sums q * x over both columns into exact int32 (a group of 4096
// columns at most: 15 * 32767 * 4096 < 2^31). The float kernel above spends two conversions and
// two FMAs per 16 weights. Lane l of sum vector v of 16-byte chunk h holds row
// 16h + (l < 4 ? l : l + 4) + (v / 2) * 4 + (v % 2) * R / 2 (odd v: the high nibbles); the
// group's scales are applied in that order, the rows put in order once at the end.
// `sums` [M, groups]: sum(x) per group, from the rounded activations.
template <int M, int C, typename T>
void int4_split_rows_int16(const int16_t* xq, const float* x_scales, int64_t K,
                           const float* sums, int64_t group, const uint8_t* w, const T* pairs,
                           int64_t N, float* out, int64_t out_stride) {
  constexpr int R = 16 * C, B = R / 2, H = B / 16;  // rows, bytes per input column, chunks
  const int64_t groups = K / group;
  // Within each 128-bit lane after vpermq: bytes 0-7 of column k, then bytes 0-7 of column k+1.
  const __m256i first = _mm256_setr_epi8(0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11, -1,
                                         0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11, -1);
  const __m256i second = _mm256_setr_epi8(4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1, 15,
                                          -1, 4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1,
                                          15, -1);
  const __m256i low_nibble = _mm256_set1_epi16(15);
  __m256 total[M][H][4];
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < H; ++h)
      for (auto& t : total[m][h]) t = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[M][H][4];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h)
        for (auto& a : acc[m][h]) a = _mm256_setzero_si256();
    for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
      __m256i xs[M];
      for (int m = 0; m < M; ++m) {
        int32_t both;
        std::memcpy(&both, xq + m * K + k, sizeof both);
        xs[m] = _mm256_set1_epi32(both);
      }
      const uint8_t* column = w + k * B;
      for (int h = 0; h < H; ++h) {
        const __m256i bytes = _mm256_permute4x64_epi64(
            _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(column + B + 16 * h),
                                reinterpret_cast<const __m128i*>(column + 16 * h)),
            0xD8);
        const __m256i a = _mm256_shuffle_epi8(bytes, first), b = _mm256_shuffle_epi8(bytes, second);
        const __m256i q[4] = {_mm256_and_si256(a, low_nibble), _mm256_srli_epi16(a, 4),
                              _mm256_and_si256(b, low_nibble), _mm256_srli_epi16(b, 4)};
        for (int m = 0; m < M; ++m)
          for (int v = 0; v < 4; ++v)
            acc[m][h][v] = _mm256_add_epi32(acc[m][h][v], _mm256_madd_epi16(q[v], xs[m]));
      }
    }
    const T* scale_offset = pairs + g * N * 2;
    for (int h = 0; h < H; ++h)
      for (int v = 0; v < 4; ++v) {
        __m256 scale, offset;
        scales_and_offsets8(scale_offset + 2 * (16 * h + (v / 2) * 4 + (v % 2) * R / 2), scale,
                            offset);
        for (int m = 0; m < M; ++m) {  // scale * (x.q - 8 sum(x)) + offset * sum(x)
          const __m256 sum = _mm256_set1_ps(sums[m * groups + g]);
          const __m256 dot = _mm256_fmsub_ps(_mm256_cvtepi32_ps(acc[m][h][v]),
                                             _mm256_set1_ps(x_scales[m]),
                                             _mm256_mul_ps(_mm256_set1_ps(8.f), sum));
          total[m][h][v] = _mm256_fmadd_ps(scale, dot, _mm256_fmadd_ps(offset, sum,
                                                                       total[m][h][v]));
        }
      }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < H; ++h)
      for (int v = 0; v < 4; ++v) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, total[m][h][v]);
        float* rows = out + m * out_stride + 16 * h + (v / 2) * 4 + (v % 2) * R / 2;
        for (int l = 0; l < 8; ++l) rows[l < 4 ? l : l + 4] = lanes[l];
      }
}
#endif

// Columns per exact int32 run of the integer int4 kernel: 15 * 32767 per column.
constexpr int64_t kInt4Int32Columns = 4096;

// The activations as int16 for the integer kernel, or empty where the float kernel runs.
struct Int4Rows {
  const float* x;
  const int16_t* xq;  // [M, K] or null
  const float* x_scales;
};

template <int M, typename T>
void int4_block_dispatch(const Int4Block& block, const Int4Rows& rows, int64_t K,
                         const float* sums, int64_t group, const uint8_t* w, const T* pairs,
                         int64_t N, float* out, int64_t out_stride) {
  const uint8_t* bytes = w + block.start * K / 2;
  const T* first = pairs + block.start * 2;
  float* o = out + block.start;
  const float* x = rows.x;
#ifdef TETRAD_AVX2
  if (block.split && rows.xq != nullptr) {
    if (block.rows == 64)
      return int4_split_rows_int16<M, 4>(rows.xq, rows.x_scales, K, sums, group, bytes, first,
                                         N, o, out_stride);
    return int4_split_rows_int16<M, 2>(rows.xq, rows.x_scales, K, sums, group, bytes, first, N,
                                       o, out_stride);
  }
#endif
  if (block.split && block.rows == 64)
    return int4_block_rows<M, 4, true>(x, K, sums, group, bytes, first, N, o, out_stride);
  if (block.split)
    return int4_block_rows<M, 2, true>(x, K, sums, group, bytes, first, N, o, out_stride);
  switch (block.rows) {  // torch's int4 rows come in multiples of 16
    case 16: return int4_block_rows<M, 1, false>(x, K, sums, group, bytes, first, N, o, out_stride);
    case 32: return int4_block_rows<M, 2, false>(x, K, sums, group, bytes, first, N, o, out_stride);
    default: return int4_block_rows<M, 3, false>(x, K, sums, group, bytes, first, N, o, out_stride);
  }
}

// x fp32 [M, K] -> out fp32 [M, N], the packed weight's blocks split over torch's threads.
template <typename T>
void int4_matmul(Int4Layout layout, const float* x, int64_t M, const uint8_t* w, const T* pairs,
                 int64_t N, int64_t K, int64_t group, float* out) {
  const int64_t groups = K / group, full = layout == Int4Layout::kSplit64 ? 64 : 32;
  Int16Rows xq;
#ifdef TETRAD_AVX2
  if (layout != Int4Layout::kPairs && group % 16 == 0 && group <= kInt4Int32Columns)
    xq = int16_rows(x, M, K);
#endif
  std::vector<float> sums(M * groups);  // of the values the kernel multiplies by
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      if (xq.values.empty()) {
        for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += x[m * K + k];
      } else {
        int32_t rounded = 0;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) rounded += xq.values[m * K + k];
        sum = xq.scales[m] * static_cast<float>(rounded);
      }
      sums[m * groups + g] = sum;
    }
  at::parallel_for(0, (N + full - 1) / full, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const Int4Block block = int4_block(layout, N, b);
      for (int64_t m = 0; m < M; m += kRowsPerPass) {
        const bool integer = !xq.values.empty();
        const Int4Rows rows{x + m * K, integer ? xq.values.data() + m * K : nullptr,
                            integer ? xq.scales.data() + m : nullptr};
        const float* sm = sums.data() + m * groups;
        float* om = out + m * N;
        switch (std::min(kRowsPerPass, M - m)) {
          case 1: int4_block_dispatch<1>(block, rows, K, sm, group, w, pairs, N, om, N); break;
          case 2: int4_block_dispatch<2>(block, rows, K, sm, group, w, pairs, N, om, N); break;
          case 3: int4_block_dispatch<3>(block, rows, K, sm, group, w, pairs, N, om, N); break;
          default: int4_block_dispatch<4>(block, rows, K, sm, group, w, pairs, N, om, N);
        }
      }
    }
  });
}

}  // namespace

namespace tetrad {

// A quantized weight as quantized_rows takes it: int8 values [N, K] with scales [N], or torch's
// packed int4 [N, K / 2] with scales_and_offsets [K / group, N, 2], for K input columns.
void check_quantized(int64_t K, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kChar || w.scalar_type() == at::kByte),
              "linear_rows: quantized weights are int8 [N, K] or packed int4 (uint8 [N, K / 2])");
  TORCH_CHECK(scales.is_contiguous(), "linear_rows: contiguous scales");
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(w.size(1) == K && scales.dim() == 1 && scales.size(0) == N,
                "linear_rows: int8 values [N, K] and scales [N]");
  } else {
    TORCH_CHECK(2 * w.size(1) == K && scales.dim() == 3 && scales.size(1) == N &&
                    scales.size(2) == 2 && K % scales.size(0) == 0,
                "linear_rows: int4 packed [N, K / 2] and scales_and_offsets [K / group, N, 2]");
  }
}

// x (fp32 [M, K]) times a checked quantized weight into out (fp32 [M, N]), scales applied: the
// streamed product. False, with nothing written, where torch's packed kernels take it instead
// (more rows than streaming pays for, a strided weight, an int4 packing this file cannot read).
bool quantized_rows_into(const float* x, int64_t M, int64_t K, const at::Tensor& w,
                         const at::Tensor& scales, float* out) {
  const int64_t N = w.size(0);
  const bool int8 = w.scalar_type() == at::kChar;
  const Int4Layout layout = int8 ? Int4Layout::kUnknown : torch_int4_layout();
  if (M > kMaxStreamedRows || !w.is_contiguous() || (!int8 && layout == Int4Layout::kUnknown))
    return false;
  TETRAD_DISPATCH(scales.scalar_type(), "quantized_rows", [&] {
    const scalar_t* s = scales.data_ptr<scalar_t>();
    if (int8) {
      stream_matmul(x, M, w.data_ptr<int8_t>(), N, K, out);
      for (int64_t m = 0; m < M; ++m)  // no division per output: this loop runs on one thread
        for (int64_t n = 0; n < N; ++n) out[m * N + n] *= to_float(s[n]);
    } else {
      int4_matmul(layout, x, M, w.data_ptr<uint8_t>(), s, N, K, K / scales.size(0), out);
    }
  });
  return true;
}

// x [M, K] times a quantized weight (check_quantized) -> [M, N] in x's dtype.
at::Tensor quantized_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_quantized(K, w, scales);
  TORCH_CHECK(scales.scalar_type() == x.scalar_type(),
              "linear_rows: scales in the activations' dtype");
  if (x.scalar_type() != at::kDouble) {
    const auto xf = as_floats(x);
    auto acc = at::empty({M, N}, x.options().dtype(at::kFloat));
    if (quantized_rows_into(xf.data(), M, K, w, scales, acc.data_ptr<float>()))
      return x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type());
  }
  return w.scalar_type() == at::kChar
             ? at::_weight_int8pack_mm(x, w, scales)
             : at::_weight_int4pack_mm_for_cpu(x, w, K / scales.size(0), scales);
}

}  // namespace tetrad
