"""Triton kernel: one decode query's attention over low-bit KV slots (GPU side of
:func:`kvtrim.attention.lowbit.lowbit_decode_attention`).

One program per (sequence, KV head): the ``G`` query heads that share the KV head are the rows of
one tile (padded to 16 for ``tl.dot``). The program walks the quantized slots ``BLOCK_N`` at a time;
each tile's key codes are unpacked from their bytes, turned into keys with their group's per-channel
scale and zero point (looked up by each slot's group id in the float32 table of
``LowBitKV.key_table``), multiplied with the queries, and folded into a running softmax (max,
normaliser, value accumulator in float32); the values are unpacked and scaled per slot the same way.
Nothing but a tile is ever dequantized. A key turned (RoPE) since it was packed is turned as its tile is
unpacked: its rotary partners' codes are unpacked too, and its slot names the ``(cos, sin)`` row of
the distinct turns (``kvtrim.attention.lowbit.KeyRotation``). The kernel writes each slot's logit (natural-log units,
bias included) for the probabilities a policy reads, and the softmax state ``(max, sum, acc)``
per query head, which the caller folds together with the residual tokens kept in the model's dtype.

On CPU (Triton's interpreter: tests) it runs as on a GPU, slowly. Imports triton at import time: go
through :func:`kvtrim.attention.lowbit.lowbit_decode_attention` (``backend="triton"``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lowbit_decode_fwd(
    Q, KC, KG, KT, VC, VS, VZ, BIAS, RI, RT, LOGITS, M_OUT, L_OUT, ACC,
    s_kc_bh, s_kc_t, s_kg_bh, s_vc_bh, s_vc_t, s_vs_bh, s_vz_bh, s_bias_bh, s_ri_bh, s_log_row,
    SQ, NG, G, F, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    bh = tl.program_id(0)
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < G
    offs_d = tl.arange(0, HEAD_DIM)
    offs_v = tl.arange(0, V_DIM)
    q = tl.load(Q + (bh * G + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    k_shift = ((offs_d % PER) * BITS)[None, :]
    v_shift = ((offs_v % PER) * BITS)[None, :]
    table = KT + bh * NG * (2 * HEAD_DIM)
    if HAS_ROT:  # each dim's rotary partner, the sign it enters with, and its frequency (kvtrim.rope)
        rotary = offs_d < 2 * F
        if INTERLEAVED:
            partner = tl.where(rotary, offs_d ^ 1, offs_d)
            sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
            fi = offs_d // 2
        else:
            partner = tl.where(offs_d < F, offs_d + F, tl.where(rotary, offs_d - F, offs_d))
            sign = tl.where(offs_d < F, -1.0, 1.0)
            fi = offs_d % F
        p_shift = ((partner % PER) * BITS)[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM], tl.float32)
    for start in range(0, SQ, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        ok = offs_n < SQ
        byte = tl.load(KC + bh * s_kc_bh + offs_n[:, None] * s_kc_t + (offs_d // PER)[None, :], mask=ok[:, None], other=0)
        code = ((byte.to(tl.int32) >> k_shift) & MASK).to(tl.float32)
        gid = tl.load(KG + bh * s_kg_bh + offs_n, mask=ok, other=0)
        row = table + gid[:, None] * (2 * HEAD_DIM) + offs_d[None, :]
        k = code * tl.load(row, mask=ok[:, None], other=0.0) + tl.load(row + HEAD_DIM, mask=ok[:, None], other=0.0)
        if HAS_ROT:  # a key turned since it was packed: x * cos + partner(x) * sin, by its slot's table row
            pbyte = tl.load(KC + bh * s_kc_bh + offs_n[:, None] * s_kc_t + (partner // PER)[None, :], mask=ok[:, None],
                            other=0)
            pcode = ((pbyte.to(tl.int32) >> p_shift) & MASK).to(tl.float32)
            prow = table + gid[:, None] * (2 * HEAD_DIM) + partner[None, :]
            kp = pcode * tl.load(prow, mask=ok[:, None], other=0.0) + tl.load(prow + HEAD_DIM, mask=ok[:, None], other=0.0)
            ri = tl.load(RI + bh * s_ri_bh + offs_n, mask=ok, other=-1)
            turn = (ri >= 0)[:, None] & rotary[None, :]
            cs = RT + (tl.maximum(ri, 0)[:, None] * F + fi[None, :]) * 2
            cos = tl.load(cs, mask=turn, other=1.0)
            sin = tl.load(cs + 1, mask=turn, other=0.0)
            k = k * cos + sign[None, :] * kp * sin
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        if HAS_BIAS:
            qk += tl.load(BIAS + bh * s_bias_bh + offs_n, mask=ok, other=0.0).to(tl.float32)[None, :]
        qk = tl.where(ok[None, :], qk, float("-inf"))
        tl.store(LOGITS + (bh * G + offs_m[:, None]) * s_log_row + offs_n[None, :], qk, mask=row_ok[:, None] & ok[None, :])
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vbyte = tl.load(VC + bh * s_vc_bh + offs_n[:, None] * s_vc_t + (offs_v // PER)[None, :], mask=ok[:, None], other=0)
        vcode = ((vbyte.to(tl.int32) >> v_shift) & MASK).to(tl.float32)
        vs = tl.load(VS + bh * s_vs_bh + offs_n, mask=ok, other=0.0).to(tl.float32)
        vz = tl.load(VZ + bh * s_vz_bh + offs_n, mask=ok, other=0.0).to(tl.float32)
        v = vcode * vs[:, None] + vz[:, None]
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    tl.store(M_OUT + bh * G + offs_m, m_i, mask=row_ok)
    tl.store(L_OUT + bh * G + offs_m, l_i, mask=row_ok)
    tl.store(ACC + (bh * G + offs_m[:, None]) * V_DIM + offs_v[None, :], acc, mask=row_ok[:, None])


def lowbit_decode_triton(query: torch.Tensor, kv, logits: torch.Tensor, scaling: float,
                         bias: torch.Tensor | None = None, rotation=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantized slots' part of a decode step: ``query [B, Hq, 1, D]``, ``kv`` a ``LowBitKV`` of
    ``lq >= 1`` slots; writes ``logits[..., :lq]`` (``[B, Hkv, G, S]`` float32, contiguous) and returns
    the softmax state ``(max [B, Hkv, G, 1], sum [B, Hkv, G, 1], acc [B, Hkv, G, Dv])`` in float32.
    ``rotation``: a ``kvtrim.attention.lowbit.KeyRotation`` (keys turned since they were packed) or
    None. ``D`` and ``Dv`` must be powers of two >= 16."""
    b, hq, _, d = query.shape
    hkv = kv.key_codes.shape[1]
    g = hq // hkv
    dv = kv.value_codes.shape[-1] * 8 // kv.bits
    lq = kv.length
    for name, x in (("head_dim", d), ("value head_dim", dv)):
        if x & (x - 1) or x < 16:
            raise ValueError(f"{name} must be a power of two >= 16 for the Triton kernel; got {x}")
    if lq < 1 or not logits.is_contiguous():
        raise ValueError("the Triton kernel needs at least one quantized slot and contiguous logits")
    dev = query.device
    q = query.reshape(b * hkv, g, d).contiguous()
    kc, kg = kv.key_codes.contiguous(), kv.key_group.contiguous()
    vc, vs, vz = kv.value_codes.contiguous(), kv.value_scale.contiguous(), kv.value_zero.contiguous()
    table = kv.key_table().contiguous()
    m = torch.empty(b, hkv, g, 1, dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    acc = torch.empty(b, hkv, g, dv, dtype=torch.float32, device=dev)
    bias_t = bias.contiguous() if bias is not None else m  # a placeholder pointer when there is no bias
    if rotation is not None:
        r_index, r_table, n_freq = rotation.index.contiguous(), rotation.table.contiguous(), rotation.table.shape[1]
    else:
        r_index, r_table, n_freq = kg, m, 0  # placeholders
    _lowbit_decode_fwd[(b * hkv,)](
        q, kc, kg, table, vc, vs, vz, bias_t, r_index, r_table, logits, m, lsum, acc,
        kc.shape[2] * kc.shape[3], kc.shape[3], kg.shape[2], vc.shape[2] * vc.shape[3], vc.shape[3],
        vs.shape[2], vz.shape[2], bias_t.shape[-1] if bias is not None else 0, r_index.shape[-1], logits.shape[-1],
        lq, kv.key_scale.shape[2], g, n_freq, scaling,
        BLOCK_M=max(16, triton.next_power_of_2(g)), BLOCK_N=64, HEAD_DIM=d, V_DIM=dv, BITS=kv.bits,
        HAS_BIAS=bias is not None, HAS_ROT=rotation is not None,
        INTERLEAVED=bool(rotation is not None and rotation.interleaved),
    )
    return m, lsum, acc
