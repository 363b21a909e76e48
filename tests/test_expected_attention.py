"""The query-agnostic ``expected_attention`` score and per-layer budgets (``kvtrim.policies.layer_budgets``),
on tiny random models (CPU, float32)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_session import _ids

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.integrations.hf import causal_mask, layer_mask
from kvtrim.policies.expected_attention import STATS, ExpectedAttention
from kvtrim.policies.layer_budgets import adaptive_counts, spread, spread_at_least
from kvtrim.registry import create_policy, split_method
from kvtrim.rope import Rotary, rotate
from kvtrim.session import Session


def _prefill(model, prompt, method, **kw):
    cache = KVTrimCache(model, method, **kw)
    with torch.no_grad(), kvtrim.attach(model):
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    return cache, out


def _fake_layer(rotary, positions):
    """A stand-in LayerView whose newest ``len(positions)`` slots were rotated at ``positions``."""
    rot = torch.as_tensor(positions).view(1, 1, -1)
    return SimpleNamespace(rotary=rotary, rotations=rot, length=rot.shape[-1], state={})


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_future_moments_equal_the_explicit_cloud_of_future_queries(layout):
    """Mean and diagonal variance of the predicted queries equal those of every seen (pre-RoPE) query
    placed at every one of the next ``future`` positions, computed one by one."""
    torch.manual_seed(0)
    hq, n, d, future = 3, 11, 16, 7
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)), layout)
    pre = torch.randn(hq, n, d, dtype=torch.float64) + torch.linspace(-2, 2, d, dtype=torch.float64)
    positions = torch.arange(5, 5 + n)
    post = rotate(pre, positions.expand(hq, n), rotary.inv_freq, layout)  # what the hook receives
    pol = ExpectedAttention(keep=0.5, future=future)
    layer = _fake_layer(rotary, positions)
    pol.learn(layer, post.unsqueeze(0).float())
    mean, var = pol.future_moments(layer, *pol.query_means(layer))
    ahead = torch.arange(positions[-1] + 1, positions[-1] + 1 + future)
    cloud = torch.stack([rotate(pre, torch.full((hq, n), int(p)), rotary.inv_freq, layout) for p in ahead], dim=1)
    cloud = cloud.reshape(hq, -1, d)  # [Hq, future * n, D]
    torch.testing.assert_close(mean, cloud.mean(dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(var, cloud.var(dim=1, unbiased=False), atol=1e-4, rtol=1e-4)


def test_statistics_accumulate_over_prompts():
    torch.manual_seed(1)
    pol = ExpectedAttention(keep=0.5)
    layer = _fake_layer(None, [0, 1, 2, 3])
    a, b = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 3, 8)
    pol.learn(layer, a)
    pol.learn(layer, b)
    m1, m2, _ = pol.query_means(layer)
    both = torch.cat([a, b], dim=2)[0].double()
    assert layer.state[STATS]["n"] == 7
    torch.testing.assert_close(m1, both.mean(dim=1))
    torch.testing.assert_close(m2, (both * both).mean(dim=1))


def test_score_is_the_attention_of_the_predicted_mean_query(model, prompt):
    """With one future position, no variance term, no value norm and no pooling, a key's score is the
    softmax attention the mean query pays it from the next position, averaged over the group."""
    pol = ExpectedAttention(keep=0.5, future=1, covariance=False, vnorm=False, kernel=1)
    seen = []
    orig = pol.score

    def spy(layer, query, key, scaling):
        s = orig(layer, query, key, scaling)
        seen.append((layer.rotary, query.clone(), key.clone(), scaling, s.clone(), layer.seen))
        return s

    pol.score = spy  # type: ignore[method-assign]
    _prefill(model, prompt, pol)
    rotary, query, key, scaling, got, n = seen[0]
    pre = rotary.rotate(query[0].double(), -torch.arange(n).expand(query.shape[1], n))
    mean = rotary.rotate(pre.mean(dim=1, keepdim=True), torch.full((query.shape[1], 1), n)).float()  # [Hq, 1, D]
    g = query.shape[1] // key.shape[1]
    probs = torch.softmax(torch.einsum("hqd,hsd->hqs", mean, key[0].float().repeat_interleave(g, 0)) * scaling, -1)
    want = probs[:, 0].reshape(key.shape[1], g, -1).mean(dim=1)
    torch.testing.assert_close(got[0], want, atol=1e-6, rtol=1e-5)


def test_kept_set_is_the_top_of_the_score_plus_sinks_and_window(model, prompt):
    pol = ExpectedAttention(keep=0.4, window=8, kernel=1)  # pooling makes ties, which topk orders freely
    scores = []
    orig = pol.score
    pol.score = lambda *a: scores.append(orig(*a)) or scores[-1]  # type: ignore[method-assign]
    cache, _ = _prefill(model, prompt, pol)
    n = prompt.shape[1]
    budget = math.floor(0.4 * n)
    for layer, s in zip(cache.compressed_layers, scores):
        kept = layer.positions[0]
        assert kept.shape[-1] == budget
        forced = (torch.arange(n) < 4) | (torch.arange(n) >= n - 8)
        free = budget - int(forced.sum())
        for h in range(kept.shape[0]):
            rank = s[0, h].masked_fill(forced, float("-inf"))
            want = set(torch.topk(rank, free).indices.tolist()) | set(forced.nonzero().flatten().tolist())
            assert set(kept[h].tolist()) == want


def test_the_same_prompt_keeps_the_same_tokens(model, prompt):
    runs = [_prefill(model, prompt, "expected_attention", keep=0.3, layers="adaptive")[0] for _ in range(2)]
    for a, b in zip(*(c.compressed_layers for c in runs)):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)


def test_question_share_keeps_the_current_prompts_top_tokens(model, prompt):
    """``question=1`` gives every free slot to the window queries' pooled attention (SnapKV's score),
    so it keeps SnapKV's set; ``question=0`` does not read it."""
    a, _ = _prefill(model, prompt, "expected_attention", keep=0.3, window=8, question=1.0, kernel=1)
    b, _ = _prefill(model, prompt, "snapkv", keep=0.3, window=8, kernel=1)  # no pooling: no ties
    for x, y in zip(a.compressed_layers, b.compressed_layers):
        assert torch.equal(x.positions, y.positions)
        assert not any(isinstance(v, torch.Tensor) for v in x.state.values())  # nothing left to save
    assert ExpectedAttention(keep=0.3).wants_prefill_scores(a.compressed_layers[0].view) is None


# --- per-layer budgets ----------------------------------------------------------------------------------
def test_spread_sums_exactly_and_respects_the_least_share():
    assert spread(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(spread(97, [1.5, 1.25, 1.0, 0.75, 0.5])) == 97
    got = spread_at_least(100, [1.5, 1.0, 0.5, 0.1], 20)
    assert sum(got) == 100 and min(got) == 20 and got[0] > got[1] > got[2] == got[3] == 20


def test_adaptive_counts_give_the_free_budget_to_the_peaked_layer():
    flat = torch.ones(1, 2, 40)
    peaked = torch.cat([torch.full((1, 2, 10), 10.0), torch.full((1, 2, 30), 0.01)], dim=-1)
    counts = adaptive_counts([flat, peaked], [None, None], [5, 5], 30)
    # after the floors the peaked layer's 5 other large shares (~0.1) come first, then the flat layer's
    # (1/40 each) beat the peaked layer's tail (~1e-4): 20 free = 5 + 15
    assert counts == [20, 10]
    prot = torch.zeros(1, 2, 40, dtype=torch.bool)
    prot[..., :3] = True
    assert sum(adaptive_counts([flat, flat], [prot, prot], [8, 8], 50)) == 50
    assert adaptive_counts([flat, flat], [None, None], [8, 8], 100) == [40, 40]  # all of both layers fit


@pytest.mark.parametrize("method", ["snapkv", "expected_attention"])
@pytest.mark.parametrize("layers", ["pyramid", "adaptive"])
def test_per_layer_budgets_sum_to_the_total_and_free_the_bytes(model, prompt, method, layers):
    cache, _ = _prefill(model, prompt, method, keep=0.4, layers=layers)
    n_layers, seen = model.config.num_hidden_layers, prompt.shape[1]
    budget = math.floor(0.4 * seen)
    stored = cache.stored_tokens()
    assert sum(stored) == n_layers * budget and len(set(stored)) > 1
    if layers == "pyramid":
        assert stored == sorted(stored, reverse=True)
    per_tok = 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    assert cache.kv_bytes_stored() == sum(stored) * per_tok  # the storage holds exactly these tokens
    slack = sum(layer.slack(layer.length) for layer in cache.compressed_layers)
    assert cache.kv_bytes() == (sum(stored) + slack) * per_tok  # buffers shrunk per layer: memory returned
    for layer in cache.compressed_layers:
        assert layer.positions.shape[-1] == layer.length and layer.keys.shape[2] == layer.length


def test_a_turn_over_uneven_layers_equals_the_same_tokens_one_by_one(model, prompt):
    """transformers' mask of a turn is made for the first layer's length; kvtrim gives every layer the
    causal mask of its own (``hf.layer_mask``). Oracle: the turn's logits equal those of feeding its
    tokens one at a time (decode steps need no mask and evict nothing here)."""
    turn = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    a, _ = _prefill(model, prompt, "snapkv", keep=0.4, layers="adaptive", window=8)
    b, _ = _prefill(model, prompt, "snapkv", keep=0.4, layers="adaptive", window=8)
    assert len(set(a.stored_tokens())) > 1
    with torch.no_grad(), kvtrim.attach(model):
        whole = model(input_ids=turn, past_key_values=a, use_cache=True).logits[0]
        one = torch.cat([model(input_ids=turn[:, i:i + 1], past_key_values=b, use_cache=True).logits[0]
                         for i in range(turn.shape[1])])
    torch.testing.assert_close(whole, one, atol=1e-5, rtol=1e-5)


def test_layer_mask_carries_a_causal_mask_and_refuses_padding():
    m = causal_mask(3, 10, "cpu")
    assert torch.equal(layer_mask(m, 3, 7), causal_mask(3, 7, "cpu"))
    padded = m.clone()
    padded[..., 0] = False
    with pytest.raises(KVTrimError, match="padding"):
        layer_mask(padded, 3, 7)


def test_session_with_adaptive_layers_saves_and_continues_identically(model, tmp_path):
    a = Session(model, None, "expected_attention", max_tokens=40, window=8, layers="adaptive")
    a.send_ids(_ids(60, 1), max_new_tokens=6, stop_ids=())
    a.feed_ids(_ids(30, 2), chunk=16)  # chunks are turns: uneven layers see multi-token forwards
    assert sum(a.cache.stored_tokens()) == 40 * model.config.num_hidden_layers  # the last chunk evicted
    a.save(tmp_path / "s")
    b = Session.load(tmp_path / "s", model)
    assert b.stored() == a.stored() and b.policy == a.policy
    outs = [s.send_ids(_ids(12, 3), max_new_tokens=5, stop_ids=()) for s in (a, b)]
    assert outs[0] == outs[1]
    for la, lb in zip(a.cache.compressed_layers, b.cache.compressed_layers):
        assert torch.equal(la.positions, lb.positions) and la.state == lb.state


# --- refusals and the eval's method syntax ----------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    ({"layers": "ragged"}, "layers must be one of"), ({"kernel": 4}, "odd"), ({"future": 0}, "future"),
    ({"covariance": 1}, "true or false"), ({"question": 1.5}, "question"),
])
def test_bad_parameters_are_refused_in_one_line(kw, match):
    with pytest.raises(KVTrimError, match=match) as e:
        create_policy("expected_attention", keep=0.25, **kw)
    assert "\n" not in str(e.value)


def test_vllm_plugin_refuses_per_layer_budgets():
    from kvtrim.integrations.vllm.config import PluginConfig

    PluginConfig(method="snapkv", params={"keep": 0.25}).policy()
    with pytest.raises(KVTrimError, match="block table"):
        PluginConfig(method="snapkv", params={"keep": 0.25, "layers": "adaptive"})


def test_split_method_reads_parameters():
    assert split_method("snapkv") == ("snapkv", {})
    assert split_method("expected_attention:layers=adaptive:future=64:vnorm=false:question=0.5") == (
        "expected_attention", {"layers": "adaptive", "future": 64, "vnorm": False, "question": 0.5})
    with pytest.raises(KVTrimError, match="key=value"):
        split_method("snapkv:layers")


def test_eval_plan_takes_methods_with_parameters():
    from kvtrim.eval.plan import make_plan
    from kvtrim.eval.store import config_params

    plan = make_plan("multiturn", "2048", "snapkv:layers=adaptive", "0.25")
    assert ("snapkv:layers=adaptive", 0.25) in plan.configs
    assert config_params("snapkv:layers=adaptive", 0.25)["layers"] == "adaptive"
    with pytest.raises(KVTrimError, match="layers must be one of"):
        make_plan("multiturn", "2048", "snapkv:layers=wide", "0.25")
    with pytest.raises(KVTrimError, match="unknown method"):
        make_plan("multiturn", "2048", "snap:layers=adaptive", "0.25")
