"""HAE (DAP + DDES) and FastV: the kept sets against independent oracles, broadcast, modes, bin."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("skimage")

import kvtrim
from kvtrim import vlm
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.policies.hae import HAE, dap_keep
from kvtrim.registry import create_policy


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def llava(request):
    """A tiny 4-layer VLM of each supported class (Qwen2-VL exercises mrope under pruning)."""
    v = (vlm.tiny_llava if request.param == "llava" else vlm.tiny_qwen2_vl)(layers=4)
    ids, extra = vlm.prepare(v.processor, "What animal is in the picture, and what colour is it?", [vlm.sample_images()["chelsea"]])
    return v, ids, extra


def prefill(v, ids, extra, policy):
    cache = KVTrimCache(v.model, policy)
    with kvtrim.attach(v.model), torch.no_grad():
        out = v.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, **extra)
    return cache, out


def eager_attentions(v, ids, extra):
    """Softmax attention of every language-model layer from transformers' eager path (independent oracle)."""
    v.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = v.model(input_ids=torch.tensor([ids]), output_attentions=True, **extra)
    finally:
        v.model.set_attn_implementation("sdpa")
    return [a[0].double() for a in out.attentions]  # [Hq, T, T]


# --- DAP rule ---------------------------------------------------------------------------------------
def test_dap_rule_on_constructed_attention():
    # 3 text rows x 5 visual columns; sum of g = 1.0
    attn = torch.tensor([
        [0.10, 0.0001, 0.0002, 0.30, 0.0000],
        [0.10, 0.0001, 0.0006, 0.00, 0.0002],
        [0.10, 0.0001, 0.0000, 0.29, 0.0003],
    ])
    # sum g = 0.8916, r * sum g = 0.00134: column 1 (g=0.0003, m=0.0001) and 4 (g=0.0005, m=0.0003)
    # are below both thresholds; column 2 has g=0.0008 < 0.00134 but m=0.0006 >= alpha: the local
    # test protects it.
    assert dap_keep(attn, r=0.0015, alpha=0.0005).tolist() == [True, False, True, True, False]
    # a higher alpha no longer protects column 2
    assert dap_keep(attn, r=0.0015, alpha=0.001).tolist() == [True, False, False, True, False]
    # r = 0 drops nothing
    assert dap_keep(attn, r=0.0, alpha=1.0).all()


def _dap_oracle(attn0, ids, image_id, r, alpha):
    a = attn0.mean(dim=0)  # head average [T, T]
    vis = torch.tensor([t == image_id for t in ids])
    vis[-1] = False
    sub = a[~vis][:, vis]
    keep_vis = ~((sub.sum(0) < r * sub.sum(0).sum()) & (sub.max(0).values < alpha))
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[vis] = keep_vis
    return keep.nonzero().flatten()


@pytest.mark.parametrize("mode", ["prune", "kv"])
def test_dap_keeps_exactly_the_rule_and_broadcasts_it_to_every_layer(llava, mode):
    v, ids, extra = llava
    attn0 = eager_attentions(v, ids, extra)[0]
    vis = torch.tensor([t == v.processor.image_token_id for t in ids])
    a = attn0.mean(dim=0)[~vis][:, vis]
    # thresholds at the data's medians so that the rule both keeps and drops tokens
    g, m = a.sum(0), a.max(0).values
    r, alpha = float(g.median() / g.sum()), float(m.median())
    expect = _dap_oracle(attn0, ids, v.processor.image_token_id, r, alpha)
    assert 0 < len(ids) - expect.numel() < int(vis.sum())
    cache, _ = prefill(v, ids, extra, HAE(r=r, alpha=alpha, mode=mode))
    assert cache.layers[0].state["kept_stream"].tolist() == expect.tolist()
    for layer in cache.compressed_layers:  # the same set in every layer and KV head
        for h in range(layer.positions.shape[1]):
            assert layer.positions[0, h].tolist() == expect.tolist()
    assert cache.seen_tokens() == len(ids)


def test_prune_mode_skips_dropped_tokens_in_later_layers(llava):
    v, ids, extra = llava
    shapes = {}
    layers = vlm_layers(v)

    def record(i):
        def hook(mod, args, out):
            shapes[i] = (out[0] if isinstance(out, tuple) else out).shape[1]
        return hook

    hooks = [layer.register_forward_hook(record(i)) for i, layer in enumerate(layers)]
    try:
        prefill(v, ids, extra, HAE(r=0.5, alpha=1.0))  # drops every visual token
    finally:
        for h in hooks:
            h.remove()
    n_vis = sum(t == v.processor.image_token_id for t in ids)
    assert shapes[0] == len(ids)
    assert all(shapes[i] == len(ids) - n_vis for i in range(1, len(layers)))


def vlm_layers(v):
    from kvtrim.integrations.pruning import decoder_layers

    return decoder_layers(v.model)


def test_prune_and_kv_modes_relationship(llava):
    """Same token set everywhere; the KV of layers 0 and 1 identical (layer 1's keys/values are
    projections of layer 0's output, computed on every token in both modes); from layer 2 on,
    identical for the tokens before the first dropped one and different after it (in prune mode
    layer 1 never let them attend to dropped tokens)."""
    v, ids, extra = llava
    kw = dict(r=0.5, alpha=1.0)
    a, out_a = prefill(v, ids, extra, HAE(mode="prune", **kw))
    b, out_b = prefill(v, ids, extra, HAE(mode="kv", **kw))
    first_drop = next(i for i, t in enumerate(ids) if t == v.processor.image_token_id)
    for li, (la, lb) in enumerate(zip(a.compressed_layers, b.compressed_layers)):
        assert torch.equal(la.positions, lb.positions)
        if li <= 1:
            torch.testing.assert_close(la.keys, lb.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(la.values, lb.values, atol=1e-5, rtol=0)
        else:
            torch.testing.assert_close(la.keys[:, :, :first_drop], lb.keys[:, :, :first_drop], atol=1e-5, rtol=0)
            torch.testing.assert_close(la.values[:, :, :first_drop], lb.values[:, :, :first_drop], atol=1e-5, rtol=0)
            assert (la.values[:, :, first_drop:] - lb.values[:, :, first_drop:]).abs().max() > 1e-4
    assert not torch.allclose(out_a.logits[:, -1], out_b.logits[:, -1], atol=1e-5)


# --- FastV ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["prune", "kv"])
def test_fastv_keeps_top_half_by_last_token_attention_after_layer_k(llava, mode):
    v, ids, extra = llava
    attn = eager_attentions(v, ids, extra)[1]  # layer K-1 = 1
    vis = torch.tensor([t == v.processor.image_token_id for t in ids])
    row = attn.mean(dim=0)[-1]
    n_keep = int(vis.sum()) // 2
    top = torch.topk(row.masked_fill(~vis, -1.0), n_keep).indices
    keep = ~vis
    keep[top] = True
    expect = keep.nonzero().flatten().tolist()
    cache, _ = prefill(v, ids, extra, create_policy("fastv", mode=mode))
    for li, layer in enumerate(cache.compressed_layers):
        got = layer.positions[0, 0].tolist()
        assert got == (list(range(len(ids))) if li < 2 else expect)


# --- DDES -----------------------------------------------------------------------------------------
def ddes_layer(model, policy, t=30, seed=0):
    """A cache layer filled with ``t`` random prompt tokens through the policy's prefill hook."""
    g = torch.Generator().manual_seed(seed)
    cache = KVTrimCache(model, policy)
    layer = cache.compressed_layers[0]
    hkv, hq, d = cache.num_kv_heads, cache.num_heads, cache.head_dim
    k = torch.randn(1, hkv, t, d, generator=g)
    layer.update(k, torch.randn(1, hkv, t, d, generator=g))
    cache.after_attention(layer, torch.randn(1, hq, t, d, generator=g), k, d**-0.5)
    return cache, layer, g


def decode_step(cache, layer, policy, g, query=None, key=None):
    hkv, hq, d = cache.num_kv_heads, cache.num_heads, cache.head_dim
    k_new = torch.randn(1, hkv, 1, d, generator=g) if key is None else key
    keys, _ = layer.update(k_new, torch.randn(1, hkv, 1, d, generator=g))
    q = torch.randn(1, hq, 1, d, generator=g) if query is None else query
    cache.after_attention(layer, q, keys, d**-0.5)


def test_ddes_restores_a_recovered_token(model):
    pol = HAE(max_tokens=20, bin_ratio=0.25, recent=2)
    cache, layer, g = ddes_layer(model, pol)
    assert layer.length == 20 and pol.bin_size(20) == 5
    binned = layer.state_view("hae_bin")
    assert int(binned[0, 0].sum()) == 5
    slot = int(binned[0, 0].nonzero()[0])
    pos = int(layer.positions[0, 0, slot])
    # the next query of every head in group 0 points straight at the binned key: its score recovers
    q = torch.zeros(1, cache.num_heads, 1, cache.head_dim)
    q[0, : cache.num_heads // cache.num_kv_heads, 0] = 50.0 * layer.keys[0, 0, slot]
    decode_step(cache, layer, pol, g, query=q)
    new_slot = int((layer.positions[0, 0] == pos).nonzero()[0])
    assert not bool(layer.state_view("hae_bin")[0, 0, new_slot])
    assert layer.state["hae_restored"] >= 1


def test_ddes_evicts_in_batches_and_never_exceeds_its_budget(model):
    budget, steps = 20, 30
    pol = HAE(max_tokens=budget, bin_ratio=0.25, recent=2)
    cache, layer, g = ddes_layer(model, pol)
    calls = []
    orig = layer.keep_indices
    layer.keep_indices = lambda idx, *a, **k: (calls.append(layer.length - idx.shape[-1]), orig(idx, *a, **k))[1]
    for _ in range(steps):
        decode_step(cache, layer, pol, g)
        assert layer.length <= budget
        assert int(layer.state_view("hae_bin")[0, 0].sum()) <= pol.bin_size(budget) + 1
    # one gather per D + 1 = 6 steps, each freeing 6 tokens (h2o: one gather per step, 1 token)
    assert calls == [pol.bin_size(budget) + 1] * (steps // (pol.bin_size(budget) + 1))


def test_ddes_with_a_ratio_budget_holds_it_through_generate(llava):
    v, ids, extra = llava
    with kvtrim.attach(v.model):
        cache = KVTrimCache(v.model, "hae", keep=0.5, r=0.0)
        v.model.generate(input_ids=torch.tensor([ids]), past_key_values=cache, max_new_tokens=12, min_new_tokens=12, **extra)
    assert max(cache.stored_tokens()) <= math.floor(0.5 * cache.seen_tokens())


# --- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    ({"r": -0.1}, r"r must be in \[0, 1\]"),
    ({"alpha": 2}, r"alpha must be in \[0, 1\]"),
    ({"r": True}, r"r must be in \[0, 1\]"),
    ({"mode": "both"}, "mode must be one of prune, kv"),
    ({"bin_ratio": 0.0}, "bin_ratio must be in"),
    ({"dap_mode": "both"}, "mode must be one of prune, kv"),
    ({"targets": ("text",)}, "targets must be prunable modalities"),
    ({"max_tokens": 13}, r"smaller than the 14 tokens .*4 attention sinks \+ 8 recent"),
])
def test_hae_bad_parameters(kw, msg):
    with pytest.raises(KVTrimError, match=msg):
        create_policy("hae", **kw)


def test_hae_mode_has_one_field_and_accepts_its_former_name():
    """``mode`` is the one field (as for FastV); ``dap_mode`` (its former name, in older scripts and saved
    sessions) maps onto it, and conflicting values are refused."""
    assert HAE().mode == "prune"
    assert HAE(dap_mode="kv").mode == "kv"
    assert HAE(mode="kv", dap_mode="kv").mode == "kv"
    assert create_policy("hae", dap_mode="kv") == HAE(mode="kv")
    assert "dap_mode" not in HAE().params() and HAE(dap_mode="kv").describe()["mode"] == "kv"
    with pytest.raises(KVTrimError, match="mode='prune' and dap_mode='kv' disagree"):
        HAE(mode="prune", dap_mode="kv")


def test_fastv_bad_parameters():
    with pytest.raises(KVTrimError, match=r"fastv takes no cache budget \(max_tokens\); .* with --keep"):
        create_policy("fastv", max_tokens=50)
    with pytest.raises(KVTrimError, match=r"keep=0\.3 and ratio=0\.4 disagree"):
        create_policy("fastv", keep=0.3, ratio=0.4)
    with pytest.raises(KVTrimError, match="k must be a positive integer"):
        create_policy("fastv", k=0)
    with pytest.raises(KVTrimError, match=r"ratio must be in \[0, 1\]"):
        create_policy("fastv", ratio=1.5)


def test_hidden_state_pruning_outside_attach_is_refused(model):
    from kvtrim.integrations.pruning import prune_after

    cache = KVTrimCache(model, "fastv")
    with pytest.raises(KVTrimError, match=r"kvtrim\.attach"):
        prune_after(cache, 0, torch.arange(3))


def test_pruning_hooks_exist_only_inside_attach(llava):
    v, _, _ = llava
    layers = vlm_layers(v)

    def n_hooks():
        return len(v.model._forward_pre_hooks) + len(v.model._forward_hooks) + sum(len(x._forward_pre_hooks) for x in layers)

    before = n_hooks()
    with kvtrim.attach(v.model):
        assert n_hooks() == before + 2 + len(layers)
    assert n_hooks() == before
