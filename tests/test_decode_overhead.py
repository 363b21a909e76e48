"""The cheap decode paths give what the plain ones gave (tiny random GQA Llama, CPU, fp32).

A decode step of a compressing method avoids work that does not change its result: H2O (and Elastic
Cache's ``frequency`` eviction, Inf-MLLM's trim step) score the step from its own attention instead
of computing ``q @ K`` again (``kvtrim.scores.decode_attention``); a few evicted tokens move one side
of the hole instead of the whole cache (``CompressedLayer.keep_indices``, ``drop_slots``); under
``reassigned`` positions only the keys that change place relative to the others are re-rotated
(``rot_offset``). Each test pits a cheap path against the plain one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.policies.h2o import H2O
from kvtrim.rope import find_inv_freq, rotate
from kvtrim.scores import decode_attention, window_probs


def greedy(model, ids, cache, steps):
    """Prefill + greedy decode inside ``attach``; returns the tokens and the last-position logits."""
    tokens, logits = [], []
    with torch.no_grad(), kvtrim.attach(model):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(int(nxt))
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return tokens, logits


@dataclass
class PlainH2O(H2O):
    """H2O on the plain paths: SDPA plus a second ``q @ K`` pass, evictions as kept slots (``Keep``,
    ``keep_indices``) instead of dropped ones (``DropSlots``)."""

    def wants_decode_probs(self, layer) -> bool:
        return False

    def on_decode(self, layer, query, key, scaling):
        self._accumulate(layer, query, key, scaling)
        return self.evict_by_score(layer, query, key, scaling)


def test_decode_attention_matches_sdpa_and_gives_window_probs():
    """Output within the tolerance rule of SDPA's (error against float64 at most twice SDPA's), and
    probabilities bit for bit those a policy computed before (``window_probs`` of the one row)."""
    g = torch.Generator().manual_seed(0)
    for s, d, n_kv, groups in ((63, 64, 2, 3), (500, 128, 1, 4), (4001, 64, 3, 3)):
        q = torch.randn(1, n_kv * groups, 1, d, generator=g)
        k, v = torch.randn(1, n_kv, s, d, generator=g), torch.randn(1, n_kv, s, d, generator=g)
        scale = d ** -0.5
        out, probs = decode_attention(q, k, v, scale)
        assert torch.equal(probs, window_probs(q, k, scale, 1))
        kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        ref = F.scaled_dot_product_attention(q.double(), kr.double(), vr.double(), scale=scale).transpose(1, 2)
        sdpa = F.scaled_dot_product_attention(q, kr, vr, scale=scale).transpose(1, 2)
        assert out.shape == sdpa.shape == (1, 1, n_kv * groups, d)
        err, err_sdpa = (out.double() - ref).abs().max(), (sdpa.double() - ref).abs().max()
        assert err <= 2 * err_sdpa, (s, d, float(err), float(err_sdpa))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_in_low_precision_keeps_the_tolerance_rule(dtype):
    """In bfloat16/float16 (both products in float32, the output rounded once) the output's error
    against float64 from the same rounded inputs is at most twice SDPA's in that dtype."""
    g = torch.Generator().manual_seed(1)
    for s, d, n_kv, groups in ((63, 64, 2, 7), (2000, 64, 2, 7), (777, 128, 1, 4)):
        q = torch.randn(1, n_kv * groups, 1, d, generator=g).to(dtype)
        k = torch.randn(1, n_kv, s, d, generator=g).to(dtype)
        v = torch.randn(1, n_kv, s, d, generator=g).to(dtype)
        scale = d ** -0.5
        out, _ = decode_attention(q, k, v, scale)
        assert out.dtype == dtype
        kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        ref = F.scaled_dot_product_attention(q.double(), kr.double(), vr.double(), scale=scale).transpose(1, 2)
        sdpa = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2)
        err, err_sdpa = (out.double() - ref).abs().max(), (sdpa.double() - ref).abs().max()
        assert err <= 2 * err_sdpa, (dtype, s, float(err), float(err_sdpa))


def test_every_cpu_decode_step_goes_through_decode_attention(model, prompt, monkeypatch):
    """On CPU a decode step of any method (here SnapKV, which reads no decode scores, and the full
    cache) takes kvtrim's grouped decode attention instead of SDPA (in bfloat16 and float16; in
    float32 only with ``CPU_DECODE_FP32``), and generates what SDPA does (the same greedy
    tokens, logits within float32 rounding); ``KVTRIM_DECODE_ATTENTION=sdpa`` turns it off."""
    import kvtrim.integrations.hf as hf

    calls = []

    def counting(*a, **k):
        calls.append(a[0].shape)
        return decode_attention(*a, **k)

    def sdpa(q, k, v, scale):  # what the step computed before: SDPA (and the probabilities from q @ K)
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2).contiguous()
        return out, window_probs(q, k, scale, 1)

    for method in ("snapkv", "full"):
        kw = {} if method == "full" else {"keep": 0.5}
        # float32: SDPA stays by default, kvtrim's attention is not called
        monkeypatch.setattr(hf, "decode_attention", counting)
        greedy(model, prompt, KVTrimCache(model, method, **kw), 2)
        assert not calls, method
        monkeypatch.setattr(hf, "CPU_DECODE_FP32", True)
        monkeypatch.setattr(hf, "CPU_DECODE_MIN_KEYS", 0)  # as in bfloat16 and float16 over a longer cache
        monkeypatch.setattr(hf, "decode_attention", sdpa)
        want, want_logits = greedy(model, prompt, KVTrimCache(model, method, **kw), 6)
        monkeypatch.setattr(hf, "decode_attention", counting)
        got, got_logits = greedy(model, prompt, KVTrimCache(model, method, **kw), 6)
        monkeypatch.undo()
        n_layers = model.config.num_hidden_layers
        assert len(calls) == 6 * n_layers and all(c[-2] == 1 for c in calls), method
        calls.clear()
        assert got == want
        for a, b in zip(got_logits, want_logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(hf, "CPU_DECODE_FP32", True)
    monkeypatch.setattr(hf, "CPU_DECODE_MIN_KEYS", 0)
    monkeypatch.setattr(hf, "decode_attention", counting)
    monkeypatch.setenv("KVTRIM_DECODE_ATTENTION", "sdpa")
    greedy(model, prompt, KVTrimCache(model, "snapkv", keep=0.5), 2)
    assert not calls
    monkeypatch.setenv("KVTRIM_DECODE_ATTENTION", "fast")
    with pytest.raises(kvtrim.KVTrimError, match="KVTRIM_DECODE_ATTENTION"):
        greedy(model, prompt, KVTrimCache(model, "snapkv", keep=0.5), 2)


def test_h2o_cheap_decode_keeps_what_the_plain_path_keeps(model, prompt):
    """Scores from the decode attention and holes filled by the newest token: the same tokens are
    generated and the same token set is kept per head, with the same accumulated scores."""
    fast, plain = KVTrimCache(model, H2O(max_tokens=40)), KVTrimCache(model, PlainH2O(max_tokens=40))
    got, _ = greedy(model, prompt, fast, 12)
    want, _ = greedy(model, prompt, plain, 12)
    assert got == want
    for a, b in zip(fast.compressed_layers, plain.compressed_layers):
        assert a.length == b.length == 40
        order_a, order_b = a.positions.argsort(dim=-1), b.positions.argsort(dim=-1)
        assert torch.equal(a.positions.gather(-1, order_a), b.positions.gather(-1, order_b))
        torch.testing.assert_close(a.state_view("h2o_acc").gather(-1, order_a), b.state_view("h2o_acc").gather(-1, order_b),
                                   rtol=1e-5, atol=1e-6)
    # the holes were filled from the end: the slots no longer follow the stream everywhere
    assert any(bool((layer.positions.diff(dim=-1) < 0).any()) for layer in fast.compressed_layers)


def test_streaming_decode_keys_sit_at_in_cache_positions_plus_the_offset(model, prompt):
    """After decode-time evictions the kept keys are the model's own keys at in-cache positions
    ``rot_offset + 0..K-1`` (StreamingLLM re-rotated only its sinks), and the next step's logits equal
    those of the same cache re-rotated to ``0..K-1`` (the query is rotated by the offset)."""
    cache = KVTrimCache(model, "streaming_llm", max_tokens=24)
    tokens, _ = greedy(model, prompt, cache, 8)
    full = kvtrim.KVTrimCache(model, "full")
    with torch.no_grad(), kvtrim.attach(model):
        model(input_ids=prompt, past_key_values=full, use_cache=True)
    inv = find_inv_freq(model)
    t = prompt.shape[1]
    for li, layer in enumerate(cache.compressed_layers):
        assert layer.rot_offset > 0
        assert torch.equal(layer.rotations[0, 0], torch.arange(24) + layer.rot_offset)
        # the prompt's keys (the decoded ones depend on the compressed history): sinks and the oldest
        # of the window, each rotated where its in-cache position plus the offset says
        raw = rotate(full.layers[li].keys.double(), -torch.arange(t).double().expand(1, 1, t), inv)
        from_prompt = layer.positions[0, 0] < t
        assert int(from_prompt.sum()) > 4  # the sinks and some of the window
        kept = layer.positions[0, 0][from_prompt]
        expect = rotate(raw[:, :, kept], layer.rotations[:, :, from_prompt].double(), inv).float()
        torch.testing.assert_close(layer.keys[:, :, from_prompt], expect, atol=1e-5, rtol=1e-5)

    # the same cache with keys re-rotated to 0..K-1 (no offset) predicts the same next token
    tensors, meta = cache.state_dict(), cache.state_meta()
    for li, layer in enumerate(cache.compressed_layers):
        tensors[f"layers.{li}.keys"] = rotate(layer.keys, torch.full(layer.rotations.shape, -layer.rot_offset), inv)
        tensors[f"layers.{li}.rotations"] = layer.rotations - layer.rot_offset
    plain = KVTrimCache(model, "streaming_llm", max_tokens=24)
    plain.load_state_dict(tensors, meta)
    assert all(layer.rot_offset == 0 for layer in plain.compressed_layers)
    nxt = torch.tensor([[tokens[-1]]])
    with torch.no_grad(), kvtrim.attach(model):
        a = model(input_ids=nxt, past_key_values=cache, use_cache=True, position_ids=torch.tensor([[24]])).logits
        b = model(input_ids=nxt, past_key_values=plain, use_cache=True, position_ids=torch.tensor([[24]])).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_evictions_near_the_start_move_the_start_and_keep_the_allocation(model, prompt):
    """A decode eviction just after the sinks moves the sinks up (the buffers then start later in the
    same allocation); the kept keys, values and positions equal a plain gather, the allocated bytes
    do not change, and once the end is reached the slots move back without a re-allocation."""
    with torch.inference_mode():
        _evict_near_the_start(model, prompt)


def _evict_near_the_start(model, prompt):
    cache = KVTrimCache(model, "full")
    with kvtrim.attach(model):
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    layer = cache.compressed_layers[0]
    layer.phase = "decode"
    n, h = layer.length, layer.keys.shape[1]
    before = layer.nbytes()
    for step in range(3):
        idx = torch.cat([torch.arange(4), torch.arange(5, layer.length)]).view(1, 1, -1).expand(1, h, -1)
        want = [torch.gather(t, 2, idx if t.dim() == 3 else idx.unsqueeze(-1).expand(*idx.shape, t.shape[-1]))
                for t in (layer.keys, layer.values, layer.positions)]
        layer.keep_indices(idx)
        assert layer.length == n - 1 - step
        assert all(torch.equal(got, w) for got, w in zip((layer.keys, layer.values, layer.positions), want))
        assert layer.nbytes() == before
    assert layer.keys.storage_offset() > 0  # the buffers start later in the same allocation
    kept = [t.clone() for t in (layer.keys, layer.values, layer.positions)]
    storage = layer.keys.untyped_storage().data_ptr()
    layer.awaiting_attention = False
    extra = layer.capacity - layer.length + 1  # one more than fits after the moved start
    k_new = torch.randn(1, h, extra, layer.keys.shape[-1])
    layer.update(k_new, k_new.clone())
    assert layer.keys.untyped_storage().data_ptr() == storage and layer.keys.storage_offset() == 0
    assert layer.nbytes() == before
    assert all(torch.equal(t[:, :, : n - 3], w) for t, w in zip((layer.keys, layer.values, layer.positions), kept))
    assert torch.equal(layer.keys[:, :, n - 3 :], k_new)


class _NoFastDrop:
    """Patch every compressed layer's ``drop_after_lead`` to decline, so StreamingLLM's decode step
    takes the general ``keep_indices`` path."""

    def __init__(self, cache):
        self.cache = cache

    def __enter__(self):
        for layer in self.cache.compressed_layers:
            layer.drop_after_lead = lambda lead: False
        return self.cache

    def __exit__(self, *exc):
        for layer in self.cache.compressed_layers:
            del layer.drop_after_lead


def _stream_state(cache):
    return [(layer.keys.clone(), layer.values.clone(), layer.positions.clone(), layer.rotations.clone(),
             layer.rot_offset, layer.length) for layer in cache.compressed_layers]


def test_streaming_drop_after_lead_equals_keep_indices(model, prompt):
    """StreamingLLM's usual decode step (one token over the budget: the one after the sinks leaves)
    through ``drop_after_lead`` leaves the cache bit for bit as ``keep_indices`` leaves it: the same
    keys (sinks re-rotated by one), values, positions, rotations and offset after every step, and
    the same tokens; under ``reassigned``, ``compressed`` and ``true`` positions and with 0 sinks."""
    for kwargs in ({}, {"position": "compressed"}, {"position": "true"}, {"sinks": 0}):
        _fast_and_plain_streaming(model, prompt, kwargs)


def _fast_and_plain_streaming(model, prompt, kwargs):
    caches = [KVTrimCache(model, "streaming_llm", max_tokens=24, **kwargs) for _ in range(2)]
    calls = []
    with torch.no_grad(), kvtrim.attach(model):
        outs = [model(input_ids=prompt, past_key_values=c, use_cache=True) for c in caches]
        fast_layer = caches[0].compressed_layers[0]
        orig = fast_layer.drop_after_lead
        fast_layer.drop_after_lead = lambda lead: calls.append((lead, orig(lead))) or calls[-1][1]
        for _ in range(6):
            nxt = [o.logits[:, -1:].argmax(-1) for o in outs]
            assert torch.equal(nxt[0], nxt[1])
            outs[0] = model(input_ids=nxt[0], past_key_values=caches[0], use_cache=True)
            with _NoFastDrop(caches[1]):
                outs[1] = model(input_ids=nxt[1], past_key_values=caches[1], use_cache=True)
            for a, b in zip(_stream_state(caches[0]), _stream_state(caches[1])):
                assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4])) and a[4:] == b[4:], kwargs
            assert torch.equal(outs[0].logits, outs[1].logits), kwargs
    assert calls and all(c == (kwargs.get("sinks", 4), True) for c in calls), (kwargs, calls)  # the fast path ran


def test_drop_after_lead_declines_where_keep_indices_chooses_otherwise(model, prompt):
    """A lead longer than a fifth of what stays (keep_indices then keeps the oldest key's rotation
    and re-rotates the rest), and a phase other than decode: nothing changes, False is returned."""
    cache = KVTrimCache(model, "full", position="reassigned")
    with torch.no_grad(), kvtrim.attach(model):
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    layer = cache.compressed_layers[0]
    before = (layer.keys.clone(), layer.length, layer.rot_offset)
    assert not layer.drop_after_lead(4)  # phase is prefill
    layer.phase = "decode"
    assert not layer.drop_after_lead(layer.length // 5 + 1)
    assert torch.equal(layer.keys, before[0]) and (layer.length, layer.rot_offset) == before[1:]
    assert layer.drop_after_lead(2) and layer.length == before[1] - 1 and layer.rot_offset == 1


def test_drop_slots_keeps_what_keep_indices_keeps(model):
    """One slot per head (the decode step's fast path, including a head whose newest slot is the
    one dropped) and several per head (the general path): per head, the same (position, key, value,
    state) rows remain as ``keep_indices`` leaves, and the length shrinks by the drops."""
    g = torch.Generator().manual_seed(3)
    for drops in ([[5], [29], [0]], [[2, 7, 29], [0, 1, 28], [10, 11, 12]]):
        caches = [KVTrimCache(model, H2O(max_tokens=40)) for _ in range(2)]
        n = 30
        h = caches[0].num_kv_heads
        drop = torch.tensor(drops[:h]).unsqueeze(0)
        keys, values = torch.randn(1, h, n, caches[0].head_dim, generator=g), torch.randn(1, h, n, caches[0].head_dim, generator=g)
        acc = torch.rand(1, h, n, generator=g)
        pos = torch.arange(n).view(1, 1, n).expand(1, h, n).contiguous()
        for c in caches:
            meta = [{"initialized": True, "seen": n, "length": n, "phase": "decode", "n_new": 1,
                     "token_state": ["h2o_acc"], "state": {}} for _ in c.layers]
            tensors = {}
            for i in range(len(c.layers)):
                tensors.update({f"layers.{i}.keys": keys, f"layers.{i}.values": values, f"layers.{i}.positions": pos,
                                f"layers.{i}.state.h2o_acc": acc})
            c.load_state_dict(tensors, meta)
        fast, ref = caches[0].compressed_layers[0], caches[1].compressed_layers[0]
        fast.drop_slots(drop)
        keep = torch.ones(1, h, n, dtype=torch.bool).scatter_(-1, drop, False)
        ref.keep_indices(keep.nonzero()[:, -1].view(1, h, -1))
        m = drop.shape[-1]
        assert fast.length == ref.length == n - m
        order = fast.positions.argsort(dim=-1)
        assert torch.equal(fast.positions.gather(-1, order), ref.positions)
        assert torch.equal(fast.keys.gather(2, order.unsqueeze(-1).expand_as(fast.keys)), ref.keys)
        assert torch.equal(fast.values.gather(2, order.unsqueeze(-1).expand_as(fast.values)), ref.values)
        assert torch.equal(fast.state_view("h2o_acc").gather(-1, order), ref.state_view("h2o_acc"))
        for hd in range(h):
            assert not set(drop[0, hd].tolist()) & set(fast.positions[0, hd].tolist())


def _filled_pair(model, policy_name, n, position):
    """Two caches whose every layer holds the same random ``n`` tokens in decode phase."""
    g = torch.Generator().manual_seed(n)
    caches = [KVTrimCache(model, policy_name, max_tokens=n + 8, position=position) for _ in range(2)]
    h, d = caches[0].num_kv_heads, caches[0].head_dim
    keys, values = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g)
    pos = torch.arange(n).view(1, 1, n).expand(1, h, n).contiguous()
    for c in caches:
        meta = [{"initialized": True, "seen": n, "length": n, "phase": "decode", "n_new": 1, "token_state": [],
                 "state": {}} for _ in c.layers]
        tensors = {}
        for i in range(len(c.layers)):
            tensors.update({f"layers.{i}.keys": keys, f"layers.{i}.values": values, f"layers.{i}.positions": pos})
            if position != "true":
                tensors[f"layers.{i}.rotations"] = pos
        c.load_state_dict(tensors, meta)
    return caches


@pytest.mark.parametrize("position", ["reassigned", "compressed", "true"])
def test_drop_slot_equals_keep_indices(model, position):
    """Dropping one slot in every head, order kept (Elastic Cache's fixed-point eviction): for every
    slot, front half (drop_after_lead, or its refusal) and back half (the tail moves down and,
    under ``reassigned``, is re-rotated by one), the layer is bit for bit what ``keep_indices``
    leaves: keys, values, positions, rotations, offset and length."""
    n = 30
    for slot in range(n):
        fast, ref = (c.compressed_layers[0] for c in _filled_pair(model, "elastic", n, position))
        took = fast.drop_slot(slot)
        if not took:  # declined (a front lead keep_indices re-rotates otherwise): changed nothing
            assert fast.length == n
            fast.keep_indices(torch.cat([torch.arange(slot), torch.arange(slot + 1, n)]).view(1, 1, -1).expand(1, fast.keys.shape[1], -1))
        ref.keep_indices(torch.cat([torch.arange(slot), torch.arange(slot + 1, n)]).view(1, 1, -1).expand(1, ref.keys.shape[1], -1))
        assert took or 5 * slot > n - 1, slot  # the fast path declines only where drop_after_lead does
        assert fast.length == ref.length == n - 1 and fast.rot_offset == ref.rot_offset, slot
        assert torch.equal(fast.keys, ref.keys) and torch.equal(fast.values, ref.values), slot
        assert torch.equal(fast.positions, ref.positions), slot
        if position != "true":
            assert torch.equal(fast.rotations, ref.rotations), slot
    layer = _filled_pair(model, "elastic", n, position)[0].compressed_layers[0]
    assert not layer.drop_slot(n) and not layer.drop_slot(-1) and layer.length == n
    layer.phase = "turn"
    assert not layer.drop_slot(n - 2) and layer.length == n


def test_elastic_decode_with_drop_slot_equals_keep_indices(model, prompt):
    """Elastic Cache's decode steps through ``drop_slot`` give the same tokens, logits and cache as
    through ``keep_indices``, step after step."""
    caches = [KVTrimCache(model, "elastic", max_tokens=24) for _ in range(2)]
    calls = []
    with torch.no_grad(), kvtrim.attach(model):
        outs = [model(input_ids=prompt, **c.kwargs(), use_cache=True) for c in caches]
        fast_layer = caches[0].compressed_layers[0]
        orig = fast_layer.drop_slot
        fast_layer.drop_slot = lambda slot: calls.append(orig(slot)) or calls[-1]
        for layer in caches[1].compressed_layers:
            layer.drop_slot = lambda slot: False
        for _ in range(6):
            nxt = [o.logits[:, -1:].argmax(-1) for o in outs]
            assert torch.equal(nxt[0], nxt[1])
            outs = [model(input_ids=x, **c.kwargs(), use_cache=True) for x, c in zip(nxt, caches)]
            for a, b in zip(_stream_state(caches[0]), _stream_state(caches[1])):
                assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4])) and a[4:] == b[4:]
            assert torch.equal(outs[0].logits, outs[1].logits)
    assert calls and all(calls)  # the fast path ran, every step
