// kvtrim: element-wise layers of a transformer block in one pass each (CPU).
//
// rms_norm(x, weight, eps): the RMS normalisation of Llama-family models as transformers computes
// it, in one read of x and one write of y instead of six passes over float32 copies:
//     h = float(x);  h = h / sqrt(mean(h * h) + eps);  y = weight * T(h)
// with the normalised row rounded to x's dtype T before the product with the weight, and the
// product rounded again, as transformers' two steps do. The mean is a float32 sum in another
// order than PyTorch's, so a value can differ from transformers' in its last bits of float32, and
// then (rarely) by one unit in the last place of T after rounding.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

namespace {

// float <-> T by bits for bfloat16 (round to nearest even; NaN as PyTorch writes it), so that the
// loops below vectorise; c10's conversions do the same arithmetic one element at a time.
template <typename T>
inline float load_f32(T v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return static_cast<float>(v);
  }
}

template <typename T>
inline T store_as(float f) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return c10::BFloat16(static_cast<uint16_t>(f != f ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
  } else {
    return static_cast<T>(f);
  }
}

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* a = x + r * h;
      T* b = y + r * h;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < h; ++c) {
        const float v = load_f32(a[c]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
      for (int64_t c = 0; c < h; ++c) {
        const float normed = load_f32(store_as<T>(load_f32(a[c]) * inv));
        b[c] = store_as<T>(load_f32(w[c]) * normed);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0),
              "rms_norm: weight must be 1-D with x's last dimension");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must have one dtype");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t h = x.size(-1);
  const int64_t rows = h ? xc.numel() / h : 0;
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      rms_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), rows, h, e);
      break;
    case at::kBFloat16:
      rms_rows(xc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, h, e);
      break;
    case at::kHalf:
      rms_rows(xc.data_ptr<c10::Half>(), wc.data_ptr<c10::Half>(), y.data_ptr<c10::Half>(), rows, h, e);
      break;
    default:
      TORCH_CHECK(false, "rms_norm takes float32, bfloat16 or float16, not ", x.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtrim_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
}
