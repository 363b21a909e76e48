"""The compressing cache and every registered policy, on a tiny random GQA Llama (CPU, fp32)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import eager_attentions, skip_reconstruction_method
from transformers import DynamicCache

import kvtrim
from kvtrim import persistence
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.generation import generate_ids
from kvtrim.policies.base import SINKS
from kvtrim.registry import create_policy, get_policy_class, method_names, spans_error
from kvtrim.storage import CompressedLayer

ALL = method_names()
COMPRESSING = [m for m in ALL if get_policy_class(m).takes_budget]


def run_loop(model, ids, cache, steps=6):
    """Prefill + greedy decode by hand; returns the list of last-position logits."""
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return logits


def skip_span_method(name, **kw):
    if create_policy(name, **kw).compresses:
        skip_reconstruction_method(name)
    if spans_error(create_policy(name, **kw)):
        pytest.skip("refuses a text prompt (acts on image spans only): tested on VLMs in test_vlm.py, "
                    "the refusal in test_no_silent_noop.py")


@pytest.mark.parametrize("name", ALL)
def test_keep_everything_equals_full_cache(model, prompt, name):
    skip_span_method(name, keep=1.0)
    ref = run_loop(model, prompt, DynamicCache(config=model.config))
    with kvtrim.attach(model):
        got = run_loop(model, prompt, KVTrimCache(model, name, keep=1.0))
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", COMPRESSING)
def test_stored_length_and_resident_bytes_follow_budget(model, prompt, name):
    skip_reconstruction_method(name)
    keep = 0.5
    cache = KVTrimCache(model, name, keep=keep)
    with kvtrim.attach(model):
        run_loop(model, prompt, cache, steps=0)
    pol = cache.policy
    seen = prompt.shape[1]
    budget = max(pol.min_tokens, math.floor(keep * seen))
    assert cache.seen_tokens() == seen
    assert cache.stored_tokens() == [budget] * model.config.num_hidden_layers
    per_tok = 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    assert cache.kv_bytes_stored() == budget * per_tok * model.config.num_hidden_layers
    # the buffers were shrunk: resident bytes are the budget plus the documented slack
    slack = CompressedLayer.slack(budget)
    assert cache.kv_bytes() == (budget + slack) * per_tok * model.config.num_hidden_layers
    assert cache.kv_bytes_full() == seen * per_tok * model.config.num_hidden_layers


def test_gqa_cache_holds_kv_heads_only(model, prompt):
    cache = KVTrimCache(model, "snapkv", keep=0.5)
    with kvtrim.attach(model):
        run_loop(model, prompt, cache, steps=1)
    for layer in cache.compressed_layers:
        assert layer.keys.shape[1] == model.config.num_key_value_heads
        assert layer.values.shape[1] == model.config.num_key_value_heads


def _kept_positions(cache):
    return [layer.positions.sort(dim=-1).values for layer in cache.compressed_layers]


def test_snapkv_keeps_topk_of_its_scores(model, prompt):
    window, kernel = 16, 7
    cache = KVTrimCache(model, "snapkv", keep=0.4, window=window, kernel=kernel, pooling="max")
    with kvtrim.attach(model):
        run_loop(model, prompt, cache, steps=0)
    t = prompt.shape[1]
    budget = math.floor(0.4 * t)
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    for attn, kept in zip(eager_attentions(model, prompt), _kept_positions(cache)):
        s = attn[:, :, -window:, :].sum(dim=2)  # [B, Hq, T]
        s = s.reshape(1, -1, g, t).mean(dim=2)
        s = F.max_pool1d(s.reshape(-1, 1, t), kernel, stride=1, padding=kernel // 2).reshape(1, -1, t)
        s[..., -window:] = float("inf")
        s[..., :SINKS] = float("inf")  # the attention sinks, kept by every method
        expect = torch.topk(s, budget, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(kept, expect)


def test_h2o_keeps_heavy_hitters_plus_recent(model, prompt):
    cache = KVTrimCache(model, "h2o", keep=0.4)
    with kvtrim.attach(model):
        run_loop(model, prompt, cache, steps=0)
    t = prompt.shape[1]
    budget = math.floor(0.4 * t)
    n_recent = int(budget * 0.5)
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    for attn, kept in zip(eager_attentions(model, prompt), _kept_positions(cache)):
        acc = attn.sum(dim=2).reshape(1, -1, g, t).sum(dim=2)  # column sums, summed over the group
        acc[..., t - n_recent :] = float("inf")
        expect = torch.topk(acc, budget, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(kept, expect)


def test_h2o_decode_evicts_every_step_and_holds_budget(model, prompt):
    cache = KVTrimCache(model, "h2o", max_tokens=40)
    with kvtrim.attach(model):
        run_loop(model, prompt, cache, steps=5)
    assert cache.stored_tokens() == [40] * model.config.num_hidden_layers
    assert cache.seen_tokens() == prompt.shape[1] + 5
    for layer in cache.compressed_layers:  # the 20 most recent are always there
        recent = torch.arange(cache.seen_tokens() - 20, cache.seen_tokens())
        for h in range(layer.positions.shape[1]):
            assert set(recent.tolist()) <= set(layer.positions[0, h].tolist())


def test_streaming_llm_keeps_sinks_and_recent(model, prompt):
    cache = KVTrimCache(model, "streaming_llm", max_tokens=24)
    with kvtrim.attach(model):
        run_loop(model, prompt, cache, steps=3)
    seen = cache.seen_tokens()
    expect = list(range(4)) + list(range(seen - 20, seen))
    for layer in cache.compressed_layers:
        for h in range(layer.positions.shape[1]):
            assert layer.positions[0, h].tolist() == expect


def test_reassigned_keys_match_rope_at_in_cache_positions(model, prompt):
    """Kept keys equal transformers' own RoPE applied at positions 0..stored-1 to the raw keys."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvtrim.rope import find_inv_freq, rotate

    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=full, use_cache=True)
    cache = KVTrimCache(model, "streaming_llm", max_tokens=30)
    with kvtrim.attach(model):
        run_loop(model, prompt, cache, steps=0)
    inv = find_inv_freq(model)
    t = prompt.shape[1]
    for li, layer in enumerate(cache.compressed_layers):
        k_true = full.layers[li].keys  # rotated at true positions 0..T-1
        raw = rotate(k_true.double(), -torch.arange(t).double().expand(1, 1, t), inv)  # un-rotated keys
        kept = layer.positions[0, 0]
        n = kept.numel()
        cos, sin = model.model.rotary_emb(raw.float(), torch.arange(n).unsqueeze(0))
        expect, _ = apply_rotary_pos_emb(raw.float()[:, :, kept], raw.float()[:, :, kept], cos, sin)
        torch.testing.assert_close(layer.keys, expect, atol=1e-5, rtol=1e-5)
        assert layer.rotations[0, 0].tolist() == list(range(n))


@pytest.mark.parametrize("name", ALL)
def test_generate_and_hand_loop_agree(model, prompt, name):
    cls = get_policy_class(name)
    kw = {"keep": 0.5} if cls.takes_budget else {}
    if cls.default_position == "reassigned":  # fixed budget: exercises per-step re-rotation inside generate
        kw = {"max_tokens": 40}
    skip_span_method(name, **kw)
    with kvtrim.attach(model):
        cache = KVTrimCache(model, name, **kw)
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    res = generate_ids(model, None, prompt[0].tolist(), create_policy(name, **kw), max_new_tokens=8, stop_at_eos=False)
    assert out[0, prompt.shape[1] :].tolist() == res.token_ids


def test_compress_context_manager_with_sampling_equals_full(model, prompt):
    torch.manual_seed(3)
    ref = model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0)
    torch.manual_seed(3)
    with kvtrim.compress(model, "h2o", keep=1.0) as cache:
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=6, do_sample=True, top_k=0)
    assert torch.equal(out, ref)


def test_sliding_window_layers_use_transformers_layer():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.cache_utils import DynamicSlidingWindowLayer

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=True, sliding_window=16,
        max_window_layers=2,
    )
    m = Qwen2ForCausalLM(cfg).eval()
    m.set_attn_implementation("sdpa")
    assert "sliding_attention" in cfg.layer_types
    ids = torch.randint(3, 128, (1, 60))
    ref = run_loop(m, ids, DynamicCache(config=cfg), steps=4)
    cache = KVTrimCache(m, "snapkv", keep=1.0)
    kinds = [type(layer) for layer in cache.layers]
    assert [k is DynamicSlidingWindowLayer for k in kinds] == [t == "sliding_attention" for t in cfg.layer_types]
    with kvtrim.attach(m):
        got = run_loop(m, ids, cache, steps=4)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


# --- integration hygiene -----------------------------------------------------------------------
def test_import_changes_nothing_and_attach_is_reversible(model):
    from transformers import AttentionInterface

    assert "kvtrim" not in AttentionInterface._global_mapping
    before = model.config._attn_implementation
    with kvtrim.attach(model):
        assert model.config._attn_implementation == "kvtrim"
        assert "kvtrim" in AttentionInterface._global_mapping
    assert model.config._attn_implementation == before
    assert "kvtrim" not in AttentionInterface._global_mapping


# --- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_describe_and_params_come_from_the_dataclass_fields(name):
    """One place: describe() is {"method": name, **every field} with the position resolved (a field
    added after results were recorded left out at its default: ``Policy.added_later``); params()
    rebuilds the policy (sessions save it)."""
    import dataclasses

    p = create_policy(name)
    d = p.describe()
    assert list(d) == ["method", *(f.name for f in dataclasses.fields(p) if f.name not in p.added_later)]
    for k, default in p.added_later.items():
        assert getattr(p, k) == default and k in p.params()
    assert d["method"] == name and d["position"] == p.position_policy and p.params()["position"] is None
    assert create_policy(name, **p.params()) == p
    assert json.loads(json.dumps(d)) == d  # JSON-ready (tuples as lists)


def test_unknown_method_lists_known():
    with pytest.raises(KVTrimError, match="known methods: full, streaming_llm"):
        create_policy("nope")


@pytest.mark.parametrize("keep", [0.0, -0.1, 1.5, float("nan")])
def test_keep_out_of_range(keep):
    with pytest.raises(KVTrimError, match=r"keep must be a fraction in \(0, 1\]"):
        create_policy("snapkv", keep=keep)


def test_max_tokens_below_what_method_keeps():
    with pytest.raises(KVTrimError, match=r"smaller than the 36 tokens .*4 attention sinks \+ the observation window of 32"):
        create_policy("snapkv", max_tokens=35)
    with pytest.raises(KVTrimError, match=r"4 attention sinks \+ 1 recent token"):
        create_policy("streaming_llm", max_tokens=4)
    with pytest.raises(KVTrimError, match=r"smaller than the 6 tokens .*4 attention sinks \+ one heavy and one recent"):
        create_policy("h2o", max_tokens=5)


def test_keep_and_max_tokens_together():
    with pytest.raises(KVTrimError, match="either keep or max_tokens"):
        create_policy("h2o", keep=0.5, max_tokens=10)


def test_unknown_position_policy():
    with pytest.raises(KVTrimError, match="allowed: true, reassigned, compressed"):
        create_policy("h2o", keep=0.5, position="weird")


def test_prompt_longer_than_context_for_non_streaming(model):
    ids = list(range(3, 123)) * 3  # 360 tokens > 256
    with pytest.raises(KVTrimError, match="cannot stream"):
        generate_ids(model, None, ids, create_policy("snapkv", keep=0.5), max_new_tokens=4)


def test_streaming_method_runs_past_the_context(model):
    ids = (list(range(3, 123)) * 5)[:520]  # 520 tokens, context is 256
    res = generate_ids(model, None, ids, create_policy("streaming_llm", max_tokens=64), max_new_tokens=4, stop_at_eos=False)
    assert res.stored_tokens <= 64 + 4 and res.new_tokens == 4


def test_empty_prompt(model):
    with pytest.raises(KVTrimError, match="prompt is empty"):
        generate_ids(model, None, [], create_policy("full"))


def test_batch_above_one_is_refused(model):
    ids = torch.randint(3, 128, (2, 10))
    with kvtrim.attach(model), pytest.raises(KVTrimError, match="batch size 1"):
        model(input_ids=ids, past_key_values=KVTrimCache(model, "snapkv", keep=0.5), use_cache=True)


def test_cache_without_attach_is_refused(model, prompt):
    with pytest.raises(KVTrimError, match=r"kvtrim\.attach"), torch.no_grad():
        model(input_ids=prompt, past_key_values=KVTrimCache(model, "snapkv", keep=0.5), use_cache=True)


@pytest.mark.parametrize("q,past,chunk", [(37, 0, 8), (37, 11, 8), (20, 5, 64), (16, 0, 16)])
def test_causal_column_sums_equal_dense_softmax(q, past, chunk):
    """Chunked column sums (only the lower triangle computed) equal the dense masked softmax's."""
    from kvtrim.scores import causal_column_sums

    g = torch.Generator().manual_seed(q + past)
    query = torch.randn(1, 6, q, 8, generator=g)
    key = torch.randn(1, 2, past + q, 8, generator=g)
    got = causal_column_sums(query, key, 0.35, chunk=chunk)
    logits = torch.einsum("bhgqd,bhkd->bhgqk", query.reshape(1, 2, 3, q, 8), key) * 0.35
    visible = torch.arange(past + q)[None, :] <= (past + torch.arange(q))[:, None]
    want = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1).sum(-2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_rotate_by_distinct_deltas_equals_elementwise():
    """rotate() computes cos/sin once per distinct integer delta; the result equals the per-element path."""
    from kvtrim.rope import rotate

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 300, 64, generator=g)
    delta = torch.randint(-5, 3, (1, 3, 300), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    torch.testing.assert_close(rotate(x, delta, inv_freq), rotate(x, delta.double(), inv_freq), rtol=0, atol=1e-6)


def test_keep_indices_per_head_matches_gather(model, prompt):
    """Per-head keep sets (one flat index_select) keep exactly the gathered keys, values and positions."""
    cache = KVTrimCache(model, "full")
    with torch.inference_mode(), kvtrim.attach(model):
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    layer = cache.compressed_layers[0]
    n, h = layer.length, layer.keys.shape[1]
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(n, generator=g)[: n // 2].sort().values for _ in range(h)]).unsqueeze(0)
    want_k = torch.gather(layer.keys, 2, idx.unsqueeze(-1).expand(*idx.shape, layer.keys.shape[-1]))
    want_v = torch.gather(layer.values, 2, idx.unsqueeze(-1).expand(*idx.shape, layer.values.shape[-1]))
    want_p = torch.gather(layer.positions, 2, idx)
    layer.keep_indices(idx)
    assert layer.length == n // 2
    assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v)
    assert torch.equal(layer.positions, want_p)


# --- layer state: state_dict / load_state_dict --------------------------------------------------------
def _filled_cache(model, prompt, method="h2o", **kw):
    """A cache after a prefill and three decode steps (h2o with reassigned positions: rotations and
    a per-token state, both exercised)."""
    cache = KVTrimCache(model, method, **(kw or {"keep": 0.5, "position": "reassigned"}))
    with kvtrim.attach(model):
        logits = run_loop(model, prompt, cache, steps=3)
    return cache, logits[-1].argmax(-1, keepdim=True)


def _continue(model, cache, tok, steps=4):
    out = []
    with torch.no_grad(), kvtrim.attach(model):
        for _ in range(steps):
            logits = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1]
            out.append(logits)
            tok = logits.argmax(-1, keepdim=True)
    return out


@pytest.mark.parametrize("method, kw", [("h2o", {"keep": 0.5, "position": "reassigned"}), ("snapkv", {"keep": 0.5}),
                                        ("elastic", {"keep": 0.5, "proportional": True})])
def test_layer_state_round_trip_continues_identically(model, prompt, method, kw):
    cache, tok = _filled_cache(model, prompt, method, **kw)
    tensors, meta = cache.state_dict(), cache.state_meta()
    layer = cache.compressed_layers[0]
    own = persistence.layer_state_dict(layer)
    assert set(own) == {"keys", "values", "positions", *(["rotations"] if kw.get("position") == "reassigned" else []),
                        *(f"state.{n}" for n in layer.token_state)}
    assert all(t.is_contiguous() and t.shape[2] == layer.length for t in own.values())
    assert torch.equal(tensors["layers.0.keys"], layer.keys) and torch.equal(tensors["layers.0.positions"], layer.positions)

    fresh = KVTrimCache(model, method, **kw)
    fresh.load_state_dict(tensors, meta)
    assert fresh.state_meta() == meta
    got = fresh.state_dict()
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)
    for a, b in zip(cache.compressed_layers, fresh.compressed_layers):
        assert b.capacity == b.length + b.slack(b.length)  # rebuilt with the usual slack
        assert (a.seen, a.phase, a.n_new) == (b.seen, b.phase, b.n_new)
    for x, y in zip(_continue(model, cache, tok), _continue(model, fresh, tok)):
        assert torch.equal(x, y)


def test_layer_state_of_an_unused_layer_round_trips(model):
    cache = KVTrimCache(model, "snapkv", keep=0.5)
    layer = cache.compressed_layers[0]
    assert persistence.layer_state_dict(layer) == {}
    fresh = KVTrimCache(model, "snapkv", keep=0.5)
    fresh.load_state_dict({}, cache.state_meta())
    assert not fresh.compressed_layers[0].is_initialized and fresh.state_meta() == cache.state_meta()


def _bad(tensors, key, value):
    out = dict(tensors)
    if value is None:
        del out[key]
    else:
        out[key] = value
    return out


def test_layer_load_refuses_inconsistent_input(model, prompt):
    cache, _ = _filled_cache(model, prompt)
    layer = cache.compressed_layers[0]
    t, m = persistence.layer_state_dict(layer), persistence.layer_state_meta(layer)
    n = layer.length
    fresh = KVTrimCache(model, "h2o", keep=0.5, position="reassigned").compressed_layers[0]
    cases = [
        (_bad(t, "keys", None), m, r"missing \['keys'\]"),
        (_bad(t, "rotations", None), m, r"missing \['rotations'\]"),
        (_bad(t, "extra", t["positions"]), m, r"unexpected \['extra'\]"),
        (_bad(t, "state.h2o_acc", None), m, r"missing \['state.h2o_acc'\]"),
        (_bad(t, "positions", t["positions"][:, :, :-1]), m, r"positions has shape .*expected"),
        (_bad(t, "state.h2o_acc", t["state.h2o_acc"][:, :1]), m, r"state.h2o_acc has shape"),
        (_bad(t, "values", t["values"][:, :, :-1]), m, r"keys .* and values .* must both be"),
        (_bad(t, "keys", t["keys"][0]), m, r"must both be \[batch, kv_heads, stored, dim\]"),
        (_bad(t, "positions", t["positions"].float()), m, "positions must be int64"),
        (_bad(t, "positions", t["positions"] + m["seen"]), m, r"stream indices must lie in \[0, "),
        (t, {**m, "length": n - 1}, f"{n} stored keys but length {n - 1}"),
        (t, {**m, "length": m["seen"] + 1}, "length must be an integer in"),
        (t, {**m, "phase": "warmup"}, "phase must be one of prefill, turn, decode"),
        (t, {**m, "seen": -1}, "seen must be a non-negative integer"),
        (t, {k: v for k, v in m.items() if k != "n_new"}, "lacks n_new"),
        (t, {**m, "initialized": False}, "uninitialised layer cannot store"),
    ]
    for tensors, meta, message in cases:
        with pytest.raises(KVTrimError, match=message):
            persistence.load_layer_state(fresh, tensors, meta)
        assert not fresh.is_initialized and fresh.length == 0 and fresh.seen == 0  # left reset
    heads = {k: v[:, :1] for k, v in t.items()}
    with pytest.raises(KVTrimError, match="1 KV heads saved, the model has 2"):
        persistence.load_layer_state(fresh, heads, m)
    true_pos = KVTrimCache(model, "h2o", keep=0.5).compressed_layers[0]  # position "true": no rotations
    with pytest.raises(KVTrimError, match=r"unexpected \['rotations'\]"):
        persistence.load_layer_state(true_pos, t, m)


def test_cache_load_refuses_wrong_layers(model, prompt):
    cache, _ = _filled_cache(model, prompt)
    tensors, meta = cache.state_dict(), cache.state_meta()
    fresh = KVTrimCache(model, "h2o", keep=0.5, position="reassigned")
    with pytest.raises(KVTrimError, match="saved state has 2 layers, the model has 3"):
        fresh.load_state_dict(tensors, meta[:2])
    with pytest.raises(KVTrimError, match=r"unexpected tensor 'layers\.9\.keys'"):
        fresh.load_state_dict({**tensors, "layers.9.keys": tensors["layers.0.keys"]}, meta)
    with pytest.raises(KVTrimError, match="unexpected tensor 'rng_state'"):
        fresh.load_state_dict({**tensors, "rng_state": torch.zeros(3)}, meta)
    with pytest.raises(KVTrimError, match="layer 1: the saved state and the model disagree"):
        fresh.load_state_dict(tensors, [meta[0], None, meta[2]])


def test_causal_prob_chunks_rows_equal_dense_and_reuse_one_workspace():
    """Every chunk's rows equal the dense masked softmax's (batch 2, GQA, past keys, a short last
    chunk), and every chunk is written into the same two buffers (no allocation per chunk)."""
    from kvtrim.scores import causal_prob_chunks

    g = torch.Generator().manual_seed(5)
    b, q, past = 2, 21, 7
    query = torch.randn(b, 6, q, 8, generator=g)
    key = torch.randn(b, 2, past + q, 8, generator=g)
    logits = torch.einsum("bhgqd,bhkd->bhgqk", query.reshape(b, 2, 3, q, 8), key) * 0.35
    visible = torch.arange(past + q)[None, :] <= (past + torch.arange(q))[:, None]
    want = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
    storages, seen = set(), []
    for start, stop, probs in causal_prob_chunks(query, key, 0.35, chunk=8):
        torch.testing.assert_close(probs, want[..., start:stop, : past + stop], rtol=1e-5, atol=1e-6)
        storages.add(probs.untyped_storage().data_ptr())
        seen.append((start, stop))
    assert seen == [(0, 8), (8, 16), (16, 21)]
    assert len(storages) == 1


def test_a_parameter_added_later_keeps_earlier_results_keys():
    """snapkv's ``layers`` came after sweeps were recorded: at its default it is not in describe(), so
    an eval line recorded before names the same configuration; set, it is."""
    from kvtrim.eval.store import config_params

    assert "layers" not in config_params("snapkv", 0.25)
    assert config_params("snapkv:layers=pyramid", 0.25)["layers"] == "pyramid"
    assert create_policy("snapkv", keep=0.25, layers="pyramid").describe()["layers"] == "pyramid"
