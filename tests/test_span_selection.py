"""Selection that keeps whole spans (``chunk``): whole chunks kept, budgets exact, sinks and window kept."""

from __future__ import annotations

import math

import pytest
import torch

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import SINKS
from kvtrim.registry import create_policy
from kvtrim.scores import chunk_priority


def _partial_chunks(kept: torch.Tensor, free: torch.Tensor, chunk: int, n: int) -> int:
    """Chunks of which some but not all selectable (``free``) slots were kept."""
    partial = 0
    for c in range(0, n, chunk):
        sel = free[c:c + chunk]
        got = kept[c:c + chunk][sel]
        if 0 < int(got.sum()) < int(sel.sum()):
            partial += 1
    return partial


@pytest.mark.parametrize("chunk", [2, 4, 8])
def test_chunk_priority_keeps_whole_chunks_at_any_budget(chunk):
    g = torch.Generator().manual_seed(chunk)
    n = 61
    scores = torch.rand(2, 3, n, generator=g)
    protected = torch.zeros(2, 3, n, dtype=torch.bool)
    protected[..., :SINKS] = True
    protected[..., -5:] = True
    pri = chunk_priority(scores, chunk, protected)
    assert pri.dtype == torch.float32
    assert torch.equal(pri.sort(dim=-1).values, torch.arange(1, n + 1, dtype=torch.float32).expand(2, 3, n))
    for budget in range(SINKS + 5, n + 1, 3):
        s = pri.masked_fill(protected, float("inf"))
        idx = torch.topk(s, budget, dim=-1).indices
        for b in range(2):
            for h in range(3):
                kept = torch.zeros(n, dtype=torch.bool)
                kept[idx[b, h]] = True
                assert int(kept.sum()) == budget and bool(kept[protected[b, h]].all())
                assert _partial_chunks(kept, ~protected[b, h], chunk, n) <= 1
    # the chunk whose best free token scores highest is taken first, whole
    best = scores.masked_fill(protected, -1.0)[0, 0].argmax().item()
    c0 = best // chunk * chunk
    top = set(torch.topk(pri[0, 0].masked_fill(protected[0, 0], 0), chunk).indices.tolist())
    assert {i for i in range(c0, min(n, c0 + chunk)) if not protected[0, 0, i]} <= top


def test_chunk_one_is_the_token_selection():
    x = torch.rand(1, 2, 30)
    assert torch.equal(chunk_priority(x, 1), x)


def _kept(cache):
    return [layer.positions.sort(dim=-1).values for layer in cache.compressed_layers]


@pytest.mark.parametrize("method, kw", [("snapkv", {"window": 8}), ("inf_mllm", {"window": 8}),
                                        ("snapkv", {"window": 8, "per_head": False})])
@pytest.mark.parametrize("chunk", [4, 8])
def test_policy_chunks_budget_sinks_window(model, prompt, method, kw, chunk):
    keep = 0.4
    cache = KVTrimCache(model, method, keep=keep, chunk=chunk, **kw)
    with kvtrim.attach(model), torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    t = prompt.shape[1]
    pol = cache.policy
    budget = max(pol.min_tokens, math.floor(keep * t))
    n_recent = pol.window_tokens(cache.compressed_layers[0].view, budget)
    free = torch.ones(t, dtype=torch.bool)
    free[:SINKS] = False
    free[t - n_recent:] = False
    for pos in _kept(cache):
        assert pos.shape[-1] == budget  # exactly the budget
        for row in pos.reshape(-1, budget):
            kept = torch.zeros(t, dtype=torch.bool)
            kept[row] = True
            assert bool(kept[:SINKS].all()) and bool(kept[t - n_recent:].all())  # sinks + window
            assert _partial_chunks(kept, free, chunk, t) <= 1  # whole chunks, one cut at the budget
        if not kw.get("per_head", True):
            assert (pos == pos[:, :1]).all()  # one set per layer


def test_chunk_default_unchanged_and_validated(model, prompt):
    a, b = (KVTrimCache(model, "snapkv", keep=0.4, **kw) for kw in ({}, {"chunk": 1}))
    with kvtrim.attach(model), torch.no_grad():
        for c in (a, b):
            model(input_ids=prompt, past_key_values=c, use_cache=True)
    assert all(torch.equal(x, y) for x, y in zip(_kept(a), _kept(b)))
    assert create_policy("snapkv", keep=0.2).chunk == 1 and create_policy("inf_mllm", keep=0.2).chunk == 1
    for m in ("snapkv", "inf_mllm"):
        with pytest.raises(KVTrimError, match="chunk"):
            create_policy(m, keep=0.2, chunk=0)


def test_a_select_override_with_the_documented_arguments_still_runs(model, prompt):
    """``select(scores, protected, budget)`` is the extension point a custom policy overrides; with
    ``per_head=False`` the head mean arrives already taken (``Policy.shared``), so an override that
    only re-ranks sees one row for every head and the layer keeps one set."""
    from kvtrim.policies.snapkv import SnapKV

    calls = []

    class Recording(SnapKV):
        def select(self, scores, protected, budget):
            calls.append(bool((scores == scores[:, :1]).all()))
            return super().select(scores, protected, budget)

    policy = Recording(keep=0.4, window=8, per_head=False, chunk=4)
    cache = KVTrimCache(model, policy)
    with kvtrim.attach(model), torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    assert calls and all(calls)
    for pos in _kept(cache):
        assert (pos == pos[:, :1]).all()
