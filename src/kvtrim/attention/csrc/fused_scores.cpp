// kvtrim: dense causal attention that also returns the scores a KV-cache method needs.
//
// One pass over each query block computes the block's softmax probabilities once and uses them
// several ways: the attention output (P @ V), the per-key column sums of P (H2O's and Elastic
// Cache's prefill scores), the per-key column maxima of P (the largest probability any query gives
// a key: kvzip's reconstruction scores) and, for the last `window` queries, the probability rows
// themselves (SnapKV's and Inf-MLLM's observation window). A method then needs no second q @ K^T.
//
// Queries are the last Tq of S keys: query row r sees keys 0 .. S - Tq + r (bottom-right causal).
// A task walks its query block's keys in segments of kSeg, as a flash-attention kernel does: a
// segment's scores are exponentiated against the running row maximum while they are in cache and
// multiplied into the output (P @ V, rescaled when the maximum grows). Unlike the sparse kernel,
// the exponentials stay in a thread-local buffer [kRows, S] (2 MiB at S = 4096) together with the
// maximum each segment used, because the column sums need each row's final normaliser: after the
// last segment, probability = exp(s - m_seg) * exp(m_seg - m) / sum, summed into the column sums,
// raised into the column maxima (and copied for the window rows) in one more pass over the buffer.
//
// One task = one query head, its query blocks in order, so each head's column sums and maxima are
// accumulated by one thread in a fixed order (deterministic for any thread count). Scores,
// softmax, column sums and the output accumulate in float32, and the scores returned are always
// float32. bfloat16/float16 products go to MKL's reduced-precision GEMM where libtorch provides it
// (q, k, v read as they are; a segment's exponentials rounded to the input dtype for P @ V only,
// the column sums taken from the float32 ones), else the inputs are converted per tile (q) or per
// KV head (k, v) into thread-local float32 buffers for sgemm (also with KVTRIM_NATIVE_LOWP_GEMM=0).
// The output is rounded once to the input dtype.

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

constexpr int kRows = 128;  // query rows per block
constexpr int kSeg = 512;   // keys per segment

template <typename T>
void causal_scores_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& head_kv,
                        double scale, at::Tensor& out, float* colp, float* cmaxp, float* winp, int window) {
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
  const bool lowp = lowp_gemm<T>();
  const bool convert = !std::is_same_v<T, float> && !lowp;  // bfloat16/float16 through float32 copies
  std::atomic<int> next{0};

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int nseg_max = (s_len + kSeg - 1) / kSeg;
    std::vector<float> s(static_cast<size_t>(kRows) * s_len), o(static_cast<size_t>(kRows) * d), m(kRows), l(kRows);
    std::vector<float> seg_m(static_cast<size_t>(kRows) * nseg_max);
    std::vector<float> qc(convert ? static_cast<size_t>(kRows) * d : 0);
    std::vector<float> kc(convert ? static_cast<size_t>(s_len) * d : 0);
    std::vector<float> vc(convert ? static_cast<size_t>(s_len) * d : 0);
    std::vector<T> pl(lowp ? static_cast<size_t>(kRows) * kSeg : 0);  // a segment's exponentials, rounded for P @ V
    int held = -1;  // the KV head kc/vc hold (query heads of one group come one after another)
    for (int h = next.fetch_add(1); h < hq; h = next.fetch_add(1)) {
      const int kvh = hkvp[h];
      const float* kt = nullptr;
      const float* vt = nullptr;
      int ldkt = 0, ldvt = 0;
      const T* kl = kp + static_cast<int64_t>(kvh) * sk;  // the reduced-precision GEMM reads k and v as they are
      const T* vl = vp + static_cast<int64_t>(kvh) * sv;
      if constexpr (std::is_same_v<T, float>) {
        kt = kl;
        vt = vl;
        ldkt = ldk;
        ldvt = ldv;
      } else if (convert) {
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
      float* cmax = cmaxp ? cmaxp + static_cast<int64_t>(h) * s_len : nullptr;
      for (int r0 = 0; r0 < tq; r0 += kRows) {
        const int nr = std::min(kRows, tq - r0);
        const int n = off + r0 + nr;  // keys the block's last row sees; ld of s
        const T* qrows = qp + static_cast<int64_t>(h) * sq + static_cast<int64_t>(r0) * ldq;
        const std::pair<const float*, int> qtile =
            lowp ? std::pair<const float*, int>{nullptr, 0} : f32_tile(qrows, ldq, nr, d, qc.data());
        const float* qt = qtile.first;
        const int ldqt = qtile.second;
        float* sb = s.data();
        std::fill(o.begin(), o.end(), 0.0f);
        std::fill(m.begin(), m.end(), kMasked);
        std::fill(l.begin(), l.end(), 0.0f);
        // Key segments of kSeg: each segment's scores are exponentiated against the running row
        // maximum while they are hot in cache and multiplied into the output (flash-attention
        // style); the exponentials stay in the block buffer, with the maximum they were taken
        // against, so the final probabilities are exp(s - m_seg) * exp(m_seg - m) / sum.
        const int nseg = (n + kSeg - 1) / kSeg;
        for (int g = 0; g < nseg; ++g) {
          const int k0 = g * kSeg, ns = std::min(kSeg, n - k0);
          float* sg = sb + k0;  // the segment's scores: row i at sg + i * n
          // s[nr, k0:k0+ns] = scale * q[nr, d] @ k[k0:k0+ns]^T (scaled by BLAS alpha, as dense attention does)
          if (lowp)
            gemm_lowp('T', 'N', ns, nr, d, fscale, kl + static_cast<int64_t>(k0) * ldk, ldk, qrows, ldq, 0.0f, sg, n);
          else
            gemm('T', 'N', ns, nr, d, fscale, kt + static_cast<int64_t>(k0) * ldkt, ldkt, qt, ldqt, 0.0f, sg, n);
          for (int i = 0; i < nr; ++i) {
            float* row = sg + static_cast<int64_t>(i) * n;
            const int vis = std::min(ns, off + r0 + i + 1 - k0);  // visible keys of this row in the segment
            if (vis <= 0) {
              std::fill(row, row + ns, 0.0f);
              seg_m[static_cast<int64_t>(i) * nseg_max + g] = kMasked;
              continue;
            }
            const float mx = row_max(row, vis, kMasked);
            const float m_new = std::max(m[i], mx);
            const float alpha = exp_neg(m[i] - m_new);  // 0 when m was the sentinel
            float sum = 0.0f;
            for (int j = 0; j < vis; ++j) {
              const float p = exp_neg(row[j] - m_new);
              row[j] = p;
              sum += p;
            }
            std::fill(row + vis, row + ns, 0.0f);
            if (alpha != 1.0f) {
              float* orow = o.data() + static_cast<int64_t>(i) * d;
              for (int c = 0; c < d; ++c) orow[c] *= alpha;
            }
            l[i] = l[i] * alpha + sum;
            m[i] = m_new;
            seg_m[static_cast<int64_t>(i) * nseg_max + g] = m_new;
          }
          // o[nr, d] += p[nr, ns] @ v[k0:k0+ns]
          if (lowp) {  // the exponentials rounded to T for this product only (PyTorch's flash attention does the same)
            rows_from_f32(sg, n, nr, ns, pl.data());
            gemm_lowp('N', 'N', d, nr, ns, 1.0f, vl + static_cast<int64_t>(k0) * ldv, ldv, pl.data(), ns, 1.0f, o.data(), d);
          } else {
            gemm('N', 'N', d, nr, ns, 1.0f, vt + static_cast<int64_t>(k0) * ldvt, ldvt, sg, n, 1.0f, o.data(), d);
          }
        }
        for (int i = 0; i < nr; ++i) {
          const float iv = 1.0f / l[i];
          const int vis = off + r0 + i + 1;
          const int r = r0 + i;
          float* dst = winp && r >= w0 ? winp + (static_cast<int64_t>(h) * window + (r - w0)) * s_len : nullptr;
          if (col || cmax || dst) {
            const float* row = sb + static_cast<int64_t>(i) * n;
            for (int g = 0; g * kSeg < vis; ++g) {
              const int k0 = g * kSeg, k1 = std::min(vis, k0 + kSeg);
              const float f = exp_neg(seg_m[static_cast<int64_t>(i) * nseg_max + g] - m[i]) * iv;
              if (col)
                for (int j = k0; j < k1; ++j) col[j] += row[j] * f;
              if (cmax)
                for (int j = k0; j < k1; ++j) cmax[j] = std::max(cmax[j], row[j] * f);
              if (dst)
                for (int j = k0; j < k1; ++j) dst[j] = row[j] * f;
            }
          }
          T* orow = op + static_cast<int64_t>(h) * so + static_cast<int64_t>(r0 + i) * ldo;
          const float* src = o.data() + static_cast<int64_t>(i) * d;
          for (int c = 0; c < d; ++c) orow[c] = static_cast<T>(src[c] * iv);  // the one rounding to T
        }
      }
    }
  });
}

}  // namespace

// q [Hq, Tq, D], k/v [Hkv, S, D] (S >= Tq >= 1), out [Hq, Tq, D]: one dtype (float32, bfloat16 or
// float16), any strides with a contiguous last dimension. head_kv [Hq] int32: the KV head each
// query head reads. Writes the causal attention output into out and returns
// (col_sums [Hq, S] if col_sums else [0], col_max [Hq, S] if col_max else [0],
// window_probs [Hq, window, S] if window > 0 else [0]), float32; col_max[h, j] is the largest
// probability any query of head h gives key j (0 for a key no query sees); window_probs row i is
// query Tq - window + i (zeros beyond the keys it sees).
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_scores_out(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& head_kv, double scale,
    bool col_sums, bool col_max, int64_t window, at::Tensor& out) {
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
  at::Tensor cmx = col_max ? at::zeros({hq, s_len}, f32) : at::empty({0}, f32);
  at::Tensor win = window > 0 ? at::zeros({hq, window, s_len}, f32) : at::empty({0}, f32);
  float* colp = col_sums ? col.data_ptr<float>() : nullptr;
  float* cmaxp = col_max ? cmx.data_ptr<float>() : nullptr;
  float* winp = window > 0 ? win.data_ptr<float>() : nullptr;
  const int w = static_cast<int>(window);
  if (dt == at::kFloat)
    causal_scores_impl<float>(q, k, v, head_kv, scale, out, colp, cmaxp, winp, w);
  else if (dt == at::kBFloat16)
    causal_scores_impl<c10::BFloat16>(q, k, v, head_kv, scale, out, colp, cmaxp, winp, w);
  else
    causal_scores_impl<c10::Half>(q, k, v, head_kv, scale, out, colp, cmaxp, winp, w);
  return {col, cmx, win};
}

TORCH_LIBRARY_FRAGMENT(kvtrim_native, m) {
  m.def("causal_attention_scores_out(Tensor q, Tensor k, Tensor v, Tensor head_kv, float scale, bool col_sums, "
        "bool col_max, int window, Tensor(a!) out) -> (Tensor, Tensor, Tensor)");
  m.impl("causal_attention_scores_out", c10::DispatchKey::CPU, &causal_attention_scores_out);
}
