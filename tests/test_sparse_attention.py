"""Sparse prefill (MInference): every fast path against the explicit-mask reference.

Tolerance rule (docs/style.md): with a float64 reference computed from the same (rounded) inputs, the
fast result's max abs error is at most twice the error of the plain PyTorch version in the same
dtype (``masked_attention(..., upcast=False)``: matmuls in that dtype, softmax in float32).
Float32 errors sit near 1e-7 where the two orders of summation differ by chance, so the float32
bound gets an absolute floor of 4 float32 ulps of 1.0 (measured: both errors 2-9e-7 at T<=4001).
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrim.attention import (
    AShape,
    BlockSparse,
    VerticalSlash,
    dense_attention,
    dense_layout,
    layout_from_block_mask,
    layout_to_mask,
    masked_attention,
    sparse_attention_cpu,
    vertical_slash_layout,
)
from kvtrim.attention.cpu import sparse_attention_heads
from kvtrim.attention.native import load_native
from kvtrim.attention.triton import triton_available

PATTERNS_SMALL = {  # sparse already at T=500
    "a_shape": AShape(n_init=37, n_local=150),
    "vertical_slash": VerticalSlash(k_v=40, k_s=60),
    "block_sparse": BlockSparse(k_b=3),
}
PATTERNS_4001 = {
    "a_shape": AShape(n_init=100, n_local=700),
    "vertical_slash": VerticalSlash(k_v=200, k_s=110),  # random data scatters slashes: keep few
    "block_sparse": BlockSparse(k_b=8),
}
GQA = [(3, 1), (8, 2)]  # 3:1 and 4:1


def _qkv(t: int, d: int, hq: int, hkv: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, t, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v


def _assert_within_rule(fast: torch.Tensor, q, k, v, mask: torch.Tensor | None, ulps_of_max: int = 0) -> None:
    """The tolerance rule above; ``ulps_of_max`` raises the float32 floor to that many float32 ulps
    of the largest reference output (used only by the property test, see there)."""
    ref = masked_attention(q.double(), k.double(), v.double(), mask)
    plain = masked_attention(q, k, v, mask, upcast=False)
    err_fast = (fast.double() - ref).abs().max().item()
    err_plain = (plain.double() - ref).abs().max().item()
    floor = 0.0
    if q.dtype == torch.float32:
        eps = torch.finfo(torch.float32).eps
        floor = max(4 * eps, ulps_of_max * eps * ref.abs().max().item())
    assert err_fast <= max(2 * err_plain, floor), f"fast error {err_fast:.3g} > 2 x plain error {err_plain:.3g}"


# ---- CPU fast paths: the native C++ kernel and the PyTorch one --------------------------------
#
# The native kernel is built on first use (a C++ compiler and ninja, ~15 s once per machine;
# later runs load it from torch's extension cache). Where a compiler exists, failing to build it is a test failure,
# not a skip: only a machine without any C++ compiler skips the native cases.

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
KERNELS = [pytest.param("native", marks=pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")), "torch"]


def test_native_kernel_builds_where_a_compiler_exists() -> None:
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    assert load_native(), "kvtrim's native CPU kernel did not build (see the warning in the log)"


def test_native_build_name_is_one_per_install(tmp_path) -> None:
    """Two checkouts (or two torch installs) get two build directories, so neither rebuilds the
    other's kernel when they alternate; the same install always gets the same name."""
    from kvtrim.attention.native import _build_name

    a, b = tmp_path / "one" / "csrc", tmp_path / "two" / "csrc"
    assert _build_name(a, "/t") == _build_name(a, "/t")
    assert _build_name(a, "/t") != _build_name(b, "/t")
    assert _build_name(a, "/t") != _build_name(a, "/u")
    assert _build_name().startswith(f"kvtrim_native_{torch.backends.cpu.get_cpu_capability().lower()}_")
    assert _build_name().replace("_", "").isalnum()


@pytest.mark.parametrize("name", list(PATTERNS_SMALL))
@pytest.mark.parametrize("t", [63, 500])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("kernel", KERNELS)
def test_cpu_matches_reference(name: str, t: int, d: int, hq: int, hkv: int, kernel: str) -> None:
    q, k, v = _qkv(t, d, hq, hkv)
    layout = PATTERNS_SMALL[name].layout(q, k)
    _assert_within_rule(sparse_attention_cpu(q, k, v, layout, kernel=kernel), q, k, v, layout_to_mask(layout))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(PATTERNS_SMALL))
@pytest.mark.parametrize("kernel", KERNELS)
def test_cpu_low_precision(name: str, dtype: torch.dtype, kernel: str) -> None:
    q, k, v = _qkv(500, 64, 8, 2, dtype)
    layout = PATTERNS_SMALL[name].layout(q, k)
    out = sparse_attention_cpu(q, k, v, layout, kernel=kernel)
    assert out.dtype == dtype
    _assert_within_rule(out, q, k, v, layout_to_mask(layout))


@pytest.mark.parametrize("name", list(PATTERNS_4001))
@pytest.mark.parametrize("kernel", KERNELS)
def test_cpu_matches_reference_4001(name: str, kernel: str) -> None:
    q, k, v = _qkv(4001, 64, 3, 1, seed=1)
    layout = PATTERNS_4001[name].layout(q, k)
    assert layout.density() < 0.6, "the long case must actually be sparse"
    _assert_within_rule(sparse_attention_cpu(q, k, v, layout, kernel=kernel), q, k, v, layout_to_mask(layout))


@pytest.mark.parametrize("name", list(PATTERNS_4001))
@pytest.mark.parametrize("kernel", KERNELS)
def test_cpu_low_precision_4001(name: str, kernel: str) -> None:  # block_sparse with k_b 11: more than one segment
    """bfloat16 at a length where a query block lists more key blocks than one segment holds, not
    all of them neighbours (the native kernel's packed path groups them), and the last block is partial."""
    q, k, v = _qkv(4001, 64, 3, 1, torch.bfloat16, seed=4)
    layout = (BlockSparse(k_b=11) if name == "block_sparse" else PATTERNS_4001[name]).layout(q, k)
    assert int(layout.block_cnt.max()) > 8
    out = sparse_attention_cpu(q, k, v, layout, kernel=kernel)
    assert out.dtype == torch.bfloat16
    _assert_within_rule(out, q, k, v, layout_to_mask(layout))


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("groups", ["1", "0"])
def test_query_groups_switch(groups: str, monkeypatch) -> None:
    """``KVTRIM_NATIVE_QUERY_GROUPS=0`` (one query block per task, read on every call) and the
    default both pass the rule on an A-shape layout in bfloat16 (windows cut through the groups)."""
    monkeypatch.setenv("KVTRIM_NATIVE_QUERY_GROUPS", groups)
    q, k, v = _qkv(1500, 64, 4, 2, torch.bfloat16, seed=5)
    layout = AShape(n_init=70, n_local=300).layout(q, k)
    _assert_within_rule(sparse_attention_cpu(q, k, v, layout, kernel="native"), q, k, v, layout_to_mask(layout))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PATTERNS_4001))
@pytest.mark.parametrize("kernel", KERNELS)
def test_cpu_matches_reference_4001_d128_gqa4(name: str, kernel: str) -> None:
    q, k, v = _qkv(4001, 128, 4, 1, seed=2)
    layout = PATTERNS_4001[name].layout(q, k)
    _assert_within_rule(sparse_attention_cpu(q, k, v, layout, kernel=kernel), q, k, v, layout_to_mask(layout))


@pytest.mark.parametrize("t", [63, 500, 4001])
@pytest.mark.parametrize("kernel", KERNELS)
def test_all_blocks_selected_equals_dense(t: int, kernel: str) -> None:
    q, k, v = _qkv(t, 64, 3, 1)
    out = sparse_attention_cpu(q, k, v, dense_layout(1, 3, t), kernel=kernel)
    _assert_within_rule(out, q, k, v, None)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", [VerticalSlash(k_v=500, k_s=500), BlockSparse(k_b=8), AShape(n_init=1, n_local=500)])
@pytest.mark.parametrize("kernel", KERNELS)
def test_full_budget_patterns_are_dense(pattern, kernel: str) -> None:
    q, k, v = _qkv(500, 64, 8, 2)
    layout = pattern.layout(q, k)
    assert bool(layout_to_mask(layout).all(dim=0).all(dim=0).equal(torch.ones(500, 500, dtype=torch.bool).tril()))
    torch.testing.assert_close(sparse_attention_cpu(q, k, v, layout, kernel=kernel), dense_attention(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_mixed_heads_in_one_call_match_the_reference(kernel: str) -> None:
    """One layer's sparse heads, each with its own pattern (A-shape windows differ), in one call."""
    q, k, v = _qkv(777, 64, 8, 2, seed=3)
    pats = [AShape(n_init=20, n_local=150), VerticalSlash(k_v=40, k_s=60), BlockSparse(k_b=3),
            AShape(n_init=64, n_local=300), None, VerticalSlash(k_v=100, k_s=30), BlockSparse(k_b=5), None]
    heads = [h for h, p in enumerate(pats) if p is not None]
    lays = [pats[h].layout(q[:, h : h + 1], k[:, h // 4 : h // 4 + 1]) for h in heads]
    out = sparse_attention_heads(q, k, v, heads, lays, kernel=kernel)
    assert out.shape == (len(heads), 777, 64)
    for row, (h, lay) in enumerate(zip(heads, lays)):
        qh, kh, vh = q[:, h : h + 1], k[:, h // 4 : h // 4 + 1], v[:, h // 4 : h // 4 + 1]
        _assert_within_rule(out[row][None, None], qh, kh, vh, layout_to_mask(lay))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_written_in_place_through_strides(kernel: str, dtype: torch.dtype) -> None:
    """As the prefill hook calls it: q and ``out`` are [B, Hq, T, D] views of [B, T, Hq, D] buffers,
    k/v views of [B, T, Hkv, D] ones. Only the listed heads of ``out`` are written (the others keep
    their values), rows with no visible key become zeros, and the result equals the reference."""
    t, d, hq, hkv = 301, 64, 6, 2
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, t, hq, d, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(1, t, hkv, d, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    assert not q.is_contiguous() and not k.is_contiguous()
    out = torch.full((1, t, hq, d), float("nan"), dtype=dtype).transpose(1, 2)
    n = math.ceil(t / 64)
    bm = torch.ones(1, 1, n, n, dtype=torch.bool).tril()
    bm[0, 0, 2] = False  # query block 2 sees nothing: its rows must be written as zeros
    pats = {1: BlockSparse(k_b=2), 2: AShape(n_init=10, n_local=70), 4: None, 5: VerticalSlash(k_v=20, k_s=30)}
    lays = {h: (p.layout(q[:, h : h + 1], k[:, h // 3 : h // 3 + 1]) if p else layout_from_block_mask(bm, t))
            for h, p in pats.items()}
    heads = sorted(lays)
    res = sparse_attention_heads(q, k, v, heads, [lays[h] for h in heads], kernel=kernel, out=out)
    assert res is out
    for h in range(hq):
        if h not in lays:
            assert bool(out[0, h].isnan().all()), f"head {h} was not listed but was written"
            continue
        assert not bool(out[0, h].isnan().any())
        qh, kh, vh = (x[:, i : i + 1].contiguous() for x, i in ((q, h), (k, h // 3), (v, h // 3)))
        _assert_within_rule(out[:, h : h + 1], qh, kh, vh, layout_to_mask(lays[h]))
    assert bool((out[0, 4, 128:192] == 0).all())


def test_output_buffers_that_alias_or_overlap_are_not_written_by_the_kernel() -> None:
    """An ``out`` that is q itself, or overlaps itself, gets the result copied in (never a racing
    in-place write), and the low-level call refuses it outright."""
    from kvtrim.attention.native import native_sparse_attention, writable_in_place

    q, k, v = _qkv(200, 64, 4, 2, seed=5)
    assert writable_in_place(torch.empty(1, 200, 4, 64).transpose(1, 2))
    assert not writable_in_place(torch.empty(1, 1, 200, 64).expand(1, 4, 200, 64))  # heads share memory
    assert not writable_in_place(q, q) and not writable_in_place(q.double())
    lay = BlockSparse(k_b=2).layout(q, k)
    heads = [0, 1, 2, 3]
    rows = [lay.head(0, h) for h in heads]
    want = sparse_attention_heads(q, k, v, heads, rows)
    q_alias = q.clone()
    got = sparse_attention_heads(q_alias, k, v, heads, rows, out=q_alias)  # out is q
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)
    if load_native():
        with pytest.raises(ValueError, match="must not share memory"):
            native_sparse_attention(q[0], k[0], v[0], heads, [0, 0, 1, 1], lay.block_idx[0], lay.block_cnt[0],
                                    lay.col_idx[0], lay.col_cnt[0], [-1] * 4, [-1] * 4, 0.125, out=q[0])


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_takes_flat_layouts_without_padding(dtype: torch.dtype) -> None:
    """The flat layout (each row's entries only, one after another) gives exactly the padded
    layout's output, for heads of very different widths; a flat list shorter than its counts, or
    an index out of range in it, is refused before anything is read."""
    from kvtrim.attention.native import native_sparse_attention

    q, k, v = _qkv(500, 64, 4, 2, seed=9)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    wide = VerticalSlash(k_v=300, k_s=4).layout(q[:, :1], k[:, :1])  # hundreds of single columns per row
    narrow = BlockSparse(k_b=2).layout(q[:, 1:2], k[:, :1])
    lays = [wide, narrow, AShape(n_init=8, n_local=100).layout(q[:, 2:3], k[:, 1:2])]
    heads, head_kv = [0, 1, 2], [0, 0, 1]

    def padded(name: str) -> torch.Tensor:
        w = max(getattr(lay, name).shape[-1] for lay in lays)
        return torch.stack([torch.nn.functional.pad(getattr(lay, name)[0, 0], (0, w - getattr(lay, name).shape[-1])) for lay in lays])

    def flat(name: str, cnt: str) -> torch.Tensor:
        return torch.cat([getattr(lay, name)[0, 0][torch.arange(getattr(lay, name).shape[-1]) < getattr(lay, cnt)[0, 0][:, None]]
                          for lay in lays])

    cnts = {c: torch.stack([getattr(lay, c)[0, 0] for lay in lays]) for c in ("block_cnt", "col_cnt")}
    assert int(cnts["col_cnt"][0].max()) > 100 and int(cnts["col_cnt"][1].max()) == 0
    win = ([-1, -1, 8], [-1, -1, 100])
    want = native_sparse_attention(q[0], k[0], v[0], heads, head_kv, padded("block_idx"), cnts["block_cnt"],
                                   padded("col_idx"), cnts["col_cnt"], *win, 0.125)
    fb, fc = flat("block_idx", "block_cnt"), flat("col_idx", "col_cnt")
    assert fc.numel() == int(cnts["col_cnt"].sum())
    got = native_sparse_attention(q[0], k[0], v[0], heads, head_kv, fb, cnts["block_cnt"], fc, cnts["col_cnt"], *win, 0.125)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="shorter than its counts"):
        native_sparse_attention(q[0], k[0], v[0], heads, head_kv, fb, cnts["block_cnt"], fc[:-1], cnts["col_cnt"], *win, 0.125)
    bad = fc.clone()
    bad[0] = 499  # a column past its query block's last row
    with pytest.raises(RuntimeError, match="column index out of range"):
        native_sparse_attention(q[0], k[0], v[0], heads, head_kv, fb, cnts["block_cnt"], bad, cnts["col_cnt"], *win, 0.125)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 300), d=st.sampled_from([64, 128]), data=st.data())
def test_native_kernel_property(t: int, d: int, data) -> None:
    """Any causal set of blocks and columns (empty rows included) gives the reference's output."""
    n = math.ceil(t / 64)
    bm = torch.zeros(1, 2, n, n, dtype=torch.bool)
    for h in range(2):
        for qb in range(n):
            for kb in range(qb + 1):
                bm[0, h, qb, kb] = data.draw(st.booleans())
    lay = layout_from_block_mask(bm, t)
    cols = data.draw(st.lists(st.integers(0, t - 1), max_size=12))
    if cols:  # add single columns outside the listed blocks
        lay = _with_columns(lay, sorted(set(cols)))
    q, k, v = _qkv(t, d, 2, 1, seed=t)
    out = sparse_attention_cpu(q, k, v, lay, kernel="native")
    # Floor of 16 float32 ulps of the largest output, measured reason: these layouts give a row a
    # handful of keys, so the max error over the tensor is one unlucky float32 dot product, and
    # plain code differs from the kernel only in summation order. Two cases hypothesis found:
    # t=245, d=64, one key block + one column: kernel 1.38e-6, plain 4.8e-7, but plain's own
    # float32 softmax @ v over the key block alone errs 1.31e-6 at the same element (output 1.24,
    # 11 ulps); t=156, d=128: kernel 1.02e-6, plain 3.7e-7, and plain with the scale folded into
    # k (an equally plain ordering) exactly 1.02e-6. An indexing error (a key dropped, added or
    # read out of bounds) is orders of magnitude above this floor. The T = 63/500/4001 tests keep
    # the strict rule.
    _assert_within_rule(out, q, k, v, layout_to_mask(lay), ulps_of_max=16)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 1100), d=st.sampled_from([64, 128]), keep=st.floats(0.0, 1.0), windowed=st.booleans(),
       data=st.data())
def test_native_kernel_property_low_precision(t: int, d: int, keep: float, windowed: bool, data) -> None:
    """bfloat16 (on a CPU with AMX, the packed path, which takes up to 8 neighbouring query blocks
    per task: the key blocks all of them list in one product, then each block's own): any causal
    set of blocks (each kept with probability ``keep``, so neighbours share some and not others;
    with few kept, more single columns repeat across a group's query blocks),
    single columns and an A-shape window give the reference's output within the tolerance rule."""
    n = math.ceil(t / 64)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    bm = (torch.rand(1, 2, n, n, generator=g) < keep) & torch.ones(n, n, dtype=torch.bool).tril()
    lay = layout_from_block_mask(bm, t)
    cols = data.draw(st.lists(st.integers(0, t - 1), max_size=40))
    if cols:
        lay = _with_columns(lay, sorted(set(cols)))
    if windowed:
        lay = dataclasses.replace(lay, n_init=data.draw(st.integers(0, t)), n_local=data.draw(st.integers(1, t)))
    q, k, v = _qkv(t, d, 2, 1, torch.bfloat16, seed=t)
    out = sparse_attention_cpu(q, k, v, lay, kernel="native")
    assert out.dtype == torch.bfloat16
    _assert_within_rule(out, q, k, v, layout_to_mask(lay))


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("width", [0, 1, 37])
def test_flat_rows_takes_each_rows_entries_in_order(width: int) -> None:
    from kvtrim.attention.native import native_flat_rows

    g = torch.Generator().manual_seed(width)
    idx = torch.randint(0, 1000, (50, width), generator=g, dtype=torch.int32)
    cnt = torch.randint(0, width + 1, (50,), generator=g, dtype=torch.int32)
    want = torch.cat([idx[r, : cnt[r]] for r in range(50)])
    assert torch.equal(native_flat_rows(idx, cnt), want)
    if width:
        with pytest.raises(RuntimeError, match="count out of range"):
            native_flat_rows(idx, torch.full((50,), width + 1, dtype=torch.int32))


def _with_columns(lay, cols: list[int]):
    """Add key columns to every query block of a layout where they are causal and not in a listed block."""
    n, bs = lay.n_blocks, lay.block_size
    rows = []
    for h in range(lay.block_cnt.shape[1]):
        per = []
        for qb in range(n):
            blocks = set(lay.block_idx[0, h, qb, : lay.block_cnt[0, h, qb]].tolist())
            per.append([c for c in cols if c < min((qb + 1) * bs, lay.seq_len) and c // bs not in blocks])
        rows.append(per)
    width = max(1, max(len(p) for per in rows for p in per))
    col_idx = torch.zeros(1, len(rows), n, width, dtype=torch.int32)
    col_cnt = torch.zeros(1, len(rows), n, dtype=torch.int32)
    for h, per in enumerate(rows):
        for qb, p in enumerate(per):
            col_idx[0, h, qb, : len(p)] = torch.tensor(p, dtype=torch.int32)
            col_cnt[0, h, qb] = len(p)
    return type(lay)(bs, lay.seq_len, lay.block_idx, lay.block_cnt, col_idx, col_cnt)


def test_cpu_kernel_choice_is_validated(monkeypatch) -> None:
    q, k, v = _qkv(70, 64, 3, 1)
    lay = dense_layout(1, 3, 70)
    with pytest.raises(ValueError, match="kernel must be"):
        sparse_attention_cpu(q, k, v, lay, kernel="fast")
    monkeypatch.setenv("KVTRIM_CPU_KERNEL", "fastest")
    with pytest.raises(ValueError, match="KVTRIM_CPU_KERNEL"):
        sparse_attention_cpu(q, k, v, lay)
    monkeypatch.setenv("KVTRIM_CPU_KERNEL", "torch")
    from kvtrim.attention.native import cpu_kernel

    assert cpu_kernel() == "torch"


# ---- index estimation ------------------------------------------------------------------------


def test_vertical_slash_estimate_is_top_k() -> None:
    q, k, _ = _qkv(700, 64, 6, 2)
    vs = VerticalSlash(k_v=45, k_s=120)
    v_idx, s_idx = vs.estimate(q, k)
    # brute force in float64: last 64 queries, causal corner, per query head against KV head h // G
    t, lq, scale = 700, 64, 64**-0.5
    kk = k.double().repeat_interleave(3, dim=1)  # fine in a test oracle
    s = q.double()[:, :, t - lq :] @ kk.transpose(-1, -2) * scale
    i, j = torch.arange(t - lq, t)[:, None], torch.arange(t)[None, :]
    p = s.masked_fill(j > i, float("-inf")).softmax(-1)
    col = p.sum(-2)
    diag = torch.zeros(1, 6, t, dtype=torch.float64).scatter_add_(-1, (i - j).clamp(min=0).reshape(1, 1, -1).expand(1, 6, -1), p.reshape(1, 6, -1))
    for idx, score, n_forced, n in ((v_idx, col, 30, 45), (s_idx, diag, 100, 120)):
        assert idx.shape[-1] == n
        for h in range(6):
            chosen = set(idx[0, h].tolist())
            assert set(range(n_forced)) <= chosen
            rest = score[0, h].clone()
            rest[:n_forced] = float("-inf")
            picked = sorted(chosen - set(range(n_forced)))
            others = [x for x in range(n_forced, t) if x not in chosen]
            assert rest[picked].min() >= rest[others].max() - 1e-6


def test_block_sparse_keeps_top_k_and_diagonal() -> None:
    q, k, _ = _qkv(1000, 64, 3, 1)
    layout = BlockSparse(k_b=5).layout(q, k)
    n = math.ceil(1000 / 64)
    for qb in range(n):
        blocks = layout.block_idx[0, 0, qb, : layout.block_cnt[0, 0, qb]].tolist()
        assert len(blocks) == min(5, qb + 1) and qb in blocks and max(blocks) <= qb


def test_sizes_are_validated() -> None:
    for bad in (lambda: VerticalSlash(k_v=0), lambda: VerticalSlash(k_s=-3), lambda: VerticalSlash(last_q=0),
                lambda: BlockSparse(k_b=0), lambda: AShape(n_init=0), lambda: AShape(n_local=-1), lambda: BlockSparse(block_size=0)):
        with pytest.raises(ValueError, match="positive integer"):
            bad()
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        vertical_slash_layout(torch.tensor([[[3, 10]]]), torch.tensor([[[0]]]), seq_len=10)


def test_minimum_sizes_and_clamp_to_t() -> None:
    q, k, _ = _qkv(80, 64, 3, 1)
    v_idx, s_idx = VerticalSlash(k_v=1, k_s=1).estimate(q, k)
    assert v_idx.shape[-1] == 30 and s_idx.shape[-1] == 50  # raised to the minimum
    v_idx, s_idx = VerticalSlash(k_v=1000, k_s=6096).estimate(q, k)
    assert v_idx.shape[-1] == 80 and s_idx.shape[-1] == 80  # clamped to T


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(1, 200),
    bs=st.sampled_from([16, 64]),
    data=st.data(),
)
def test_vertical_slash_layout_property(t: int, bs: int, data) -> None:
    """Never drops a vertical or slash, never lists an index out of bounds, lists nothing extra."""
    verts = data.draw(st.lists(st.integers(0, t - 1), max_size=40))
    slashes = data.draw(st.lists(st.integers(0, t - 1), max_size=40))  # may lie far from the diagonal
    vt, st_ = torch.tensor(verts, dtype=torch.long).view(1, 1, -1), torch.tensor(slashes, dtype=torch.long).view(1, 1, -1)
    lay = vertical_slash_layout(vt, st_, t, bs, native=False)
    if HAS_COMPILER:  # the C++ builder must give exactly the same layout
        fast = vertical_slash_layout(vt, st_, t, bs, native=True)
        for name in ("block_idx", "block_cnt", "col_idx", "col_cnt"):
            assert torch.equal(getattr(fast, name), getattr(lay, name)), name
    n = math.ceil(t / bs)
    assert lay.block_idx.shape[:3] == (1, 1, n) and lay.col_idx.shape[:3] == (1, 1, n)
    for qb in range(n):
        qs, qe = qb * bs, min(qb * bs + bs, t)
        blocks = lay.block_idx[0, 0, qb, : lay.block_cnt[0, 0, qb]].tolist()
        cols = lay.col_idx[0, 0, qb, : lay.col_cnt[0, 0, qb]].tolist()
        assert all(0 <= b <= qb for b in blocks) and blocks == sorted(set(blocks))
        assert all(0 <= c < qe for c in cols) and cols == sorted(set(cols))
        want_blocks = {(i - o) // bs for o in slashes for i in range(qs, qe) if i - o >= 0}
        assert set(blocks) == want_blocks
        assert set(cols) == {j for j in verts if j < qe and j // bs not in want_blocks}
    mask = layout_to_mask(lay)[0, 0]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    exact = torch.zeros(t, t, dtype=torch.bool)
    for c in verts:
        exact |= (j == c) & (i >= c)
    for o in slashes:
        exact |= i - j == o
    assert not bool((exact & ~mask).any()), "a selected vertical or slash is missing"


# ---- Triton kernel, interpreter on CPU (float16) ----------------------------------------------

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _interpreter_effective() -> bool:
    """On CPU the kernels need triton imported *after* TRITON_INTERPRET=1 (set in conftest.py)."""
    if torch.cuda.is_available():
        return True
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.zeros, InterpretedFunction)


@pytest.fixture(scope="module")
def triton_interp():
    """The kernel module; on CPU it runs in Triton's interpreter."""
    from kvtrim.attention.triton import kernels

    assert _interpreter_effective(), "triton was imported before TRITON_INTERPRET=1 was set (see tests/conftest.py)"
    return kernels


@needs_triton
@pytest.mark.parametrize("name", list(PATTERNS_SMALL))
@pytest.mark.parametrize("t", [63, 500])  # the interpreter runs ~0.5 s per call at T=500; 4001 is slow-tier
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", GQA)
def test_triton_matches_reference(triton_interp, name: str, t: int, d: int, hq: int, hkv: int) -> None:
    q, k, v = _qkv(t, d, hq, hkv, torch.float16)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layout = PATTERNS_SMALL[name].layout(q, k)
    if name == "vertical_slash" and t == 500:
        assert int(layout.col_cnt.sum()) > 0, "the column path must be exercised"
    out = triton_interp.sparse_attention_triton(q.to(dev), k.to(dev), v.to(dev), layout).cpu()
    _assert_within_rule(out, q, k, v, layout_to_mask(layout))


@needs_triton
@pytest.mark.parametrize("t", [63, 500])
def test_triton_all_blocks_equals_dense(triton_interp, t: int) -> None:
    q, k, v = _qkv(t, 64, 8, 2, torch.float16)
    out = triton_interp.sparse_attention_triton(q, k, v, dense_layout(1, 8, t))
    _assert_within_rule(out, q, k, v, None)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("name", list(PATTERNS_4001))
def test_triton_matches_reference_4001(triton_interp, name: str) -> None:
    q, k, v = _qkv(4001, 64, 3, 1, torch.float16, seed=3)
    layout = PATTERNS_4001[name].layout(q, k)
    out = triton_interp.sparse_attention_triton(q, k, v, layout)
    _assert_within_rule(out, q, k, v, layout_to_mask(layout))
