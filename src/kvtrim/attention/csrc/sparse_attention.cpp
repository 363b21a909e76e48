// kvtrim: fused CPU sparse prefill attention (block + column layouts, online softmax).
//
// One task = one query head x one 64-row query block (on the packed AMX path, kGroup consecutive
// query blocks: the key blocks all of them list are computed for all their rows at once, then each
// block's others). A task walks the key blocks its layout
// lists (up to kSeg keys per segment: runs of consecutive blocks, so the BLAS calls are larger, or,
// on the packed AMX path, any blocks, so the softmax runs over longer rows) and then its single key columns (gathered into a thread-local buffer), and
// keeps a running max / sum / normalised output per row, as a flash-attention kernel does: the scores of a
// segment live only in a small thread-local buffer, there is no separate softmax pass, no
// gathered copy of whole key blocks, and no padding between query blocks of different widths.
//
// Matrix products go to the BLAS sgemm that libtorch_cpu exports (MKL or OpenBLAS, column-major
// convention: a row-major [r, c] matrix is a column-major [c, r] one with leading dimension c).
// Tasks are handed out dynamically, most expensive first, one per thread at a time. q, k, v and the
// output are read and written through their strides (row stride = BLAS leading dimension), so a
// transformers layer's [B, T, H, D]-ordered tensors need no copies.
//
// Masked scores are set to a large finite negative number (not -inf) so that the file can be
// built with -ffast-math; a row whose maximum in a segment
// is that sentinel has no visible key there and is skipped.
//
// Inputs may be float32, bfloat16 or float16 (q, k, v and out all of one dtype). Scores, softmax
// and the output accumulate in float32 throughout. bfloat16/float16 products go, where libtorch's
// MKL provides it, to MKL's reduced-precision GEMM (bfloat16 x bfloat16 -> float32: AVX-512 BF16 /
// AMX), reading q, k and v as they are; the probabilities are rounded to the input dtype for the
// product with v, unnormalised (the output row is divided by its sum once, at the end), as
// PyTorch's own flash attention does, in one vectorised pass with the exponential. Without that GEMM (another BLAS, or
// KVTRIM_NATIVE_LOWP_GEMM=0) a task converts its query block and each key/value segment into
// thread-local float32 tiles and uses sgemm. No whole-tensor copy is made either way; the output is
// rounded once to the input dtype when a task writes its rows. Where PyTorch's brgemm micro-kernel
// can pack its operand (AMX), full key blocks take the packed path instead (packed_path below).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int kBlock = 64;       // rows per query block, keys per key block (the layout's block_size)
constexpr int kSeg = 512;        // keys per segment (merged consecutive blocks or gathered columns)
constexpr int kGroup = 8;        // query blocks per task on the packed path (their shared key blocks in one product)

// A thread's buffers: scores and probabilities of one segment (up to `rows` query rows x kSeg keys),
// and the running output / max / sum of a task's rows (up to `rows`). The per-row functions below
// take `r` (the first of their rows in the task) and use the scores from the buffer's start.
template <typename T>
struct Scratch {
  int d;
  std::vector<float> s, o, m, l, kc, vc, qc;
  std::vector<T> pl, kl, vl;  // reduced-precision GEMM operands: probabilities, gathered key/value columns
  Scratch(int d, bool lowp, int rows)
      : d(d), s(rows * kSeg), o(rows * d), m(rows), l(rows), kc(lowp ? 0 : kSeg * d), vc(lowp ? 0 : kSeg * d),
        qc(lowp ? 0 : rows * d), pl(lowp ? rows * kSeg : 0), kl(lowp ? kSeg * d : 0), vl(lowp ? kSeg * d : 0) {}
  float* out(int r) { return o.data() + static_cast<int64_t>(r) * d; }
};

// Online-softmax update of rows [0, nr) with the float32 scores s[nr, n] (row-major), leaving the
// normalised probabilities in s for the product with the values (accumulate_f32). Masked entries
// are the sentinel; a row whose maximum is the sentinel has no visible key in this segment.
template <typename T>
inline void softmax_rows(Scratch<T>& w, int r, int nr, int n, int d) {
  float* s = w.s.data();
  for (int i = 0; i < nr; ++i) {
    float* row = s + static_cast<int64_t>(i) * n;
    const float mx = row_max(row, n, kMasked);
    if (mx <= kHidden) {  // no visible key for this row in this segment
      std::fill(row, row + n, 0.0f);
      continue;
    }
    const float m_new = std::max(w.m[r + i], mx);
    const float alpha = exp_neg(w.m[r + i] - m_new);  // 0 when m was the sentinel
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) {
      const float p = exp_neg(row[j] - m_new);
      row[j] = p;
      sum += p;
    }
    // The output row is kept normalised (a weighted mean of the values seen so far): the
    // probabilities are divided by the new running sum *before* the product with v, as a plain
    // softmax does, and the old row is reweighted by its share. With one segment this is exactly
    // softmax(s) @ v; dividing once at the end would add a rounding step to every output.
    const float l_new = w.l[r + i] * alpha + sum;
    const float inv = 1.0f / l_new;
    for (int j = 0; j < n; ++j) row[j] *= inv;
    const float keep = w.l[r + i] * alpha * inv;
    if (keep != 1.0f) {
      float* o = w.out(r + i);
      for (int c = 0; c < d; ++c) o[c] *= keep;
    }
    w.l[r + i] = l_new;
    w.m[r + i] = m_new;
  }
}

// The reduced-precision version (T = bfloat16 / float16), one pass fewer, as PyTorch's own CPU
// flash attention runs it: the scores' row maximum, then in one pass exp(pre * s - m), summed in
// float32 and rounded to T into lp[nr, n] for the product with v; the probabilities stay
// unnormalised, the float32 output row is a running sum rescaled by exp(m_old - m_new) when the
// maximum grows, and it is divided by the row's sum once, when the task writes it (finish_rows).
// `pre` scales the scores first: 1 when the GEMM applied the softmax scale (BLAS alpha), the scale
// itself when they are raw products (the packed AMX path, whose GEMM has no alpha).
// bfloat16's bits of a finite float, rounded to nearest even (what c10::BFloat16 gives, without
// its NaN branch, so the loop around it vectorises; probabilities are never NaN).
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
inline void softmax_rows_lowp(Scratch<T>& w, int r, int nr, int n, int d, float pre, T* lp) {
  const float* s = w.s.data();
  for (int i = 0; i < nr; ++i) {
    const float* row = s + static_cast<int64_t>(i) * n;
    T* dst = lp + static_cast<int64_t>(i) * n;
    const float raw = row_max(row, n, kMasked);
    if (raw <= kHidden) {  // no visible key for this row in this segment
      std::fill(dst, dst + n, T(0.0f));
      continue;
    }
    const float m_new = std::max(w.m[r + i], raw * pre);
    const float alpha = exp_neg(w.m[r + i] - m_new);  // 0 when m was the sentinel
    float sum = 0.0f;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < n; ++j) {
        const float p = exp_neg(row[j] * pre - m_new);
        bits[j] = bf16_bits(p);
        sum += p;
      }
    } else {
      float* tmp = w.s.data() + static_cast<int64_t>(i) * n;  // this row's scores, read once above
      for (int j = 0; j < n; ++j) {
        const float p = exp_neg(tmp[j] * pre - m_new);
        tmp[j] = p;
        sum += p;
      }
      for (int j = 0; j < n; ++j) dst[j] = static_cast<T>(tmp[j]);
    }
    if (alpha != 1.0f) {
      float* o = w.out(r + i);
      for (int c = 0; c < d; ++c) o[c] *= alpha;
    }
    w.l[r + i] = w.l[r + i] * alpha + sum;
    w.m[r + i] = m_new;
  }
}

// o[nr, d] += p[nr, n] @ v[n, d]; v row-major with leading dimension ldv: float32, with the
// probabilities softmax_rows left in s, or T, with those softmax_rows_lowp rounded to T into pl (as
// PyTorch's flash attention rounds its probabilities for the same product).
template <typename T>
inline void accumulate_f32(Scratch<T>& w, int r, int nr, int n, int d, const float* v, int ldv) {
  gemm('N', 'N', d, nr, n, 1.0f, v, ldv, w.s.data(), n, 1.0f, w.out(r), d);
}

template <typename T>
inline void accumulate_lowp(Scratch<T>& w, int r, int nr, int n, int d, const T* v, int ldv) {
  gemm_lowp('N', 'N', d, nr, n, 1.0f, v, ldv, w.pl.data(), n, 1.0f, w.out(r), d);
}

// The packed AMX path (bfloat16/float16 where PyTorch's brgemm micro-kernel can pack its operand:
// oneDNN's, the one PyTorch's own CPU flash attention uses): every full 64-key block of k and v is
// packed once per call into the micro-kernel's layout (k transposed), so the products of all query
// blocks read them without MKL's per-call copies; q and the probabilities are read as they are. A
// sequence's last, partial block goes through the MKL GEMM. KVTRIM_NATIVE_BRGEMM=0 turns it off.
template <typename T>
inline bool packed_path() {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    static const bool enabled =
        !switched_off("KVTRIM_NATIVE_BRGEMM") &&
        at::native::cpublas::could_pack(std::is_same_v<T, c10::BFloat16> ? at::kBFloat16 : at::kHalf);
    return enabled && lowp_gemm<T>();
  }
}

}  // namespace

// q [Hq, T, D], k/v [Hkv, T, D], out [Ho, T, D]: element type T (float, BFloat16, Half), any
// strides with the last dimension contiguous (so the [B, T, H, D] tensors of a transformers layer are read and written in place,
// with the row stride as the BLAS leading dimension). Task row h (H rows) is query head
// q_head[h], reads KV head head_kv[h] and writes out[out_head[h]]; rows with no visible key are
// written as zeros. Scores are scaled by `scale`.
// block_idx [H, nb, maxb], block_cnt [H, nb], col_idx [H, nb, maxc], col_cnt [H, nb] (int32);
// or block_idx / col_idx flat (1-D): the rows' entries one after another, row i's at the sum of
// the counts before it (no padding to the widest row: one head with thousands of verticals
// would otherwise widen every row of every head of the call).
// n_init / n_local [H] (int32): the A-shape window of row h; negative: no window.
template <typename T>
void sparse_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_head,
                           const at::Tensor& head_kv, const at::Tensor& block_idx, const at::Tensor& block_cnt,
                           const at::Tensor& col_idx, const at::Tensor& col_cnt, const at::Tensor& n_init,
                           const at::Tensor& n_local, double scale, at::Tensor& out, const at::Tensor& out_head) {
  for (const at::Tensor* x : {&q_head, &head_kv, &out_head, &block_idx, &block_cnt, &col_idx, &col_cnt, &n_init, &n_local})
    TORCH_CHECK(x->scalar_type() == at::kInt && x->is_contiguous(), "layout tensors must be contiguous int32");
  const int hq_all = q.size(0), t = q.size(1), d = q.size(2), hkv = k.size(0), ho = out.size(0);
  const int hq = q_head.numel();
  TORCH_CHECK(k.size(1) == t && v.size(1) == t && out.size(1) == t && k.size(2) == d && v.size(2) == d &&
                  out.size(2) == d && v.size(0) == hkv, "k/v/out shape");
  TORCH_CHECK(head_kv.numel() == hq && out_head.numel() == hq && n_init.numel() == hq && n_local.numel() == hq,
              "per-row tensors must have H entries");
  const int nb = (t + kBlock - 1) / kBlock;
  TORCH_CHECK(block_cnt.dim() == 2 && col_cnt.dim() == 2 && block_cnt.size(0) == hq && block_cnt.size(1) == nb &&
                  col_cnt.size(0) == hq && col_cnt.size(1) == nb, "layout counts do not match [H, n_blocks]");
  const bool flat_b = block_idx.dim() == 1, flat_c = col_idx.dim() == 1;
  TORCH_CHECK(flat_b || (block_idx.dim() == 3 && block_idx.size(0) == hq && block_idx.size(1) == nb),
              "block_idx must be [H, n_blocks, max_blocks] or flat");
  TORCH_CHECK(flat_c || (col_idx.dim() == 3 && col_idx.size(0) == hq && col_idx.size(1) == nb),
              "col_idx must be [H, n_blocks, max_cols] or flat");
  const int64_t maxb = flat_b ? INT32_MAX : block_idx.size(2), maxc = flat_c ? INT32_MAX : col_idx.size(2);
  const int32_t* qhp = q_head.data_ptr<int32_t>();
  const int32_t* hkvp = head_kv.data_ptr<int32_t>();
  const int32_t* ohp = out_head.data_ptr<int32_t>();
  const int32_t* initp = n_init.data_ptr<int32_t>();
  const int32_t* localp = n_local.data_ptr<int32_t>();
  std::vector<char> written(ho, 0);
  for (int h = 0; h < hq; ++h) {
    TORCH_CHECK(qhp[h] >= 0 && qhp[h] < hq_all, "q_head out of range");
    TORCH_CHECK(hkvp[h] >= 0 && hkvp[h] < hkv, "head_kv out of range");
    TORCH_CHECK(ohp[h] >= 0 && ohp[h] < ho && !written[ohp[h]], "out_head out of range or repeated");
    written[ohp[h]] = 1;
  }
  const int ldq = row_stride(q, d, "q"), ldk = row_stride(k, d, "k"), ldv = row_stride(v, d, "v"),
            ldo = row_stride(out, d, "out");
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0), so = out.stride(0);

  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int32_t* bidx = block_idx.data_ptr<int32_t>();
  const int32_t* bcnt = block_cnt.data_ptr<int32_t>();
  const int32_t* cidx = col_idx.data_ptr<int32_t>();
  const int32_t* ccnt = col_cnt.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();

  // Where each row's entries start (padded: row * width; flat: the counts before it). Bounds are
  // checked once here, so the kernel never reads outside the layout or k/v.
  const int64_t nrow = static_cast<int64_t>(hq) * nb;
  std::vector<int64_t> boff(nrow), coff(nrow);
  int64_t bsum = 0, csum = 0;
  for (int64_t i = 0; i < nrow; ++i) {
    TORCH_CHECK(bcnt[i] >= 0 && bcnt[i] <= maxb && ccnt[i] >= 0 && ccnt[i] <= maxc, "layout count out of range");
    boff[i] = flat_b ? bsum : i * maxb;
    coff[i] = flat_c ? csum : i * maxc;
    bsum += bcnt[i];
    csum += ccnt[i];
  }
  TORCH_CHECK(!flat_b || bsum <= block_idx.numel(), "flat block_idx is shorter than its counts");
  TORCH_CHECK(!flat_c || csum <= col_idx.numel(), "flat col_idx is shorter than its counts");
  for (int64_t i = 0; i < nrow; ++i) {
    const int qb = i % nb;
    const int32_t* bi = bidx + boff[i];
    for (int j = 0; j < bcnt[i]; ++j)
      TORCH_CHECK(bi[j] >= 0 && bi[j] <= qb && (j == 0 || bi[j] > bi[j - 1]), "block index not ascending or not causal");
    const int32_t* ci = cidx + coff[i];
    for (int j = 0; j < ccnt[i]; ++j)
      TORCH_CHECK(ci[j] >= 0 && ci[j] < t && ci[j] < (qb + 1) * kBlock, "column index out of range");
  }

  const float fscale = static_cast<float>(scale);

  const bool lowp = lowp_gemm<T>();
  // The packed AMX path: every full key block of each KV head, k transposed, packed once here.
  const bool packed = packed_path<T>() && d % 16 == 0 && d <= 256;
  const int nfull = t / kBlock;  // full 64-key blocks; a partial last one goes through MKL
  const int64_t bsz = static_cast<int64_t>(kBlock) * d;
  std::vector<T> pk(packed ? hkv * nfull * bsz : 0), pv(packed ? hkv * nfull * bsz : 0);
  // Packed v of KV head kvh, column chunk c0 (width cw = min(64, d - c0)), key block b: a chunk's
  // blocks are contiguous (kBlock * cw elements each); the packed (VNNI) layout runs along the keys
  // in pairs, so blocks b .. b + r - 1 read from block b's start are the packed [r * kBlock, cw] operand.
  auto pv_at = [&](int64_t kvh, int c0, int64_t b) {
    return pv.data() + kvh * nfull * bsz + static_cast<int64_t>(nfull) * kBlock * c0 +
           b * kBlock * std::min(64, d - c0);
  };
  if (packed && nfull > 0) {
    const auto st = std::is_same_v<T, c10::BFloat16> ? at::kBFloat16 : at::kHalf;
    at::parallel_for(0, static_cast<int64_t>(hkv) * nfull, 1, [&](int64_t b0, int64_t b1) {
      std::vector<T> tr(bsz);
      for (int64_t i = b0; i < b1; ++i) {
        const int64_t kvh = i / nfull, b = i % nfull;
        const T* kb = kp + kvh * sk + b * kBlock * ldk;
        for (int r = 0; r < kBlock; ++r)
          for (int c = 0; c < d; ++c) tr[static_cast<int64_t>(c) * kBlock + r] = kb[static_cast<int64_t>(r) * ldk + c];
        at::native::cpublas::pack(d, kBlock, kBlock, kBlock, st, st, tr.data(), pk.data() + i * bsz);
        // v in column chunks of up to 64 (the widths the micro-kernel packs), each chunk's blocks one
        // after another (pv_at), so a run of consecutive blocks is one packed [run keys, chunk] operand
        for (int c0 = 0; c0 < d; c0 += 64)
          at::native::cpublas::pack(kBlock, std::min(64, d - c0), ldv, std::min(64, d - c0), st, st,
                                    vp + kvh * sv + b * kBlock * ldv + c0, pv_at(kvh, c0, b));
      }
    });
  }

  // Tasks: one query head x `group` consecutive 64-row query blocks (kGroup on the packed path,
  // one block otherwise), most expensive first, handed out one per thread at a time. A group's
  // rows share one running output; the key blocks that every one of its query blocks lists are
  // computed for all its rows at once (fewer, larger micro-kernel calls: the AMX products of 64
  // rows are dominated by their fixed costs), then each query block's other key blocks and its
  // columns for its own 64 rows. Neighbouring query blocks share most of their key blocks (a
  // window or a slash moves by one block per query block; top-k blocks often repeat).
  // KVTRIM_NATIVE_QUERY_GROUPS=0: one query block per task on the packed path too (read per call,
  // so a benchmark can time both in one process; same outputs within the tolerance rule).
  const int group = packed && !switched_off("KVTRIM_NATIVE_QUERY_GROUPS") ? kGroup : 1;
  const int ng = (nb + group - 1) / group;
  const int64_t ntask = static_cast<int64_t>(hq) * ng;
  std::vector<int64_t> cost(ntask, 0), order(ntask);
  for (int64_t i = 0; i < ntask; ++i)
    for (int qb = (i % ng) * group; qb < std::min(nb, static_cast<int>(i % ng) * group + group); ++qb) {
      const int64_t row = (i / ng) * nb + qb;
      cost[i] += static_cast<int64_t>(bcnt[row]) * kBlock + ccnt[row];
    }
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch<T> w(d, lowp, group * kBlock);
    std::vector<int32_t> shared, own;
    std::vector<int> pos(group);
    for (int64_t it = next.fetch_add(1); it < ntask; it = next.fetch_add(1)) {
      const int64_t task = order[it];
      const int h = task / ng, qb0 = (task % ng) * group, qb1 = std::min(nb, qb0 + group), kvh = hkvp[h];
      const bool window = initp[h] >= 0 && localp[h] >= 0;
      const int64_t n_init = initp[h], n_local = localp[h];
      const int r0 = qb0 * kBlock, nr_all = std::min((qb1 - qb0) * kBlock, t - r0);
      const T* kh = kp + static_cast<int64_t>(kvh) * sk;
      const T* vh = vp + static_cast<int64_t>(kvh) * sv;
      const T* qtask = qp + static_cast<int64_t>(qhp[h]) * sq + static_cast<int64_t>(r0) * ldq;
      std::fill(w.o.begin(), w.o.begin() + static_cast<int64_t>(nr_all) * d, 0.0f);
      std::fill(w.m.begin(), w.m.begin() + nr_all, kMasked);
      std::fill(w.l.begin(), w.l.begin() + nr_all, 0.0f);
      auto width = [&](int b) { return std::min(kBlock, t - b * kBlock); };
      // q k^T is scaled after the product (BLAS alpha), as dense attention does: pre-scaling q
      // would round it once more when the scale is not a power of two (head_dim 128). With the
      // reduced-precision GEMM, q, k and v are read as they are; otherwise the task's query rows
      // as one float32 tile, converted once for its key blocks and its columns.
      const std::pair<const float*, int> qtile =
          lowp ? std::pair<const float*, int>{nullptr, 0} : f32_tile(qtask, ldq, nr_all, d, w.qc.data());
      auto qtile_rows = [&](int r) { return qtile.first + static_cast<int64_t>(r) * qtile.second; };

      // The key blocks `blocks[0 .. nblk)` (ascending) for the task's rows [r, r + nr).
      auto run_blocks = [&](const int32_t* blocks, int nblk, int r, int nr) {
        const int rs = r0 + r;  // the first row's position in the sequence
        const T* qrows = qtask + static_cast<int64_t>(r) * ldq;
        // Up to kSeg keys per segment: with the packed path any kSeg / kBlock listed blocks (each
        // block's products go to its own columns of the segment's scores, so the blocks need not be
        // neighbours: one softmax pass and one rescale of the output per segment instead of per
        // block); otherwise runs of consecutive blocks (one GEMM over the run's keys). Every block
        // holds kBlock keys but the sequence's last one, which sorts last.
        for (int j = 0; j < nblk;) {
          int e = j + 1;
          if (packed) {
            e = std::min(nblk, j + kSeg / kBlock);
          } else {
            while (e < nblk && blocks[e] == blocks[e - 1] + 1 && (e - j + 1) * kBlock <= kSeg) ++e;
          }
          int n = 0;
          for (int x = j; x < e; ++x) n += width(blocks[x]);
          float* s = w.s.data();
          const T* k0 = kh + static_cast<int64_t>(blocks[j]) * kBlock * ldk;
          if (packed) {  // raw products per 64-key block (scaled in softmax_rows_lowp)
            for (int x = j, off = 0; x < e; off += width(blocks[x]), ++x) {
              const int b = blocks[x];
              if (b < nfull)
                at::native::cpublas::brgemm(nr, kBlock, d, ldq, kBlock, n, false, qrows,
                                            pk.data() + (static_cast<int64_t>(kvh) * nfull + b) * bsz, s + off);
              else
                gemm_lowp('T', 'N', width(b), nr, d, 1.0f, kh + static_cast<int64_t>(b) * kBlock * ldk, ldk, qrows, ldq,
                          0.0f, s + off, n);
            }
          } else if (lowp) {
            gemm_lowp('T', 'N', n, nr, d, fscale, k0, ldk, qrows, ldq, 0.0f, s, n);
          } else {
            const auto [kt, ldkt] = f32_tile(k0, ldk, n, d, w.kc.data());
            gemm('T', 'N', n, nr, d, fscale, kt, ldkt, qtile_rows(r), qtile.second, 0.0f, s, n);
          }
          for (int x = j, off = 0; x < e; off += width(blocks[x]), ++x) {
            const int kb0 = blocks[x] * kBlock, wb = width(blocks[x]);
            if (kb0 + wb - 1 > rs) {  // the block reaches these rows: causal mask
              for (int i = 0; i < std::min(nr, kb0 + wb - 1 - rs); ++i)
                for (int c = std::max(0, rs + i + 1 - kb0); c < wb; ++c) s[i * n + off + c] = kMasked;
            }
            if (window && std::max<int64_t>(kb0, n_init) <= static_cast<int64_t>(rs) + nr - 1 - n_local) {
              for (int i = 0; i < nr; ++i) {
                const int64_t hide_to = static_cast<int64_t>(rs) + i - n_local;  // keys <= this are out of the window
                for (int64_t c = std::max<int64_t>(kb0, n_init); c <= std::min<int64_t>(hide_to, kb0 + wb - 1); ++c)
                  s[i * n + off + (c - kb0)] = kMasked;
              }
            }
          }
          if (packed) {
            T* pl = w.pl.data();
            softmax_rows_lowp(w, r, nr, n, d, fscale, pl);
            // p @ v over each run of consecutive full blocks in one product (keys as the reduction
            // dimension: the float32 output is read and written once per run, not once per block)
            for (int x = j, off = 0; x < e;) {
              const int b = blocks[x];
              if (b < nfull) {
                int y = x + 1;
                while (y < e && blocks[y] == blocks[y - 1] + 1 && blocks[y] < nfull) ++y;
                const int keys = (y - x) * kBlock;
                for (int c0 = 0; c0 < d; c0 += 64)
                  at::native::cpublas::brgemm(nr, std::min(64, d - c0), keys, n, std::min(64, d - c0), d, true, pl + off,
                                              pv_at(kvh, c0, b), w.out(r) + c0);
                off += keys;
                x = y;
              } else {
                gemm_lowp('N', 'N', d, nr, width(b), 1.0f, vh + static_cast<int64_t>(b) * kBlock * ldv, ldv, pl + off, n,
                          1.0f, w.out(r), d);
                off += width(b);
                ++x;
              }
            }
          } else {
            const T* v0 = vh + static_cast<int64_t>(blocks[j]) * kBlock * ldv;
            if (lowp) {
              softmax_rows_lowp(w, r, nr, n, d, 1.0f, w.pl.data());
              accumulate_lowp(w, r, nr, n, d, v0, ldv);
            } else {
              softmax_rows(w, r, nr, n, d);
              const auto [vt, ldvt] = f32_tile(v0, ldv, n, d, w.vc.data());
              accumulate_f32(w, r, nr, n, d, vt, ldvt);
            }
          }
          j = e;
        }
      };

      // Single columns `cols[0 .. ncol)` for the task's rows [r, r + nr), gathered kSeg at a time
      // (as float32 rows, or as they are for the reduced-precision GEMM).
      auto run_cols = [&](const int32_t* cols, int ncol, int r, int nr) {
        const int rs = r0 + r;
        const T* qrows = qtask + static_cast<int64_t>(r) * ldq;
        for (int c0 = 0; c0 < ncol; c0 += kSeg) {
          const int n = std::min(kSeg, ncol - c0);
          for (int c = 0; c < n; ++c) {
            const T* krow = kh + static_cast<int64_t>(cols[c0 + c]) * ldk;
            const T* vrow = vh + static_cast<int64_t>(cols[c0 + c]) * ldv;
            if (lowp) {
              std::copy(krow, krow + d, w.kl.data() + static_cast<int64_t>(c) * d);
              std::copy(vrow, vrow + d, w.vl.data() + static_cast<int64_t>(c) * d);
            } else {
              rows_to_f32(krow, 0, 1, d, w.kc.data() + static_cast<int64_t>(c) * d);
              rows_to_f32(vrow, 0, 1, d, w.vc.data() + static_cast<int64_t>(c) * d);
            }
          }
          float* s = w.s.data();
          if (lowp) {
            gemm_lowp('T', 'N', n, nr, d, fscale, w.kl.data(), d, qrows, ldq, 0.0f, s, n);
          } else {
            gemm('T', 'N', n, nr, d, fscale, w.kc.data(), d, qtile_rows(r), qtile.second, 0.0f, s, n);
          }
          // Per column, the rows that may not see its key: those before it (causal) and, in an
          // A-shape window, those n_local or more after it; only those entries are written (most
          // columns lie before the query block and outside any window: nothing to mask).
          for (int c = 0; c < n; ++c) {
            const int64_t key = cols[c0 + c];
            const int lo = static_cast<int>(std::clamp<int64_t>(key - rs, 0, nr));
            const int hi = window && key >= n_init ? static_cast<int>(std::clamp<int64_t>(key + n_local - rs, lo, nr)) : nr;
            for (int i = 0; i < lo; ++i) s[i * n + c] = kMasked;
            for (int i = hi; i < nr; ++i) s[i * n + c] = kMasked;
          }
          if (lowp) {
            softmax_rows_lowp(w, r, nr, n, d, 1.0f, w.pl.data());
            accumulate_lowp(w, r, nr, n, d, static_cast<const T*>(w.vl.data()), d);
          } else {
            softmax_rows(w, r, nr, n, d);
            accumulate_f32(w, r, nr, n, d, static_cast<const float*>(w.vc.data()), d);
          }
        }
      };

      const int64_t row0 = static_cast<int64_t>(h) * nb + qb0;  // layout row of the first query block
      shared.clear();
      if (qb1 - qb0 > 1) {  // the key blocks every query block of the group lists (lists ascending)
        std::fill(pos.begin(), pos.end(), 0);
        const int32_t* first = bidx + boff[row0];
        for (int j = 0; j < bcnt[row0]; ++j) {
          bool all = true;
          for (int q = 1; q < qb1 - qb0 && all; ++q) {
            const int32_t* l = bidx + boff[row0 + q];
            while (pos[q] < bcnt[row0 + q] && l[pos[q]] < first[j]) ++pos[q];
            all = pos[q] < bcnt[row0 + q] && l[pos[q]] == first[j];
          }
          if (all) shared.push_back(first[j]);
        }
        run_blocks(shared.data(), static_cast<int>(shared.size()), 0, nr_all);
      }
      for (int qb = qb0; qb < qb1; ++qb) {
        const int64_t row = static_cast<int64_t>(h) * nb + qb;
        const int32_t* l = bidx + boff[row];
        const int r = (qb - qb0) * kBlock, nr = std::min(kBlock, t - qb * kBlock);
        if (shared.empty()) {
          run_blocks(l, bcnt[row], r, nr);
        } else {
          own.clear();
          for (int j = 0, x = 0; j < bcnt[row]; ++j) {  // this block's list minus the shared blocks
            while (x < static_cast<int>(shared.size()) && shared[x] < l[j]) ++x;
            if (x == static_cast<int>(shared.size()) || shared[x] != l[j]) own.push_back(l[j]);
          }
          run_blocks(own.data(), static_cast<int>(own.size()), r, nr);
        }
        run_cols(cidx + coff[row], ccnt[row], r, nr);
      }
      T* oh = op + static_cast<int64_t>(ohp[h]) * so + static_cast<int64_t>(r0) * ldo;
      for (int i = 0; i < nr_all; ++i) {
        T* dst = oh + static_cast<int64_t>(i) * ldo;
        if (w.l[i] <= 0.0f) {  // no visible key: the row is 0
          std::fill(dst, dst + d, T(0.0f));
        } else {
          const float* src = w.out(i);
          const float inv = lowp ? 1.0f / w.l[i] : 1.0f;  // the reduced-precision rows are unnormalised sums
          for (int c = 0; c < d; ++c) dst[c] = static_cast<T>(src[c] * inv);  // the one rounding to T
        }
      }
    }
    if (packed) at::native::cpublas::brgemm_release();
  });
}

// q [Hq, T, D], k/v [Hkv, T, D], out [Ho, T, D]: float32, bfloat16 or float16 (all one dtype), any
// strides with the last dimension contiguous. See sparse_attention_impl.
void sparse_attention_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_head,
                          const at::Tensor& head_kv, const at::Tensor& block_idx, const at::Tensor& block_cnt,
                          const at::Tensor& col_idx, const at::Tensor& col_cnt, const at::Tensor& n_init,
                          const at::Tensor& n_local, double scale, at::Tensor& out, const at::Tensor& out_head) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "q, k, v, out must be [heads, T, D]");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "q must be float32, bfloat16 or float16");
  for (const at::Tensor* x : {&q, &k, &v, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(x->scalar_type() == dt && x->stride(2) == 1,
                "q, k, v, out must have one dtype and a contiguous last dimension");
  if (dt == at::kFloat)
    sparse_attention_impl<float>(q, k, v, q_head, head_kv, block_idx, block_cnt, col_idx, col_cnt, n_init, n_local, scale,
                                 out, out_head);
  else if (dt == at::kBFloat16)
    sparse_attention_impl<c10::BFloat16>(q, k, v, q_head, head_kv, block_idx, block_cnt, col_idx, col_cnt, n_init,
                                         n_local, scale, out, out_head);
  else
    sparse_attention_impl<c10::Half>(q, k, v, q_head, head_kv, block_idx, block_cnt, col_idx, col_cnt, n_init, n_local,
                                     scale, out, out_head);
}

// Vertical-slash index estimation, fused: for each query head, the softmax of its last lq queries
// (rows T-lq..T-1) over all keys (causal in the corner), summed per column ("vertical" scores)
// and per diagonal offset i - j ("slash" scores). One head per task, one BLAS call per head.
// q_last [H, lq, D] float32 contiguous, k [Hkv, T, D] float32, bfloat16 or float16 with a contiguous
// last dimension (any other strides; a bfloat16/float16 head is converted into a thread-local
// float32 buffer when a task first needs it); returns (vert [H, T], slash [H, T]) float32.
template <typename T>
std::tuple<at::Tensor, at::Tensor> vertical_slash_impl(const at::Tensor& q_last, const at::Tensor& k,
                                                       const at::Tensor& head_kv, double scale) {
  TORCH_CHECK(q_last.is_contiguous() && k.stride(2) == 1, "q_last must be contiguous and k's last dimension contiguous");
  TORCH_CHECK(head_kv.scalar_type() == at::kInt && head_kv.is_contiguous() && head_kv.numel() == q_last.size(0),
              "head_kv must be int32 [H]");
  const int h_n = q_last.size(0), lq = q_last.size(1), d = q_last.size(2), hkv = k.size(0), t = k.size(1);
  TORCH_CHECK(k.size(2) == d && lq >= 1 && lq <= t, "shapes: need 1 <= lq <= T and equal head_dim");
  const int ldk = row_stride(k, d, "k");
  const int64_t sk = k.stride(0);
  const int32_t* hkvp = head_kv.data_ptr<int32_t>();
  for (int h = 0; h < h_n; ++h) TORCH_CHECK(hkvp[h] >= 0 && hkvp[h] < hkv, "head_kv out of range");
  at::Tensor vert = at::zeros({h_n, t}, q_last.options());
  at::Tensor slash = at::zeros({h_n, t}, q_last.options());
  const float* qp = q_last.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  float* vp = vert.data_ptr<float>();
  float* sp = slash.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  std::atomic<int> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> s(static_cast<size_t>(lq) * t);
    std::vector<float> kbuf(std::is_same_v<T, float> ? 0 : static_cast<size_t>(t) * d);
    int held = -1;  // the KV head kbuf holds (query heads of one group come one after another)
    for (int h = next.fetch_add(1); h < h_n; h = next.fetch_add(1)) {
      const float* qh = qp + static_cast<int64_t>(h) * lq * d;
      const T* kh = kp + static_cast<int64_t>(hkvp[h]) * sk;
      const float* kt;
      int ldkt;
      if constexpr (std::is_same_v<T, float>) {
        kt = kh;
        ldkt = ldk;
      } else {
        if (held != hkvp[h]) rows_to_f32(kh, ldk, t, d, kbuf.data());
        held = hkvp[h];
        kt = kbuf.data();
        ldkt = d;
      }
      // s[lq, T] = scale * q[lq, d] @ k^T
      gemm('T', 'N', t, lq, d, fscale, kt, ldkt, qh, d, 0.0f, s.data(), t);
      float* vh = vp + static_cast<int64_t>(h) * t;
      float* sh = sp + static_cast<int64_t>(h) * t;
      for (int r = 0; r < lq; ++r) {
        const int row = t - lq + r;  // keys 0..row are visible
        float* x = s.data() + static_cast<int64_t>(r) * t;
        const float mx = row_max(x, row + 1, kMasked);
        float sum = 0.0f;
        for (int j = 0; j <= row; ++j) {
          const float p = exp_neg(x[j] - mx);
          x[j] = p;
          sum += p;
        }
        const float inv = 1.0f / sum;
        for (int j = 0; j <= row; ++j) vh[j] += x[j] * inv;
        for (int j = 0; j <= row; ++j) sh[row - j] += x[j] * inv;
      }
    }
  });
  return {vert, slash};
}

std::tuple<at::Tensor, at::Tensor> vertical_slash_scores(const at::Tensor& q_last, const at::Tensor& k,
                                                         const at::Tensor& head_kv, double scale) {
  TORCH_CHECK(q_last.dim() == 3 && k.dim() == 3, "q_last must be [H, lq, D] and k [Hkv, T, D]");
  const auto dt = k.scalar_type();
  TORCH_CHECK(q_last.scalar_type() == at::kFloat && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf),
              "q_last must be float32 and k float32, bfloat16 or float16");
  if (dt == at::kFloat) return vertical_slash_impl<float>(q_last, k, head_kv, scale);
  if (dt == at::kBFloat16) return vertical_slash_impl<c10::BFloat16>(q_last, k, head_kv, scale);
  return vertical_slash_impl<c10::Half>(q_last, k, head_kv, scale);
}

// Vertical-slash layout build (the same result as kvtrim.attention.patterns' PyTorch builder):
// per head and query block [qs, qe), every key block a selected slash o crosses (keys qs-o..qe-1-o,
// clipped at 0; nothing if qe-1-o < 0), ascending; then every selected vertical j <= qe-1 that no
// listed block holds, ascending, duplicates once. v_idx [H, n_v] must be sorted ascending;
// s_off [H, n_s]; all indices in [0, T) (checked by the caller). Heads run in parallel.
std::vector<at::Tensor> vertical_slash_layout(const at::Tensor& v_idx, const at::Tensor& s_off, int64_t t, int64_t bs) {
  TORCH_CHECK(v_idx.dim() == 2 && s_off.dim() == 2 && v_idx.size(0) == s_off.size(0), "v_idx [H, n_v], s_off [H, n_s]");
  TORCH_CHECK(v_idx.scalar_type() == at::kLong && s_off.scalar_type() == at::kLong && v_idx.is_contiguous() && s_off.is_contiguous(),
              "indices must be contiguous int64");
  TORCH_CHECK(t > 0 && bs > 0, "T and block_size must be positive");
  const int64_t h_n = v_idx.size(0), n_v = v_idx.size(1), n_s = s_off.size(1), n = (t + bs - 1) / bs;
  const int64_t* vp = v_idx.data_ptr<int64_t>();
  const int64_t* sp = s_off.data_ptr<int64_t>();
  for (int64_t i = 0; i < v_idx.numel(); ++i) TORCH_CHECK(vp[i] >= 0 && vp[i] < t, "vertical index out of range");
  for (int64_t i = 0; i < s_off.numel(); ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < t, "slash offset out of range");
  std::vector<std::vector<int32_t>> blocks(h_n * n), cols(h_n * n);
  at::parallel_for(0, h_n, 1, [&](int64_t h0, int64_t h1) {
    std::vector<char> hit(n), diag(n + 1);
    std::vector<int64_t> vstart(n + 1);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t* v = vp + h * n_v;
      const int64_t* o = sp + h * n_s;
      // In a full query block qb, slash o = a * bs + r crosses key blocks qb - a and, when r > 0,
      // qb - a - 1 (clipped at block 0; none when qb < a): which blocks a slash hits depends only
      // on the block distance qb - kb, so it is tabulated once per head (diag) instead of per row.
      std::fill(diag.begin(), diag.end(), 0);
      for (int64_t j = 0; j < n_s; ++j) {
        const int64_t a = o[j] / bs;
        diag[a] = 1;
        if (o[j] % bs && a + 1 < n) diag[a + 1] = 1;
      }
      // verticals by key block: v[vstart[kb] .. vstart[kb + 1]) lie in key block kb (v is sorted)
      for (int64_t kb = 0, j = 0; kb <= n; ++kb) {
        while (j < n_v && v[j] < kb * bs) ++j;
        vstart[kb] = j;
      }
      for (int64_t qb = 0; qb < n; ++qb) {
        const int64_t qs = qb * bs, qe = std::min(qs + bs, t);
        if (qe - qs == bs) {
          for (int64_t kb = 0; kb <= qb; ++kb) hit[kb] = diag[qb - kb];
        } else {  // a partial last block: the slashes one by one
          std::fill(hit.begin(), hit.end(), 0);
          for (int64_t j = 0; j < n_s; ++j) {
            const int64_t hi = qe - 1 - o[j];
            if (hi < 0) continue;
            hit[std::max<int64_t>(qs - o[j], 0) / bs] = 1;
            hit[hi / bs] = 1;
          }
        }
        std::vector<int32_t>& b = blocks[h * n + qb];
        std::vector<int32_t>& c = cols[h * n + qb];
        for (int64_t kb = 0; kb <= qb; ++kb) {
          if (hit[kb]) {
            b.push_back(static_cast<int32_t>(kb));
            continue;
          }
          for (int64_t j = vstart[kb]; j < vstart[kb + 1] && v[j] <= qe - 1; ++j)
            if (j == 0 || v[j] != v[j - 1]) c.push_back(static_cast<int32_t>(v[j]));
        }
      }
    }
  });
  auto pack = [&](const std::vector<std::vector<int32_t>>& rows) {
    size_t width = 0;
    for (const auto& r : rows) width = std::max(width, r.size());
    at::Tensor idx = at::zeros({h_n, n, static_cast<int64_t>(width)}, at::kInt);
    at::Tensor cnt = at::empty({h_n, n}, at::kInt);
    int32_t* ip = idx.data_ptr<int32_t>();
    int32_t* cp = cnt.data_ptr<int32_t>();
    for (size_t r = 0; r < rows.size(); ++r) {
      std::copy(rows[r].begin(), rows[r].end(), ip + r * width);
      cp[r] = static_cast<int32_t>(rows[r].size());
    }
    return std::make_pair(idx, cnt);
  };
  auto [bidx, bcnt] = pack(blocks);
  auto [cidx, ccnt] = pack(cols);
  return {bidx, bcnt, cidx, ccnt};
}

// The entries of padded rows one after another: idx [R, w], cnt [R] (int32, contiguous) ->
// idx[r, :cnt[r]] for r in order (the sparse kernel's flat layout), reading only the entries (a
// vertical-slash layout's column rows are padded to the widest row of all its heads).
at::Tensor flat_rows(const at::Tensor& idx, const at::Tensor& cnt) {
  TORCH_CHECK(idx.dim() == 2 && cnt.dim() == 1 && cnt.size(0) == idx.size(0), "idx [R, w], cnt [R]");
  TORCH_CHECK(idx.scalar_type() == at::kInt && cnt.scalar_type() == at::kInt && idx.is_contiguous() && cnt.is_contiguous(),
              "idx and cnt must be contiguous int32");
  const int64_t rows = idx.size(0), w = idx.size(1);
  const int32_t* cp = cnt.data_ptr<int32_t>();
  std::vector<int64_t> off(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(cp[r] >= 0 && cp[r] <= w, "count out of range");
    off[r + 1] = off[r] + cp[r];
  }
  at::Tensor out = at::empty({off[rows]}, at::kInt);
  const int32_t* ip = idx.data_ptr<int32_t>();
  int32_t* op = out.data_ptr<int32_t>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::copy(ip + r * w, ip + r * w + cp[r], op + off[r]);
  });
  return out;
}

TORCH_LIBRARY(kvtrim_native, m) {
  m.def("sparse_attention_out(Tensor q, Tensor k, Tensor v, Tensor q_head, Tensor head_kv, Tensor block_idx, "
        "Tensor block_cnt, Tensor col_idx, Tensor col_cnt, Tensor n_init, Tensor n_local, float scale, "
        "Tensor(a!) out, Tensor out_head) -> ()");
  m.impl("sparse_attention_out", c10::DispatchKey::CPU, &sparse_attention_out);
  m.def("vertical_slash_scores(Tensor q_last, Tensor k, Tensor head_kv, float scale) -> (Tensor, Tensor)");
  m.impl("vertical_slash_scores", c10::DispatchKey::CPU, &vertical_slash_scores);
  m.def("flat_rows(Tensor idx, Tensor cnt) -> Tensor");
  m.impl("flat_rows", c10::DispatchKey::CPU, &flat_rows);
  m.def("vertical_slash_layout(Tensor v_idx, Tensor s_off, int t, int bs) -> Tensor[]");
  m.impl("vertical_slash_layout", c10::DispatchKey::CPU, &vertical_slash_layout);
}
