// kvtrim: dense causal attention that also returns the scores a KV-cache method needs.
//
// One pass over each query block computes the block's softmax probabilities once and uses them
// three ways: the attention output (P @ V), the per-key column sums of P (H2O's and Elastic
// Cache's prefill scores) and, for the last `window` queries, the probability rows themselves
// (SnapKV's and Inf-MLLM's observation window). A method then needs no second q @ K^T.
//
// Queries are the last Tq of S keys: query row r sees keys 0 .. S - Tq + r (bottom-right causal).
// Unlike the sparse kernel's online softmax, a query block's scores against every key it can see
// are materialised in one thread-local buffer [kRows, S] (1 MiB at S = 4096), because the column
// sums need the final normaliser of each row: the softmax is exact in one step (max, exp, sum),
// so there is no running rescale either. The output row is (exp(s - max) @ V) / sum, the
// normaliser applied once to the D outputs instead of to the S probabilities.
//
// One task = one query head, its query blocks in order, so each head's column sums are
// accumulated by one thread in a fixed order (deterministic for any thread count). All
// arithmetic is float32; bfloat16/float16 inputs are converted per tile (q) or per KV head (k, v)
// into thread-local float32 buffers, the output is rounded once to the input dtype, and the scores
// are always float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int kRows = 64;  // query rows per block

template <typename T>
void causal_scores_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& head_kv,
                        double scale, at::Tensor& out, float* colp, float* winp, int window) {
  const int hq = q.size(0), tq = q.size(1), d = q.size(2), s_len = k.size(1);
  const int off = s_len - tq;
  const int ldq = row_stride(q, d, "q"), ldk = row_stride(k, d, "k"), ldv = row_stride(v, d, "v"),
            ldo = row_stride(out, d, "out");
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0), so = out.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* hkvp = head_kv.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const int w0 = tq - window;  // first query row whose probabilities are returned
  std::atomic<int> next{0};

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> s(static_cast<size_t>(kRows) * s_len), o(static_cast<size_t>(kRows) * d), inv(kRows);
    std::vector<float> qc(std::is_same_v<T, float> ? 0 : static_cast<size_t>(kRows) * d);
    std::vector<float> kc(std::is_same_v<T, float> ? 0 : static_cast<size_t>(s_len) * d);
    std::vector<float> vc(std::is_same_v<T, float> ? 0 : static_cast<size_t>(s_len) * d);
    int held = -1;  // the KV head kc/vc hold (query heads of one group come one after another)
    for (int h = next.fetch_add(1); h < hq; h = next.fetch_add(1)) {
      const int kvh = hkvp[h];
      const float* kt;
      const float* vt;
      int ldkt, ldvt;
      if constexpr (std::is_same_v<T, float>) {
        kt = kp + static_cast<int64_t>(kvh) * sk;
        vt = vp + static_cast<int64_t>(kvh) * sv;
        ldkt = ldk;
        ldvt = ldv;
      } else {
        if (held != kvh) {
          rows_to_f32(kp + static_cast<int64_t>(kvh) * sk, ldk, s_len, d, kc.data());
          rows_to_f32(vp + static_cast<int64_t>(kvh) * sv, ldv, s_len, d, vc.data());
          held = kvh;
        }
        kt = kc.data();
        vt = vc.data();
        ldkt = ldvt = d;
      }
      float* col = colp ? colp + static_cast<int64_t>(h) * s_len : nullptr;
      for (int r0 = 0; r0 < tq; r0 += kRows) {
        const int nr = std::min(kRows, tq - r0);
        const int n = off + r0 + nr;  // keys the block's last row sees; ld of s
        const auto [qt, ldqt] = f32_tile(qp + static_cast<int64_t>(h) * sq + static_cast<int64_t>(r0) * ldq, ldq, nr, d,
                                         qc.data());
        float* sb = s.data();
        // s[nr, n] = scale * q[nr, d] @ k[0:n]^T (scaled by BLAS alpha, as dense attention does)
        gemm('T', 'N', n, nr, d, fscale, kt, ldkt, qt, ldqt, 0.0f, sb, n);
        for (int i = 0; i < nr; ++i) {
          float* row = sb + static_cast<int64_t>(i) * n;
          const int vis = off + r0 + i + 1;  // keys 0 .. vis-1 are visible
          float mx = kMasked;
          for (int j = 0; j < vis; ++j) mx = std::max(mx, row[j]);
          float sum = 0.0f;
          for (int j = 0; j < vis; ++j) {
            const float p = exp_neg(row[j] - mx);
            row[j] = p;
            sum += p;
          }
          std::fill(row + vis, row + n, 0.0f);
          const float iv = 1.0f / sum;
          inv[i] = iv;
          if (col)
            for (int j = 0; j < vis; ++j) col[j] += row[j] * iv;
          const int r = r0 + i;
          if (winp && r >= w0) {
            float* dst = winp + (static_cast<int64_t>(h) * window + (r - w0)) * s_len;
            for (int j = 0; j < vis; ++j) dst[j] = row[j] * iv;
          }
        }
        // out rows = (p[nr, n] @ v[0:n]) / sum, written straight into a float32 output
        if constexpr (std::is_same_v<T, float>) {
          float* oh = op + static_cast<int64_t>(h) * so + static_cast<int64_t>(r0) * ldo;
          gemm('N', 'N', d, nr, n, 1.0f, vt, ldvt, sb, n, 0.0f, oh, ldo);
          for (int i = 0; i < nr; ++i)
            for (int c = 0; c < d; ++c) oh[static_cast<int64_t>(i) * ldo + c] *= inv[i];
        } else {
          gemm('N', 'N', d, nr, n, 1.0f, vt, ldvt, sb, n, 0.0f, o.data(), d);
          T* oh = op + static_cast<int64_t>(h) * so + static_cast<int64_t>(r0) * ldo;
          for (int i = 0; i < nr; ++i)
            for (int c = 0; c < d; ++c)
              oh[static_cast<int64_t>(i) * ldo + c] = static_cast<T>(o[static_cast<int64_t>(i) * d + c] * inv[i]);
        }
      }
    }
  });
}

}  // namespace

// q [Hq, Tq, D], k/v [Hkv, S, D] (S >= Tq >= 1), out [Hq, Tq, D]: one dtype (float32, bfloat16 or
// float16), any strides with a contiguous last dimension. head_kv [Hq] int32: the KV head each
// query head reads. Writes the causal attention output into out and returns
// (col_sums [Hq, S] if col_sums else [0], window_probs [Hq, window, S] if window > 0 else [0]),
// float32; window_probs row i is query Tq - window + i (zeros beyond the keys it sees).
std::tuple<at::Tensor, at::Tensor> causal_attention_scores_out(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& head_kv,
                                                               double scale, bool col_sums, int64_t window,
                                                               at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "q, k, v, out must be [heads, T, D]");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "q must be float32, bfloat16 or float16");
  for (const at::Tensor* x : {&q, &k, &v, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(x->scalar_type() == dt && x->stride(2) == 1, "q, k, v, out must have one dtype and a contiguous last dimension");
  const int64_t hq = q.size(0), tq = q.size(1), d = q.size(2), hkv = k.size(0), s_len = k.size(1);
  TORCH_CHECK(tq >= 1 && s_len >= tq && s_len <= INT32_MAX, "need 1 <= Tq <= S");
  TORCH_CHECK(k.size(2) == d && v.size(0) == hkv && v.size(1) == s_len && v.size(2) == d, "k/v shape");
  TORCH_CHECK(out.size(0) == hq && out.size(1) == tq && out.size(2) == d, "out must be shaped like q");
  TORCH_CHECK(head_kv.scalar_type() == at::kInt && head_kv.is_contiguous() && head_kv.numel() == hq,
              "head_kv must be contiguous int32 [Hq]");
  TORCH_CHECK(window >= 0 && window <= tq, "window must be in [0, Tq]");
  const int32_t* hkvp = head_kv.data_ptr<int32_t>();
  for (int64_t h = 0; h < hq; ++h) TORCH_CHECK(hkvp[h] >= 0 && hkvp[h] < hkv, "head_kv out of range");
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor col = col_sums ? at::zeros({hq, s_len}, f32) : at::empty({0}, f32);
  at::Tensor win = window > 0 ? at::zeros({hq, window, s_len}, f32) : at::empty({0}, f32);
  float* colp = col_sums ? col.data_ptr<float>() : nullptr;
  float* winp = window > 0 ? win.data_ptr<float>() : nullptr;
  const int w = static_cast<int>(window);
  if (dt == at::kFloat)
    causal_scores_impl<float>(q, k, v, head_kv, scale, out, colp, winp, w);
  else if (dt == at::kBFloat16)
    causal_scores_impl<c10::BFloat16>(q, k, v, head_kv, scale, out, colp, winp, w);
  else
    causal_scores_impl<c10::Half>(q, k, v, head_kv, scale, out, colp, winp, w);
  return {col, win};
}

TORCH_LIBRARY_FRAGMENT(kvtrim_native, m) {
  m.def("causal_attention_scores_out(Tensor q, Tensor k, Tensor v, Tensor head_kv, float scale, bool col_sums, "
        "int window, Tensor(a!) out) -> (Tensor, Tensor)");
  m.impl("causal_attention_scores_out", c10::DispatchKey::CPU, &causal_attention_scores_out);
}
