"""Fused scoring: the prefill attention also returns the scores a method reads (``kvtrim.attention.fused``).

The native kernel against the plain references (output under the tolerance rule of style.md; column
sums and window rows against ``kvtrim.scores`` within float32 rounding), and, inside a tiny random
model, every method that asks for prompt scores keeps exactly the tokens it keeps with SDPA plus
recomputation (``attach(..., fused_scores="never")``), with the fused kernel really used.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from conftest import load_benchmark, tiny_llama

import kvtrim
import kvtrim.integrations.hf as hf
from kvtrim import harness
from kvtrim.attention.fused import causal_attention_scores, causal_attention_scores_reference, fused_backend
from kvtrim.cache import KVTrimCache
from kvtrim.registry import create_policy
from kvtrim.scores import causal_column_sums, window_probs

native = pytest.mark.skipif(fused_backend(torch.zeros(1)) is None, reason="kvtrim's native CPU kernel is not available")


def sdpa_error(q, k, v, scale, ref):
    """Max abs error of PyTorch's SDPA in q's dtype against ``ref`` ([B, Tq, Hq, D])."""
    tq, s = q.shape[-2], k.shape[-2]
    mask = torch.ones(tq, s, dtype=torch.bool).tril(s - tq)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)
    return (out.double() - ref).abs().max()


@native
@pytest.mark.parametrize("n_kv,groups,tq,s,d", [(2, 3, 63, 63, 64), (1, 4, 500, 500, 128), (3, 3, 37, 101, 64),
                                                (2, 4, 1, 9, 64), (1, 3, 4001, 4001, 64)])
def test_native_matches_references(n_kv, groups, tq, s, d):
    g = torch.Generator().manual_seed(tq + s + d)
    q = torch.randn(1, n_kv * groups, tq, d, generator=g)
    k, v = torch.randn(1, n_kv, s, d, generator=g), torch.randn(1, n_kv, s, d, generator=g)
    scale = d ** -0.5
    got = causal_attention_scores(q, k, v, scale, column_sums=True, window=32, column_max=True)
    if tq * s <= 500 * 500:
        ref = causal_attention_scores_reference(q.double(), k.double(), v.double(), scale, window=32, column_max=True)
        ref_out, ref_max = ref.out, ref.col_max
        assert torch.allclose(ref.col_sums.double(), causal_column_sums(q.double(), k.double(), scale).flatten(1, 2).double())
    else:  # the reference would hold [Tq, S] per head: SDPA in float64 for the output, column maxima by row blocks
        mask = torch.ones(tq, s, dtype=torch.bool).tril(s - tq)
        ref_out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                                 enable_gqa=True).transpose(1, 2)
        kk = k.double().repeat_interleave(groups, 1)
        ref_max = torch.zeros(1, n_kv * groups, s, dtype=torch.float64)
        for r0 in range(0, tq, 500):
            logits = (q[:, :, r0:r0 + 500].double() @ kk.transpose(-1, -2)) * scale
            probs = torch.softmax(logits.masked_fill(~mask[r0:r0 + 500], float("-inf")), dim=-1)
            ref_max = torch.maximum(ref_max, probs.amax(dim=-2))
    assert got.out.shape == (1, tq, n_kv * groups, d) and got.out.dtype == q.dtype
    err = (got.out.double() - ref_out).abs().max()
    assert err <= 2 * sdpa_error(q, k, v, scale, ref_out), float(err)
    want_cols = causal_column_sums(q, k, scale).flatten(1, 2)
    torch.testing.assert_close(got.col_sums, want_cols, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.window_probs, window_probs(q, k, scale, 32).flatten(1, 2), rtol=1e-5, atol=1e-6)
    assert got.col_max.dtype == torch.float32 and got.col_max.shape == (1, n_kv * groups, s)
    torch.testing.assert_close(got.col_max.double(), ref_max.double(), rtol=1e-5, atol=1e-6)
    # asked for alone, the maxima are the same numbers (no other score shares the pass)
    alone = causal_attention_scores(q, k, v, scale, column_sums=False, column_max=True)
    assert alone.col_sums is None and alone.window_probs is None and torch.equal(alone.col_max, got.col_max)


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_low_precision(dtype):
    """bf16/fp16 inputs: output error against float64 at most twice SDPA's in that dtype; scores float32."""
    g = torch.Generator().manual_seed(3)
    q32 = torch.randn(1, 6, 300, 64, generator=g)
    k32, v32 = torch.randn(1, 2, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g)
    q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
    got = causal_attention_scores(q, k, v, 0.125, column_sums=True, window=8, column_max=True)
    ref = causal_attention_scores_reference(q.double(), k.double(), v.double(), 0.125, window=8, column_max=True)
    assert got.out.dtype == dtype and got.col_sums.dtype == got.window_probs.dtype == got.col_max.dtype == torch.float32
    torch.testing.assert_close(got.col_max.double(), ref.col_max.double(), rtol=1e-5, atol=1e-6)
    assert (got.out.double() - ref.out).abs().max() <= 2 * sdpa_error(q, k, v, 0.125, ref.out)
    torch.testing.assert_close(got.col_sums.double(), ref.col_sums.double(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.window_probs.double(), ref.window_probs.double(), rtol=1e-5, atol=1e-6)


def test_reference_rejects_bad_shapes():
    q = torch.zeros(1, 6, 10, 16)
    with pytest.raises(ValueError):
        causal_attention_scores_reference(q, torch.zeros(1, 4, 10, 16), torch.zeros(1, 4, 10, 16), 1.0)
    with pytest.raises(ValueError):
        causal_attention_scores_reference(q, torch.zeros(1, 2, 9, 16), torch.zeros(1, 2, 9, 16), 1.0)


METHODS = [("h2o", {}), ("elastic", {}), ("elastic", {"importance": "mean"}), ("elastic", {"importance": "query"}),
           ("elastic", {"eviction": "frequency"}), ("snapkv", {}), ("inf_mllm", {}), ("inf_mllm", {"history": 0.5})]


def prefill(model, ids, policy, fused):
    cache = KVTrimCache(model, policy)
    with torch.no_grad(), kvtrim.attach(model, fused_scores="always" if fused else "never"):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache, out.logits


@native
@pytest.mark.parametrize("groups", [3, 4])
@pytest.mark.parametrize("name,kw", METHODS)
def test_fused_prefill_keeps_what_recomputation_keeps(monkeypatch, name, kw, groups):
    model = tiny_llama(groups=groups, head_dim=64 if groups == 3 else 32)
    ids = torch.randint(3, 128, (1, 181), generator=torch.Generator().manual_seed(groups))
    calls = []
    real = hf.causal_attention_scores
    monkeypatch.setattr(hf, "causal_attention_scores", lambda *a, **k: calls.append(k) or real(*a, **k))
    fused, logits_f = prefill(model, ids, create_policy(name, keep=0.3, **kw), True)
    assert len(calls) == model.config.num_hidden_layers  # every layer's prefill attention was the fused one
    plain, logits_p = prefill(model, ids, create_policy(name, keep=0.3, **kw), False)
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(logits_f, logits_p, rtol=1e-4, atol=1e-4)
    for a, b in zip(fused.compressed_layers, plain.compressed_layers):
        assert a.length == b.length < ids.shape[1]
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
        for state in a.token_state:  # H2O's accumulated scores, Elastic's importance (slots in use only)
            torch.testing.assert_close(a.state_view(state), b.state_view(state), rtol=1e-5, atol=1e-5)


def chunked_prefill(model, ids, policy, fused, chunk):
    """Feed ``ids`` in pieces of ``chunk`` (every piece after the first is a turn); the cache and
    every piece's logits."""
    cache, logits = KVTrimCache(model, policy), []
    with torch.no_grad(), kvtrim.attach(model, fused_scores="always" if fused else "never"):
        for s in range(0, ids.shape[1], chunk):
            logits.append(model(input_ids=ids[:, s:s + chunk], **cache.kwargs(), use_cache=True).logits)
    return cache, torch.cat(logits, dim=1)


@native
@pytest.mark.parametrize("name,kw", [("h2o", {}), ("elastic", {}), ("elastic", {"importance": "mean"}),
                                     ("elastic", {"proportional": True}), ("inf_mllm", {})])
def test_fused_later_chunks_keep_what_recomputation_keeps(monkeypatch, name, kw):
    """A chunked prefill: the later chunks (turns, a bottom-right causal mask over the kept keys
    and the chunk's own) get their attention and scores from the fused kernel too, and keep
    exactly what SDPA plus recomputation keeps. With ``proportional=True`` Elastic Cache's merged
    anchors carry a logit bias from its first merge on, which the kernel does not take: the chunks
    after that merge stay on SDPA."""
    model = tiny_llama()
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(7))
    shapes = []
    real = hf.causal_attention_scores
    monkeypatch.setattr(hf, "causal_attention_scores",
                        lambda q, k, *a, **kk: shapes.append((q.shape[-2], k.shape[-2])) or real(q, k, *a, **kk))
    fused, logits_f = chunked_prefill(model, ids, create_policy(name, keep=0.3, **kw), True, 40)
    later = [s for s in shapes if s[1] > s[0]]  # a turn's queries are the last of more keys
    n = model.config.num_hidden_layers
    assert len(shapes) - len(later) in (0, n)  # the first chunk: fused where it already compresses
    assert len(later) == (n if kw.get("proportional") else 3 * n)  # three later chunks, every layer
    count = len(shapes)
    plain, logits_p = chunked_prefill(model, ids, create_policy(name, keep=0.3, **kw), False, 40)
    assert len(shapes) == count
    torch.testing.assert_close(logits_f, logits_p, rtol=1e-4, atol=1e-4)
    for a, b in zip(fused.compressed_layers, plain.compressed_layers):
        assert a.length == b.length < ids.shape[1]
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
        for state in a.token_state:
            torch.testing.assert_close(a.state_view(state), b.state_view(state), rtol=1e-5, atol=1e-5)


def test_bottom_right_causal_check():
    """Only a boolean mask that is exactly bottom-right causal for (n, m) lets the kernel run."""
    mask = hf.causal_mask(3, 7, "cpu")
    assert hf._bottom_right_causal(mask, 3, 7)
    assert hf._bottom_right_causal(mask.expand(2, 1, 3, 7).clone(), 3, 7)
    padded = mask.expand(2, 1, 3, 7).clone()
    padded[1, :, :, 0] = False  # a left-padded second row
    assert not hf._bottom_right_causal(padded, 3, 7)
    assert not hf._bottom_right_causal(mask, 3, 8) and not hf._bottom_right_causal(None, 3, 7)
    assert not hf._bottom_right_causal(torch.zeros(1, 1, 3, 7), 3, 7)  # additive float masks: not taken
    assert not hf._bottom_right_causal(torch.ones(1, 1, 3, 7, dtype=torch.bool), 3, 7)  # sees the future


@native
@pytest.mark.parametrize("name", ["full", "streaming_llm", "h2o"])
def test_fused_path_only_when_asked(monkeypatch, model, prompt, name):
    """Methods that read no prompt scores keep SDPA; a budget that keeps everything asks for
    nothing; fused_scores="never" never fuses."""
    calls = []
    monkeypatch.setattr(hf, "causal_attention_scores", lambda *a, **k: calls.append(1) or causal_attention_scores(*a, **k))
    prefill(model, prompt, create_policy(name, **({} if name == "full" else {"keep": 0.5})), True)
    assert len(calls) == (model.config.num_hidden_layers if name == "h2o" else 0)
    calls.clear()
    prefill(model, prompt, create_policy("h2o", keep=0.5), False)
    for keep_all in ("h2o", "snapkv", "elastic", "inf_mllm"):  # keep=1.0: nothing is scored for eviction
        prefill(model, prompt, create_policy(keep_all, keep=1.0), True)
    assert not calls


@native
def test_fused_scores_survive_shared_memo(model, prompt):
    """With scores shared across budgets (share_prefill_scores), the fused sums are what is shared."""
    memo: dict = {}
    a = create_policy("h2o", keep=0.3).share_prefill_scores(memo)
    fused, _ = prefill(model, prompt, a, True)
    plain, _ = prefill(model, prompt, create_policy("h2o", keep=0.3), False)
    assert memo and all(torch.equal(x.positions, y.positions) for x, y in zip(fused.compressed_layers, plain.compressed_layers))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n_kv,groups,tq,s,d", [(2, 3, 63, 63, 64), (1, 4, 100, 130, 32)])
def test_triton_matches_references(dtype, n_kv, groups, tq, s, d):
    """The GPU kernel (Triton's interpreter on CPU): output under the tolerance rule, scores equal
    to the float32 references within rounding (its column sums are added atomically)."""
    from kvtrim.attention.triton import kernels  # noqa: F401 - triton imported after TRITON_INTERPRET (conftest)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(tq)
    q = torch.randn(1, n_kv * groups, tq, d, generator=g).to(dtype)
    k, v = torch.randn(1, n_kv, s, d, generator=g).to(dtype), torch.randn(1, n_kv, s, d, generator=g).to(dtype)
    scale = d ** -0.5
    got = causal_attention_scores(q.to(dev), k.to(dev), v.to(dev), scale, column_sums=True, window=16, backend="triton",
                                  column_max=True)
    ref = causal_attention_scores_reference(q.double(), k.double(), v.double(), scale, window=16, column_max=True)
    torch.testing.assert_close(got.col_max.cpu().double(), ref.col_max.double(), rtol=1e-5, atol=1e-5)
    assert (got.out.cpu().double() - ref.out).abs().max() <= 2 * sdpa_error(q, k, v, scale, ref.out)
    torch.testing.assert_close(got.col_sums.cpu().double(), ref.col_sums.double(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.window_probs.cpu().double(), ref.window_probs.double(), rtol=1e-5, atol=1e-5)


@native
@pytest.mark.model
def test_fused_prefill_keeps_what_recomputation_keeps_on_the_real_model(real):
    """The embedded model, a 600-token prompt: every scoring method keeps the same tokens per layer and head."""
    from kvtrim.data import prose_haystack
    from kvtrim.models import build_prompt_ids

    tok = real.tokenizer
    text = tok.decode(tok.encode(prose_haystack()[:4000], add_special_tokens=False)[:560])
    ids = torch.tensor([build_prompt_ids(tok, text + "\n\nSummarize the passage above.")])
    for name, kw in METHODS:
        fused, logits_f = prefill(real.model, ids, create_policy(name, keep=0.25, **kw), True)
        plain, logits_p = prefill(real.model, ids, create_policy(name, keep=0.25, **kw), False)
        torch.testing.assert_close(logits_f, logits_p, rtol=1e-4, atol=1e-4)
        for a, b in zip(fused.compressed_layers, plain.compressed_layers):
            assert torch.equal(a.positions, b.positions), (name, kw, a.layer_idx)


@native
def test_auto_fuses_column_sums_only(monkeypatch, model, prompt):
    """The default ("auto") fuses a column-sum request (H2O, Elastic Cache) and leaves a request
    for the last-window rows alone (SnapKV, Inf-MLLM) to SDPA plus their window x T recomputation;
    a bad choice is refused."""
    calls = []
    monkeypatch.setattr(hf, "causal_attention_scores", lambda *a, **k: calls.append(k) or causal_attention_scores(*a, **k))
    n = model.config.num_hidden_layers
    for name, fused in (("h2o", True), ("elastic", True), ("snapkv", False), ("inf_mllm", False)):
        calls.clear()
        with torch.no_grad(), kvtrim.attach(model):
            model(input_ids=prompt, past_key_values=KVTrimCache(model, name, keep=0.3), use_cache=True)
        assert len(calls) == (n if fused else 0), name
    with pytest.raises(kvtrim.KVTrimError, match="fused_scores"), kvtrim.attach(model, fused_scores="yes"):
        pass


@native
def test_recorded_forward_hands_its_column_sums_to_the_replays(monkeypatch, model, prompt):
    """Evaluation replay (kvtrim eval): ``record_prefill(column_sums=True)`` keeps the column sums the
    recorded forward's fused attention computed; a memo seeded with them (``Recording.score_memo``)
    spares every H2O / Elastic Cache replay the recomputation, and the replayed caches keep what
    recomputed sums keep."""
    import kvtrim.policies.base as base
    from kvtrim.eval.replay import make_policy, record_prefill, replay

    ids = prompt[0].tolist()
    rec = record_prefill(model, ids, column_sums=True)
    assert sorted(rec.column_sums) == sorted(rec.record)  # every layer's sums came from its attention
    for i, (q, k, _, scaling) in rec.record.items():
        torch.testing.assert_close(rec.column_sums[i], causal_column_sums(q, k, scaling), rtol=1e-5, atol=1e-5)
    assert record_prefill(model, ids).column_sums is None
    plain = {m: replay(model, make_policy(m, {"keep": 0.3}), rec) for m in ("h2o", "elastic")}
    real = base.causal_column_sums
    calls = []
    monkeypatch.setattr(base, "causal_column_sums", lambda *a: calls.append(1) or real(*a))
    memo = rec.score_memo()
    for m in ("h2o", "elastic"):
        seeded = replay(model, make_policy(m, {"keep": 0.3}, memo), rec)
        for a, b in zip(seeded.compressed_layers, plain[m].compressed_layers):
            assert torch.equal(a.positions, b.positions)
    assert not calls


@native
def test_bench_fused_kernel_records_every_configuration(tmp_path):
    """benchmarks/bench_fused_kernel.py: one JSON row per length with every configuration timed, a table from it."""
    bench = load_benchmark("bench_fused_kernel")
    out = tmp_path / "k.json"
    threads = torch.get_num_threads()  # the script sets torch's thread count: give the later tests theirs back
    try:
        assert bench.main(["--lengths", "64", "130", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
                           "--reps", "2", "--warmup", "0", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    res = harness.read_result(out)
    assert [r["length"] for r in res["rows"]] == [64, 130]
    for row in res["rows"]:
        assert set(row["median_seconds"]) == set(bench.CONFIGS)
        assert all(len(v) == 2 and min(v) > 0 for v in row["seconds"].values())
    text = bench.table(res)
    assert "| 130 |" in text and "column sums" in text


def test_bench_fused_scoring_table_marks_paths_not_run():
    """bench_fused_scoring.py --modes fused: the recompute cells say they were not run (no number
    invented), the fused ones come from the result."""
    bench = load_benchmark("bench_fused_scoring")
    med = {"full": 10.0, "h2o:fused": 10.4, "streaming_llm": 9.9}
    res = {"median_seconds": med, "ratio_to_full": {c: v / 10.0 for c, v in med.items()},
           "cpu_ratio_to_full": {c: v / 10.0 for c, v in med.items()}, "machine": {"loadavg_start": [0.5], "loadavg_end": [0.9]},
           "prompt_tokens": 100, "model": "m", "threads": 1, "dtype": "float32", "keep": 0.25, "reps": 1,
           "methods": ["h2o", "streaming_llm"], "target_ratio": 1.05}
    text = bench.table(res)
    assert "| h2o | (not run) | | | 10.40 | 1.040 | 1.040 |" in text
    assert "| streaming_llm | 9.90 | 0.990 | 0.990 | (no prompt scores) | | |" in text


def test_bench_fused_scoring_table_has_a_default_column_when_auto_ran():
    """--modes auto: a third column, each method's default path; methods without it say not run."""
    bench = load_benchmark("bench_fused_scoring")
    med = {"full": 10.0, "h2o:auto": 10.2, "snapkv:auto": 9.8, "snapkv:fused": 10.6, "streaming_llm": 9.9}
    res = {"median_seconds": med, "ratio_to_full": {c: v / 10.0 for c, v in med.items()},
           "cpu_ratio_to_full": {c: v / 10.0 for c, v in med.items()}, "machine": {"loadavg_start": [0.5], "loadavg_end": [0.9]},
           "prompt_tokens": 100, "model": "m", "threads": 1, "dtype": "float32", "keep": 0.25, "reps": 1,
           "methods": ["h2o", "snapkv", "streaming_llm"], "target_ratio": 1.05}
    text = bench.table(res)
    assert "default (auto): s" in text
    assert "| h2o | (not run) | | | (not run) | | | 10.20 | 1.020 | 1.020 |" in text
    assert "| snapkv | (not run) | | | 10.60 | 1.060 | 1.060 | 9.80 | 0.980 | 0.980 |" in text
    assert "| streaming_llm | 9.90 | 0.990 | 0.990 | (no prompt scores) | | | (no prompt scores) | | |" in text
    header, rule = text.splitlines()[2:4]
    assert header.count("|") == rule.count("|")  # a well-formed markdown table


def test_bench_fused_scoring_own_work_table_sets_each_method_against_the_full_cache():
    """The second table: attention + hook seconds, what a method adds over the full cache's, the
    rest of the forward, and the ratio with the rest held at the full cache's (both signs shown)."""
    bench = load_benchmark("bench_fused_scoring")
    med = {"full": 10.0, "h2o:auto": 11.0, "streaming_llm": 10.5}
    res = {"median_seconds": med, "ratio_to_full": {c: v / 10.0 for c, v in med.items()},
           "cpu_ratio_to_full": {c: v / 10.0 for c, v in med.items()}, "machine": {"loadavg_start": [0.5], "loadavg_end": [0.9]},
           "prompt_tokens": 100, "model": "m", "threads": 1, "dtype": "float32", "keep": 0.25, "reps": 1,
           "methods": ["h2o", "streaming_llm"], "target_ratio": 1.05,
           "median_attention_seconds": {"full": 3.0, "h2o:auto": 3.2, "streaming_llm": 2.9},
           "median_rest_seconds": {"full": 7.0, "h2o:auto": 7.8, "streaming_llm": 7.6},
           "median_minor_faults": {"full": 1200.0, "h2o:auto": 0.0, "streaming_llm": 5.0},
           "median_hook_seconds": {"full": 0.01, "h2o:auto": 0.15, "streaming_llm": 0.05}}
    text = bench.table(res)
    assert "| h2o:auto | 3.20 | 0.15 | +0.20 | 7.80 | 0 | 1.020 |" in text
    assert "| streaming_llm | 2.90 | 0.05 | -0.10 | 7.60 | 5 | 0.990 |" in text
    assert "| full | 3.00 | 0.01 | +0.00 | 7.00 | 1,200 | 1.000 |" in text
    header, rule = text.split("Where the time goes")[1].splitlines()[2:4]
    assert header.count("|") == rule.count("|")
    del res["median_hook_seconds"]  # a run from before the hook was timed apart: said so, not invented
    assert "| h2o:auto | 3.20 | (not timed) | +0.20 |" in bench.table(res)
    del res["median_attention_seconds"]  # a result from before the attention was timed: the first table only
    assert "Where the time goes" not in bench.table(res)


def test_bench_fused_kernel_refuses_bad_heads(tmp_path):
    with pytest.raises(SystemExit) as e:
        load_benchmark("bench_fused_kernel").main(["--heads", "5", "--kv-heads", "3", "--out", str(tmp_path / "k.json")])
    assert e.value.code == 2
