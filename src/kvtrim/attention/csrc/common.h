// kvtrim: helpers shared by the native CPU kernels (sparse_attention.cpp, fused_scores.cpp).
//
// BLAS sgemm from libtorch_cpu, a vectorisable exp for non-positive arguments, the masked-score
// sentinels, and float32 views of float32/bfloat16/float16 row tiles. Everything here is inline
// in an anonymous namespace: each source file gets its own copy.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);
// MKL only (weak: absent with other BLAS): one BLAS thread inside each of our worker threads.
extern "C" int mkl_set_num_threads_local(int) __attribute__((weak));
// MKL only (weak): GEMM on bfloat16 / float16 operands with float32 accumulation and a float32
// result (the Fortran interface, LP64 like sgemm_; AVX-512 BF16 / AMX where the CPU has them).
extern "C" void gemm_bf16bf16f32_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                                  const float* alpha, const c10::BFloat16* a, const int* lda, const c10::BFloat16* b,
                                  const int* ldb, const float* beta, float* c, const int* ldc) __attribute__((weak));
extern "C" void gemm_f16f16f32_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                                const float* alpha, const c10::Half* a, const int* lda, const c10::Half* b,
                                const int* ldb, const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace {

constexpr float kMasked = -1e30f;
constexpr float kHidden = -1e29f;  // anything at or below this is a masked score

inline void gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                 int ldb, float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// exp(x) for x <= 0 (scores minus their running max), vectorisable: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-7 Taylor/minimax-style polynomial (relative error ~1e-7,
// Cephes' expf coefficients), 2^n by building the float's exponent bits. Below -87 it is 0.
inline float exp_neg(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  // Cody-Waite reduction with explicit FMAs: -ffast-math may not reassociate these two steps.
  float r = std::fma(-n, 0.693359375f, xc);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// max(init, x[0 .. n)) vectorised: GCC leaves a plain std::max loop scalar under
// -fno-finite-math-only (NaN ordering), and this reduction is a fifth of a float32 attention pass.
// Four vectors of running maxima (64 lanes), so consecutive max instructions do not wait on each
// other's latency.
inline float row_max(const float* x, int n, float init) {
  float acc[64];
  for (int u = 0; u < 64; ++u) acc[u] = init;
  int j = 0;
  for (; j + 64 <= n; j += 64) {
#pragma omp simd
    for (int u = 0; u < 64; ++u) acc[u] = x[j + u] > acc[u] ? x[j + u] : acc[u];
  }
  float mx = init;
#pragma omp simd reduction(max : mx)
  for (int u = 0; u < 64; ++u) mx = acc[u] > mx ? acc[u] : mx;
  for (; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

// Whether the environment variable `name` is exactly "0" (a kernel path switched off, for comparison).
inline bool switched_off(const char* name) {
  const char* e = std::getenv(name);
  return e && e[0] == '0' && e[1] == '\0';
}

// Whether bfloat16 / float16 operands go to the reduced-precision GEMM as they are (no float32
// copy): T is bfloat16 or float16, MKL provides the GEMM, and KVTRIM_NATIVE_LOWP_GEMM is not "0"
// (read once; "0" keeps the float32 conversion, for comparison).
template <typename T>
inline bool lowp_gemm() {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    static const bool enabled = !switched_off("KVTRIM_NATIVE_LOWP_GEMM");
    if constexpr (std::is_same_v<T, c10::BFloat16>) return enabled && gemm_bf16bf16f32_ != nullptr;
    else return enabled && gemm_f16f16f32_ != nullptr;
  }
}

// c = alpha * op(a) @ op(b) + beta * c (column-major, as gemm) on bfloat16 / float16 operands, float32
// accumulation and result; only called when lowp_gemm<T>().
template <typename T>
inline void gemm_lowp(char ta, char tb, int m, int n, int k, float alpha, const T* a, int lda, const T* b, int ldb,
                      float beta, float* c, int ldc) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    gemm_bf16bf16f32_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
  else if constexpr (std::is_same_v<T, c10::Half>)
    gemm_f16f16f32_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// n rows of a float32 [*, ld] matrix (the first w columns) rounded to T into dst[n, w].
template <typename T>
inline void rows_from_f32(const float* src, int64_t ld, int n, int w, T* dst) {
  for (int r = 0; r < n; ++r) {
    const float* a = src + r * ld;
    T* b = dst + static_cast<int64_t>(r) * w;
    for (int c = 0; c < w; ++c) b[c] = static_cast<T>(a[c]);
  }
}

// The row stride of a [heads, T, D] tensor as a BLAS leading dimension (int, as the Fortran
// interface takes); a single row's stride is irrelevant, so it is read as d.
inline int row_stride(const at::Tensor& x, int d, const char* name) {
  if (x.size(1) <= 1) return d;
  TORCH_CHECK(x.stride(1) >= d && x.stride(1) <= INT32_MAX, name, "'s row stride must be >= head_dim and fit int32");
  return static_cast<int>(x.stride(1));
}

// n rows of d elements (row stride ld) as float32 into dst[n, d] (contiguous).
template <typename T>
inline void rows_to_f32(const T* src, int64_t ld, int n, int d, float* dst) {
  for (int r = 0; r < n; ++r) {
    const T* a = src + r * ld;
    float* b = dst + static_cast<int64_t>(r) * d;
    for (int c = 0; c < d; ++c) b[c] = static_cast<float>(a[c]);
  }
}

// A row-major [n, d] operand with leading dimension ld, as float32: the rows themselves when T is
// float (no copy), else converted into buf (leading dimension d).
template <typename T>
inline std::pair<const float*, int> f32_tile(const T* src, int ld, int n, int d, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    (void)n;
    (void)buf;
    return {src, ld};
  } else {
    rows_to_f32(src, ld, n, d, buf);
    return {buf, d};
  }
}

}  // namespace
