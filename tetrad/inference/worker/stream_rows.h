// The weight-streaming matmul decode_step.cpp and quant_rows.cpp share: a few rows of fp32
// activations against weights read once, widened to fp32 in registers (AVX2), fp32 accumulation,
// output rows split over torch's threads. Weights: fp32, bf16, fp16 or int8 (whose scales the
// caller applies; int8 is multiplied in integers against int16-rounded activations).

#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TETRAD_AVX2 1
#endif

// The dtypes the model runs in (fp64 goes to torch).
#define TETRAD_DISPATCH(TYPE, NAME, ...)                            \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                    \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)      \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace tetrad::stream {

// Rows of the activations per pass over the weights: each weight row is loaded once for them.
constexpr int64_t kRowsPerPass = 4;
// Rows of activations a weight is streamed for (a decode step's batch); past them torch's kernels
// take the product. On a 2-core AVX2 EPYC (benchmarks/cpu_stream_bandwidth.py --rows 16 32 64,
// BENCHMARKS.md) torch's fp32 GEMM is as fast from 32 rows, while streaming beat its bf16 GEMM
// (no bf16 arithmetic on AVX2) 3.8-4.8x and its packed int8 / int4 kernels 1.3-2.5x at 16-64.
constexpr int64_t kMaxStreamedRows = 64;
constexpr int64_t kMaxStreamedRowsFp32 = 16;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }

#ifdef TETRAD_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the high half of an fp32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// out[m][n] = sum_k x[m][k] * w[n][k] for output rows [n0, n1), M rows of x (fp32, [M, K]),
// NR weight rows at a time so that NR * M accumulators are in flight.
template <int M, int NR, typename W>
void dot_rows(const float* x, const W* w, int64_t K, int64_t n0, int64_t n1, float* out,
              int64_t out_stride) {
  int64_t n = n0;
#ifdef TETRAD_AVX2
  const int64_t K8 = K - K % 8;
  for (; n + NR <= n1; n += NR) {
    __m256 acc[NR][M];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
      __m256 xs[M];
      for (int m = 0; m < M; ++m) xs[m] = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < NR; ++r) {
        const __m256 wv = load8(w + (n + r) * K + k);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xs[m], acc[r][m]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) {
        float sum = hsum(acc[r][m]);
        for (int64_t k = K8; k < K; ++k) sum += x[m * K + k] * to_float(w[(n + r) * K + k]);
        out[m * out_stride + n + r] = sum;
      }
  }
#endif
  for (; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += x[m * K + k] * to_float(w[n * K + k]);
      out[m * out_stride + n] = sum;
    }
}

#ifdef TETRAD_AVX2
// One row of x: weight rows one after another, 4 accumulators along each. A weight row of a
// 512-wide layer is 2 KB (fp32) or 1 KB (bf16): reading rows side by side, as dot_rows does for
// more rows of x, makes that many short streams, which the hardware prefetcher follows badly.
// benchmarks/cpu_stream_bandwidth.py, one thread, 512-wide fp32 weights: 4 rows side by side
// read at 0.71-0.74x a plain sum over the same bytes, one row at a time at 0.87-0.98x.
template <typename W>
void dot_single(const float* x, const W* w, int64_t K, int64_t n0, int64_t n1, float* out) {
  const int64_t K32 = K - K % 32, K8 = K - K % 8;
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    __m256 acc[4];
    for (auto& a : acc) a = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < K32; k += 32)
      for (int u = 0; u < 4; ++u)
        acc[u] = _mm256_fmadd_ps(load8(row + k + 8 * u), _mm256_loadu_ps(x + k + 8 * u), acc[u]);
    for (; k < K8; k += 8) acc[0] = _mm256_fmadd_ps(load8(row + k), _mm256_loadu_ps(x + k), acc[0]);
    float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; k < K; ++k) sum += x[k] * to_float(row[k]);
    out[n] = sum;
  }
}

#endif

// int8 weights against activations rounded to int16 with one scale per row (a step of 1/32767
// of the row's largest |x|, where the bf16 activations already carry steps of 1/256 of each
// value): 16 weights are one widening load and one _mm256_madd_epi16 into exact int32 sums,
// where fp32 takes two widenings, two conversions and two FMAs (llama.cpp's Q8_0 dot does the
// same with int8 activations).
struct Int16Rows {
  std::vector<int16_t> values;  // [M, K16]
  std::vector<float> scales;    // [M]
};

inline Int16Rows int16_rows(const float* x, int64_t M, int64_t K) {
  const int64_t K16 = K - K % 16;
  Int16Rows rows{std::vector<int16_t>(M * K16), std::vector<float>(M)};
  for (int64_t m = 0; m < M; ++m) {
    float largest = 0.f;
    for (int64_t k = 0; k < K16; ++k) largest = std::max(largest, std::abs(x[m * K + k]));
    const float scale = largest > 0.f ? largest / 32767.f : 1.f;
    rows.scales[m] = scale;
    for (int64_t k = 0; k < K16; ++k)
      rows.values[m * K16 + k] = static_cast<int16_t>(std::nearbyint(x[m * K + k] / scale));
  }
  return rows;
}

#ifdef TETRAD_AVX2
// Columns per exact int32 run: a lane gains at most 2 * 128 * 32767 per 16 columns.
constexpr int64_t kInt32Columns = 4096;

template <int M, int NR>
void dot_rows_int8(const float* x, const int16_t* xq, const float* x_scales, const int8_t* w,
                   int64_t K, int64_t n0, int64_t n1, float* out, int64_t out_stride) {
  const int64_t K16 = K - K % 16;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m256 total[NR][M];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) total[r][m] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K16; k0 += kInt32Columns) {
      __m256i acc[NR][M];
      for (int r = 0; r < NR; ++r)
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_si256();
      for (int64_t k = k0; k < std::min(K16, k0 + kInt32Columns); k += 16) {
        __m256i xs[M];
        for (int m = 0; m < M; ++m)
          xs[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K16 + k));
        for (int r = 0; r < NR; ++r) {
          const __m256i wv = _mm256_cvtepi8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + r) * K + k)));
          for (int m = 0; m < M; ++m)
            acc[r][m] = _mm256_add_epi32(acc[r][m], _mm256_madd_epi16(wv, xs[m]));
        }
      }
      for (int r = 0; r < NR; ++r)
        for (int m = 0; m < M; ++m)
          total[r][m] = _mm256_add_ps(total[r][m], _mm256_cvtepi32_ps(acc[r][m]));
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) {
        float sum = hsum(total[r][m]) * x_scales[m];
        for (int64_t k = K16; k < K; ++k) sum += x[m * K + k] * to_float(w[(n + r) * K + k]);
        out[m * out_stride + n + r] = sum;
      }
  }
  for (; n < n1; ++n) dot_rows_int8<M, 1>(x, xq, x_scales, w, K, n, n + 1, out, out_stride);
}
#endif

template <typename W>
void dot_chunk(int64_t rows, const float* x, const W* w, int64_t K, int64_t n0, int64_t n1,
               float* out, int64_t out_stride) {
  switch (rows) {
    case 1:
#ifdef TETRAD_AVX2
      return dot_single(x, w, K, n0, n1, out);
#else
      return dot_rows<1, 4>(x, w, K, n0, n1, out, out_stride);
#endif
    case 2: return dot_rows<2, 4>(x, w, K, n0, n1, out, out_stride);
    case 3: return dot_rows<3, 2>(x, w, K, n0, n1, out, out_stride);
    default: return dot_rows<4, 2>(x, w, K, n0, n1, out, out_stride);
  }
}

// Output rows per tile when more than kRowsPerPass rows of x take several passes: a tile's
// weights (at most 64 rows of K, 128 KB in fp32 at K = 512) stay in the core's cache from one pass
// to the next, where passes over a thread's whole share would read it from memory again each.
inline int64_t tile_rows(int64_t M, int64_t n0, int64_t n1) {
  return M <= kRowsPerPass ? n1 - n0 : 64;
}

// x [M, K] (fp32) times w [N, K]^T -> out [M, N] fp32, the weights streamed once per
// kRowsPerPass rows of x (tile by tile, tile_rows), output rows split over torch's threads.
template <typename W>
void stream_matmul(const float* x, int64_t M, const W* w, int64_t N, int64_t K, float* out) {
#ifdef TETRAD_AVX2
  if constexpr (std::is_same_v<W, int8_t>) {
    const Int16Rows xq = int16_rows(x, M, K);
    const int64_t K16 = K - K % 16;
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t t0 = n0, step = tile_rows(M, n0, n1); t0 < n1; t0 += step) {
        const int64_t t1 = std::min(n1, t0 + step);
        for (int64_t m = 0; m < M; m += kRowsPerPass) {
          const float* xm = x + m * K;
          const int16_t* qm = xq.values.data() + m * K16;
          const float* sm = xq.scales.data() + m;
          float* o = out + m * N;
          switch (std::min(kRowsPerPass, M - m)) {
            case 1: dot_rows_int8<1, 1>(xm, qm, sm, w, K, t0, t1, o, N); break;
            case 2: dot_rows_int8<2, 2>(xm, qm, sm, w, K, t0, t1, o, N); break;
            case 3: dot_rows_int8<3, 2>(xm, qm, sm, w, K, t0, t1, o, N); break;
            default: dot_rows_int8<4, 2>(xm, qm, sm, w, K, t0, t1, o, N);
          }
        }
      }
    });
    return;
  }
#endif
  // A grain of whole cache lines of output keeps threads off each other's lines.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0, step = tile_rows(M, n0, n1); t0 < n1; t0 += step) {
      const int64_t t1 = std::min(n1, t0 + step);
      for (int64_t m = 0; m < M; m += kRowsPerPass)
        dot_chunk(std::min(kRowsPerPass, M - m), x + m * K, w, K, t0, t1, out + m * N, N);
    }
  });
}

inline std::vector<float> as_floats(const at::Tensor& x) {
  const auto flat = x.contiguous();
  std::vector<float> values(flat.numel());
  TETRAD_DISPATCH(flat.scalar_type(), "as_floats", [&] {
    const scalar_t* src = flat.data_ptr<scalar_t>();
    for (const auto i : c10::irange(values.size())) values[i] = to_float(src[i]);
  });
  return values;
}

}  // namespace tetrad::stream
