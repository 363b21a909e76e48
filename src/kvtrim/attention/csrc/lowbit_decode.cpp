// kvtrim: one decode query's attention over low-bit KV slots (CPU side of
// kvtrim.attention.lowbit.lowbit_decode_attention).
//
// The codes are KIVI's (kvtrim/attention/lowbit.py): keys per channel with a scale and zero point per
// channel and group (a slot names its group), values per token with one scale and zero point each,
// `8 / bits` codes packed to a byte along the head dimension, code j of a byte at bits j * bits.
//
// One task = one (sequence, KV head); the G query heads sharing it are handled together, so every
// slot's codes are read once for all of them. Two passes over the slots, each reading one kind of
// code once, kChunk (64) slots at a time: the first unpacks the chunk's keys into a float32 tile of
// kChunk x D (code * scale + zero of each slot's group) and forms the G rows of logits with one
// matrix product (BLAS sgemm, common.h), storing them (the probabilities a method reads are returned
// from them); the second, with each row's maximum known, unpacks the chunk's value codes into a tile
// as they are (integers in float32) and weighs them with one product by p * scale, summing p * zero
// apart, so no value is ever dequantized as a vector. Nothing larger than one tile (64 keys or value
// codes, 16 KiB at D = 64) is ever held in float32. (One product per chunk, not a dot product per
// slot and head with its horizontal sum and a pass over the G accumulators per slot: the latter left
// the kernel compute-bound at a few times the bytes' cost.) Returns each row's maximum, its sum of
// exp(logit - max) and the unnormalised output, in float32, which the caller folds with the tokens
// still held in the model's dtype. A key whose rotation changed since it was packed (kvtrim's
// ``reassigned`` positions) is turned as it is unpacked, by the (cos, sin) row its slot names in a
// table of the distinct turns.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/Half.h>

#include "common.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

template <int BITS>
inline void unpack_codes(const uint8_t* src, int d, float* out) {
  constexpr int per = 8 / BITS;
  constexpr int mask = (1 << BITS) - 1;
  for (int i = 0; i < d / per; ++i) {
    const int byte = src[i];
    for (int j = 0; j < per; ++j) out[i * per + j] = static_cast<float>((byte >> (j * BITS)) & mask);
  }
}

constexpr int64_t kChunk = 64;  // slots per product (a float32 tile), summed in float32 before the float64 totals take them

inline void flush(const std::vector<float>& part, const std::vector<float>& wpart, const std::vector<float>& zpart,
                  std::vector<double>& acc, std::vector<double>& wsum, std::vector<double>& zsum) {
  for (size_t i = 0; i < part.size(); ++i) acc[i] += part[i];
  for (size_t j = 0; j < wpart.size(); ++j) {
    wsum[j] += wpart[j];
    zsum[j] += zpart[j];
  }
}

template <int BITS>
void lowbit_decode_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& kg, const at::Tensor& table,
                        const at::Tensor& vc, const at::Tensor& vs, const at::Tensor& vz, const at::Tensor& bias,
                        const at::Tensor& rot_index, const at::Tensor& rot_table, bool interleaved,
                        double scale, at::Tensor& logits, at::Tensor& m_out, at::Tensor& l_out, at::Tensor& acc_out) {
  const int64_t bh = q.size(0), g = q.size(1), d = q.size(2);
  const int64_t s = kc.size(1), pk = kc.size(2), pv = vc.size(2);
  const int64_t dv = pv * (8 / BITS);
  const int64_t ng = table.size(0) / bh;
  const int64_t s_log = logits.size(2);
  const float* qp = q.data_ptr<float>();
  const uint8_t* kcp = kc.data_ptr<uint8_t>();
  const int32_t* kgp = kg.data_ptr<int32_t>();
  const float* tp = table.data_ptr<float>();
  const uint8_t* vcp = vc.data_ptr<uint8_t>();
  const at::Half* vsp = vs.data_ptr<at::Half>();
  const at::Half* vzp = vz.data_ptr<at::Half>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const int32_t* rip = rot_index.numel() ? rot_index.data_ptr<int32_t>() : nullptr;
  const float* rtp = rot_table.numel() ? rot_table.data_ptr<float>() : nullptr;
  const int64_t nf = rot_table.numel() ? rot_table.size(1) : 0;  // rotary frequencies (pairs)
  float* lp = logits.data_ptr<float>();
  float* mp = m_out.data_ptr<float>();
  float* sp = l_out.data_ptr<float>();
  float* ap = acc_out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // rows (one per sequence and KV head) of the per-slot tensors may lie further apart than s slots: a
  // storage that drops slots in place hands views into larger allocations (kvtrim.lowbit_storage)
  const int64_t kcs = kc.stride(0), kgs = kg.stride(0), vcs = vc.stride(0), vss = vs.stride(0), vzs = vz.stride(0);

  at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kChunk * std::max(d, dv)), prob(g * kChunk), vsf(kChunk), vzf(kChunk), rowmax(g);
    std::vector<double> wsum(g), zsum(g), acc(g * dv);
    std::vector<float> part(g * dv), wpart(g), zpart(g);
    for (int64_t r = begin; r < end; ++r) {
      const float* qr = qp + r * g * d;
      const float* tab = tp + r * ng * 2 * d;
      float* lr = lp + r * g * s_log;
      for (int64_t j = 0; j < g; ++j) rowmax[j] = -std::numeric_limits<float>::infinity();
      // pass 1: keys -> logits, kChunk slots at a time: the chunk's keys unpacked and scaled into a
      // float32 tile, then one product with the G queries writes their logits
      for (int64_t t0 = 0; t0 < s; t0 += kChunk) {
        const int n = static_cast<int>(std::min(kChunk, s - t0));
        for (int u = 0; u < n; ++u) {
          const int64_t t = t0 + u;
          float* key = tile.data() + static_cast<int64_t>(u) * d;
          unpack_codes<BITS>(kcp + r * kcs + t * pk, static_cast<int>(d), key);
          const float* row = tab + static_cast<int64_t>(kgp[r * kgs + t]) * 2 * d;
          for (int64_t i = 0; i < d; ++i) key[i] = key[i] * row[i] + row[d + i];
          if (rip && rip[r * s + t] >= 0) {  // a key re-rotated since it was packed: turn it (kvtrim.rope.rotate)
            const float* cs = rtp + static_cast<int64_t>(rip[r * s + t]) * nf * 2;
            for (int64_t i = 0; i < nf; ++i) {
              const int64_t a = interleaved ? 2 * i : i, b2 = interleaved ? 2 * i + 1 : i + nf;
              const float x1 = key[a], x2 = key[b2], c = cs[2 * i], sn = cs[2 * i + 1];
              key[a] = x1 * c - x2 * sn;
              key[b2] = x2 * c + x1 * sn;
            }
          }
        }
        // logits[j, t0 + u] = scale * q_j . key_u (row-major; column-major it is tile^T-by-q)
        gemm('T', 'N', n, static_cast<int>(g), static_cast<int>(d), sc, tile.data(), static_cast<int>(d), qr,
             static_cast<int>(d), 0.0f, lr + t0, static_cast<int>(s_log));
        for (int64_t j = 0; j < g; ++j) {
          float* lj = lr + j * s_log + t0;
          if (bp) {
            const float* bt = bp + r * s + t0;
            for (int u = 0; u < n; ++u) lj[u] += bt[u];
          }
          rowmax[j] = row_max(lj, n, rowmax[j]);
        }
      }
      // pass 2: values, weighed by exp(logit - max) * scale; the zero points summed apart. Each chunk's
      // sums run in float32 (a product over the chunk) and are then added in float64: thousands of
      // float32 terms added in order would lose more than the tolerance rule allows
      for (int64_t j = 0; j < g * dv; ++j) acc[j] = 0.0;
      for (int64_t j = 0; j < g; ++j) wsum[j] = zsum[j] = 0.0;
      for (int64_t t0 = 0; t0 < s; t0 += kChunk) {
        const int n = static_cast<int>(std::min(kChunk, s - t0));
        for (int u = 0; u < n; ++u) {
          vsf[u] = static_cast<float>(vsp[r * vss + t0 + u]);
          vzf[u] = static_cast<float>(vzp[r * vzs + t0 + u]);
          unpack_codes<BITS>(vcp + r * vcs + (t0 + u) * pv, static_cast<int>(dv), tile.data() + static_cast<int64_t>(u) * dv);
        }
        for (int64_t j = 0; j < g; ++j) {
          const float* lj = lr + j * s_log + t0;
          float* pj = prob.data() + j * kChunk;
          const float mx = rowmax[j];
          float ws = 0.0f, zs = 0.0f;
#pragma omp simd reduction(+ : ws, zs)
          for (int u = 0; u < n; ++u) {
            const float p = exp_neg(lj[u] - mx);
            ws += p;
            zs += p * vzf[u];
            pj[u] = p * vsf[u];
          }
          wpart[j] = ws;
          zpart[j] = zs;
        }
        // part[j, :] = sum_u (p_ju * scale_u) * codes_u (row-major; column-major it is codes-by-weights)
        gemm('N', 'N', static_cast<int>(dv), static_cast<int>(g), n, 1.0f, tile.data(), static_cast<int>(dv),
             prob.data(), static_cast<int>(kChunk), 0.0f, part.data(), static_cast<int>(dv));
        flush(part, wpart, zpart, acc, wsum, zsum);
      }
      float* out = ap + r * g * dv;
      for (int64_t j = 0; j < g; ++j) {
        for (int64_t i = 0; i < dv; ++i) out[j * dv + i] = static_cast<float>(acc[j * dv + i] + zsum[j]);
        mp[r * g + j] = rowmax[j];
        sp[r * g + j] = static_cast<float>(wsum[j]);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lowbit_decode(
    const at::Tensor& q, const at::Tensor& kc, const at::Tensor& kg, const at::Tensor& table, const at::Tensor& vc,
    const at::Tensor& vs, const at::Tensor& vz, const at::Tensor& bias, const at::Tensor& rot_index,
    const at::Tensor& rot_table, bool interleaved, int64_t bits, double scale, at::Tensor& logits) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be float32 [BH, G, D], contiguous");
  // the per-slot tensors: each row contiguous, rows any distance apart (in place drops, kvtrim.lowbit_storage)
  auto rows_ok = [](const at::Tensor& t) {
    return t.stride(t.dim() - 1) == 1 && (t.dim() == 2 || t.stride(1) == t.size(2)) && t.stride(0) >= 0;
  };
  TORCH_CHECK(kc.dim() == 3 && kc.scalar_type() == at::kByte && rows_ok(kc) && kc.size(0) == q.size(0),
              "key codes must be uint8 [BH, S, P], each row contiguous");
  TORCH_CHECK(kg.dim() == 2 && kg.scalar_type() == at::kInt && rows_ok(kg) && kg.size(1) == kc.size(1) &&
                  kg.size(0) == kc.size(0),
              "key groups must be int32 [BH, S], each row contiguous");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat && table.is_contiguous() &&
                  table.size(1) == 2 * q.size(2) && table.size(0) % q.size(0) == 0,
              "the key table must be float32 [BH * NG, 2 * D], contiguous");
  TORCH_CHECK(vc.dim() == 3 && vc.scalar_type() == at::kByte && rows_ok(vc) && vc.size(1) == kc.size(1) &&
                  vc.size(0) == kc.size(0),
              "value codes must be uint8 [BH, S, Pv], each row contiguous");
  TORCH_CHECK(vs.scalar_type() == at::kHalf && vz.scalar_type() == at::kHalf && vs.dim() == 2 && vz.dim() == 2 &&
                  rows_ok(vs) && rows_ok(vz) && vs.sizes() == kg.sizes() && vz.sizes() == kg.sizes(),
              "value scales and zero points must be float16 [BH, S], each row contiguous");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == kg.numel()),
              "bias must be empty or float32 [BH, S], contiguous");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  TORCH_CHECK(rot_index.numel() == 0 || (rot_index.scalar_type() == at::kInt && rot_index.is_contiguous() &&
                                         rot_index.numel() == kg.numel() && rot_table.dim() == 3 &&
                                         rot_table.scalar_type() == at::kFloat && rot_table.is_contiguous() &&
                                         rot_table.size(2) == 2 && 2 * rot_table.size(1) <= q.size(2)),
              "rotations must be empty, or int32 [BH, S] indices into a float32 [U, F, 2] (cos, sin) table, 2F <= D");
  TORCH_CHECK(kc.size(2) * (8 / bits) == q.size(2), "key codes do not pack the query's head dim");
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(0) == q.size(0) && logits.size(1) == q.size(1) && logits.size(2) >= kc.size(1),
              "logits must be float32 [BH, G, >= S], contiguous");
  const int64_t dv = vc.size(2) * (8 / bits);
  auto m = at::empty({q.size(0), q.size(1)}, q.options());
  auto l = at::empty({q.size(0), q.size(1)}, q.options());
  auto acc = at::empty({q.size(0), q.size(1), dv}, q.options());
  if (bits == 8) {
    lowbit_decode_impl<8>(q, kc, kg, table, vc, vs, vz, bias, rot_index, rot_table, interleaved, scale, logits, m, l, acc);
  } else if (bits == 4) {
    lowbit_decode_impl<4>(q, kc, kg, table, vc, vs, vz, bias, rot_index, rot_table, interleaved, scale, logits, m, l, acc);
  } else {
    lowbit_decode_impl<2>(q, kc, kg, table, vc, vs, vz, bias, rot_index, rot_table, interleaved, scale, logits, m, l, acc);
  }
  return {m, l, acc};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtrim_native, m) {
  m.def("lowbit_decode(Tensor q, Tensor key_codes, Tensor key_group, Tensor key_table, Tensor value_codes, "
        "Tensor value_scale, Tensor value_zero, Tensor bias, Tensor rot_index, Tensor rot_table, bool interleaved, "
        "int bits, float scale, Tensor(a!) logits) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("lowbit_decode", c10::DispatchKey::CPU, &lowbit_decode);
}
