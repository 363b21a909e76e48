"""inf_mllm: retrieval-window scores, attention bias, per-prompt eviction, bounded memory over many turns."""

from __future__ import annotations

import math

import pytest
import torch

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import SINKS
from kvtrim.policies.inf_mllm import InfMLLM, bias_ramp, retrieval_scores
from kvtrim.registry import create_policy
from kvtrim.session import Session


def reference_scores(query, key, scaling, window):
    """Plain loops in float64: causal softmax rows of the window, averaged per key over the rows that see it."""
    b, hq, q = query.shape[:3]
    hkv, s = key.shape[1], key.shape[2]
    g = hq // hkv
    w = min(window, q)
    out = torch.zeros(b, hkv, s, dtype=torch.float64)
    for h in range(hq):
        kv = h // g
        for i in range(w):
            row = s - w + i  # absolute index of this query among the keys
            logits = (query[0, h, q - w + i].double() @ key[0, kv, : row + 1].double().T) * scaling
            p = torch.softmax(logits, dim=-1)
            for j in range(row + 1):
                out[0, kv, j] += p[j] / (w if j < s - w else s - j) / g
    return out


@pytest.mark.parametrize("s, q, window, hkv, g", [(37, 20, 8, 2, 3), (63, 5, 32, 1, 4), (50, 50, 50, 3, 1)])
def test_retrieval_scores_match_plain_reference(s, q, window, hkv, g):
    torch.manual_seed(s + q)
    query = torch.randn(1, hkv * g, q, 16)
    key = torch.randn(1, hkv, s, 16)
    got = retrieval_scores(query, key, 0.25, window)
    torch.testing.assert_close(got.double(), reference_scores(query, key, 0.25, window), atol=1e-6, rtol=1e-5)
    # every window row sums to 1, so the causal-normalised average carries the window's total mass
    w = min(window, q)
    counts = torch.clamp(s - torch.arange(s), max=w).double()
    torch.testing.assert_close((got.double() * counts).sum(-1), torch.full((1, hkv), float(w), dtype=torch.float64))


def test_bias_ramp_form():
    r = bias_ramp(5, 2.0)
    assert r.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert bias_ramp(1, 3.0).tolist() == [3.0]


@pytest.mark.parametrize("bias", [0.0, 1.0])
@pytest.mark.parametrize("per_head", [True, False])
def test_turn_keeps_new_prompt_plus_topk_of_reference(model, bias, per_head):
    n_old, n_new, budget, window = 60, 12, 40, 8
    pol = InfMLLM(max_tokens=budget, window=window, bias=bias, per_head=per_head)
    pol.max_tokens = 1000  # the prefill keeps all 60 tokens; the turn then runs at the budget
    torch.manual_seed(0)
    cache = KVTrimCache(model, pol)
    layer = cache.compressed_layers[0]
    hkv, hq, d = cache.num_kv_heads, cache.num_heads, cache.head_dim
    keys, _ = layer.update(torch.randn(1, hkv, n_old, d), torch.randn(1, hkv, n_old, d))
    cache.after_attention(layer, torch.randn(1, hq, n_old, d), keys, d**-0.5)
    pol.max_tokens = budget
    keys, _ = layer.update(torch.randn(1, hkv, n_new, d), torch.randn(1, hkv, n_new, d))
    keys = keys.clone()
    q = torch.randn(1, hq, n_new, d)
    cache.after_attention(layer, q, keys, d**-0.5)
    s = n_old + n_new
    ref = reference_scores(q, keys, d**-0.5, window) * s + torch.arange(s).double() / (s - 1) * bias
    if not per_head:
        ref = ref.mean(dim=1, keepdim=True).expand(1, hkv, s).clone()
    ref[..., n_old:] = float("inf")  # the new prompt (12 <= budget / 2) is kept whole
    ref[..., :SINKS] = float("inf")  # and the attention sinks, as by every method
    expect = torch.topk(ref, budget, dim=-1).indices.sort(dim=-1).values
    assert layer.length == budget
    assert torch.equal(layer.positions, expect)
    if not per_head:
        assert all(torch.equal(layer.positions[0, 0], layer.positions[0, h]) for h in range(hkv))


def test_long_prompt_keeps_recent_share_and_competes_for_the_rest(model):
    pol = InfMLLM(max_tokens=40, window=8, bias=0.0, recent_share=0.5)
    cache = KVTrimCache(model, pol)
    layer = cache.compressed_layers[0]
    hkv, hq, d = cache.num_kv_heads, cache.num_heads, cache.head_dim
    torch.manual_seed(5)
    keys, _ = layer.update(torch.randn(1, hkv, 90, d), torch.randn(1, hkv, 90, d))
    cache.after_attention(layer, torch.randn(1, hq, 90, d), keys.clone(), d**-0.5)  # prefill longer than the budget
    assert layer.length == 40
    for h in range(hkv):  # the last 20 (= 0.5 * 40) are always there
        assert set(range(70, 90)) <= set(layer.positions[0, h].tolist())


def test_large_bias_keeps_newer_tokens_than_zero_bias(model):
    def kept(bias):
        pol = InfMLLM(max_tokens=1000, window=8, bias=bias)
        torch.manual_seed(11)
        cache = KVTrimCache(model, pol)
        layer = cache.compressed_layers[0]
        hkv, hq, d = cache.num_kv_heads, cache.num_heads, cache.head_dim
        keys, _ = layer.update(torch.randn(1, hkv, 80, d) * 3, torch.randn(1, hkv, 80, d))
        cache.after_attention(layer, torch.randn(1, hq, 80, d), keys, d**-0.5)
        pol.max_tokens = 30
        keys, _ = layer.update(torch.randn(1, hkv, 10, d) * 3, torch.randn(1, hkv, 10, d))
        cache.after_attention(layer, torch.randn(1, hq, 10, d) * 3, keys.clone(), d**-0.5)
        return layer.positions

    zero, large = kept(0.0), kept(1e6)
    # a dominating bias is pure recency: the newest 26 tokens, besides the 4 attention sinks
    expect = torch.cat([torch.arange(SINKS), torch.arange(60 + SINKS, 90)])
    assert torch.equal(large, expect.expand_as(large))
    # without bias the saddles sit further back
    assert zero.float().mean() < large.float().mean()
    assert not torch.equal(zero, large)


@pytest.mark.parametrize("history", [0.5, 1.0])
def test_history_keeps_max_of_decayed_and_current_scores(model, history):
    """Saddle memory: every prompt scores the cache (also below the budget); a token's attention
    term is max(history * previous, current), carried through evictions with the token."""
    n1, n2, n3, budget, window = 30, 20, 10, 40, 8
    pol = InfMLLM(max_tokens=budget, window=window, bias=0.5, history=history)
    torch.manual_seed(3)
    cache = KVTrimCache(model, pol)
    layer = cache.compressed_layers[0]
    hkv, hq, d = cache.num_kv_heads, cache.num_heads, cache.head_dim
    sc = d**-0.5
    memory = None
    for n in (n1, n2):  # 30 then 50 tokens: the first prompt fits, the second is scored and trimmed
        keys, _ = layer.update(torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d))
        keys = keys.clone()
        q = torch.randn(1, hq, n, d)
        cur = reference_scores(q, keys, sc, window) * keys.shape[2]
        if memory is None:
            memory = cur
        else:
            memory = torch.maximum(torch.cat([memory * history, torch.zeros(1, hkv, n, dtype=torch.float64)], -1), cur)
        cache.after_attention(layer, q, keys, sc)
    s = n1 + n2
    ref = memory + torch.arange(s).double() / (s - 1) * 0.5
    ref[..., n1:] = float("inf")  # the new prompt (20 <= budget / 2) is kept whole
    ref[..., :SINKS] = float("inf")
    expect = torch.topk(ref, budget, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(layer.positions, expect)
    # the memory follows the kept tokens
    kept_memory = torch.gather(memory, 2, expect).float()
    torch.testing.assert_close(layer.state_view("inf_mllm_saddle"), kept_memory, atol=1e-5, rtol=1e-5)
    # the next prompt decays it once more and takes the maximum with its own scores
    keys, _ = layer.update(torch.randn(1, hkv, n3, d), torch.randn(1, hkv, n3, d))
    keys = keys.clone()
    q = torch.randn(1, hq, n3, d)
    cur = reference_scores(q, keys, sc, window) * keys.shape[2]
    prev = torch.cat([kept_memory.double() * history, torch.zeros(1, hkv, n3, dtype=torch.float64)], -1)
    got = pol.score(layer.view, q, keys, sc) - bias_ramp(budget + n3, 0.5).double()
    torch.testing.assert_close(got.double(), torch.maximum(prev, cur), atol=1e-5, rtol=1e-5)


def test_history_zero_is_the_plain_method(model):
    """history=0 (the default) keeps no state and selects exactly as before."""
    def run(**kw):
        pol = InfMLLM(max_tokens=40, window=8, **kw)
        torch.manual_seed(9)
        cache = KVTrimCache(model, pol)
        layer = cache.compressed_layers[0]
        hkv, hq, d = cache.num_kv_heads, cache.num_heads, cache.head_dim
        for n in (30, 25, 12):
            keys, _ = layer.update(torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d))
            cache.after_attention(layer, torch.randn(1, hq, n, d), keys.clone(), d**-0.5)
        return layer

    plain, explicit = run(), run(history=0.0)
    assert torch.equal(plain.positions, explicit.positions) and not plain.token_state


def _record_lengths(cache):
    seen = []
    orig = cache.after_attention

    def wrapped(layer, query, key, scaling):
        orig(layer, query, key, scaling)
        seen.append((layer.phase, layer.length))

    cache.after_attention = wrapped
    return seen


def test_memory_bounded_over_many_turns_past_the_context(model):
    budget, cap = 48, 16
    s = Session(model, None, "inf_mllm", max_tokens=budget, decode_cap=cap, window=8)
    lengths = _record_lengths(s.cache)
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        n = int(torch.randint(1, 70, (1,), generator=g))
        ids = torch.randint(3, 128, (n,), generator=g).tolist()
        s.send_ids(ids, max_new_tokens=int(torch.randint(1, 30, (1,), generator=g)), stop_ids=())
        assert s.stored() <= budget + cap
    assert s.seen > 256  # past the tiny model's context
    turns = [n for p, n in lengths if p in ("prefill", "turn")]
    decodes = [n for p, n in lengths if p == "decode"]
    assert max(turns) <= budget and max(decodes) <= budget + cap
    assert max(decodes) > budget  # decoding did go past the budget, then was trimmed
    per_tok = 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    slack = 8  # CompressedLayer.slack for these sizes
    assert s.cache.kv_bytes() <= (budget + cap + slack) * per_tok * model.config.num_hidden_layers


def test_budget_above_the_conversation_equals_full_cache(model):
    g = torch.Generator().manual_seed(4)
    turns = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (30, 7, 19)]
    full = Session(model, None, "full")
    big = Session(model, None, "inf_mllm", max_tokens=4096)
    for ids in turns:
        a = full.send_ids(ids, max_new_tokens=6, stop_ids=())
        b = big.send_ids(ids, max_new_tokens=6, stop_ids=())
        assert a == b
        torch.testing.assert_close(big._last_logits, full._last_logits, atol=1e-5, rtol=0)
    assert big.stored() == big.seen == full.seen


def test_generate_with_inf_mllm_evicts_per_prompt_only(model, prompt):
    with kvtrim.attach(model):
        cache = KVTrimCache(model, "inf_mllm", max_tokens=40)
        model.generate(prompt, past_key_values=cache, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    # prefill trimmed to 40; the 9 fed decode tokens were appended (within decode_cap), not evicted
    assert cache.stored_tokens() == [49] * model.config.num_hidden_layers


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"max_tokens": 35, "window": 32}, r"smaller than the 36 tokens .*4 attention sinks \+ the retrieval window"),
        ({"max_tokens": 64, "window": 0}, "window must be a positive integer"),
        ({"max_tokens": 64, "bias": -1.0}, "bias must be a finite number >= 0"),
        ({"max_tokens": 64, "bias": float("nan")}, "bias must be a finite number >= 0"),
        ({"max_tokens": 64, "recent_share": 0.0}, r"recent_share must be in \(0, 1\]"),
        ({"max_tokens": 64, "decode_cap": -1}, "decode_cap must be a non-negative integer"),
        ({"max_tokens": 64, "history": 1.5}, r"history must be .*1"),
        ({"max_tokens": 64, "history": -0.1}, r"history must be .*0"),
    ],
)
def test_bad_parameters(kw, message):
    with pytest.raises(KVTrimError, match=message):
        create_policy("inf_mllm", **kw)


def test_defaults_documented():
    p = InfMLLM()
    assert (p.window, p.bias, p.recent_share, p.decode_cap, p.position_policy) == (32, 1.0, 0.5, 256, "reassigned")
    assert p.history == 0.0
    # no budget given: the default max_tokens (1024), so the default configuration streams
    assert p.max_tokens == 1024 and p.can_stream() is True
    assert InfMLLM(keep=0.5).can_stream() is False and InfMLLM(max_tokens=64, position="true").can_stream() is False
    assert math.isclose(InfMLLM(keep=0.5).budget(200), 100)
