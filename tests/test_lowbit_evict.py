"""A low-bit layer's in-place decode evictions against the gather they replace (tiny random GQA Llama, CPU).

A decode step that drops a few slots (StreamingLLM's ``DropLead``, H2O's ``DropSlots``, Elastic Cache's
front-half ``DropSlot``) moves a few slots of the quantized part in place (``LowBitLayer.drop_lead``,
``fill_dropped``) instead of gathering every kept slot into new tensors (``keep_indices``). Each test
runs two caches on the same tokens, one with the in-place paths declined, and compares them after
every step: kept positions, rotations, dequantized keys and values, key groups, stored bytes, the
decode attention (docs/style.md's tolerance rule against a float64 reference) and the model's logits.
"""

from __future__ import annotations

import pytest
import torch

import kvtrim
from kvtrim import decoding
from kvtrim.attention.lowbit import BITS
from kvtrim.cache import KVTrimCache
from kvtrim.lowbit_storage import LowBitLayer


def _prompt(n, seed):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _gather_only(cache):
    """Decline every in-place path of the cache's layers: each decision is the gather of its kept slots."""
    for layer in cache.compressed_layers:
        layer.drop_lead = lambda lead, count: False
        layer.drop_slot = lambda slot: False
        layer.fill_dropped = lambda drop: False


def _counting(cache):
    """Record the in-place drops the cache's layers make (the fast path must run): for ``drop_lead``
    whether it ran, for ``fill_dropped`` whether it ran and whether every dropped slot was quantized."""
    took: list = []
    for layer in cache.compressed_layers:
        lead, fill = layer.drop_lead, layer.fill_dropped
        layer.drop_lead = lambda *a, _f=lead: took.append(_f(*a)) or took[-1]
        layer.fill_dropped = lambda drop, _f=fill, _l=layer: (
            took.append((None, bool((drop < _l.n_quantized).all()))) or took.__setitem__(-1, (_f(drop), took[-1][1]))
            or took[-1][0])
    return took


def _by_position(layer):
    """The layer's positions, rotations, dequantized keys and values, each head's slots sorted by stream index."""
    order = layer.positions.argsort(dim=-1)

    def rows(t):
        return t.gather(2, order if t.dim() == 3 else order.unsqueeze(-1).expand_as(t))

    return [rows(t) for t in (layer.positions, layer.rotations, layer.keys, layer.values)]


def _dead_bytes(cache):
    """Bytes of the quantized slots an in-place drop left in their allocation (freed at the next pack)."""
    total = 0
    for layer in cache.compressed_layers:
        kv = layer.lowbit
        per_slot = sum(t[:, :, :1].numel() * t.element_size() for t in (kv.key_codes, kv.key_group, kv.value_codes,
                                                                        kv.value_scale, kv.value_zero))
        total += (kv.allocated() - kv.length) * per_slot
    return total


def _attention_within_rule(fast, ref, seed):
    """docs/style.md's tolerance rule for the decode attention over the two layers: against float64
    attention over the same dequantized keys and values, the in-place layer's error is at most twice
    the gathered layer's (both computed by the same kernel; only the slot order may differ)."""
    hkv, d = ref.keys.shape[1], ref.keys.shape[-1]
    q = torch.randn(1, 3 * hkv, 1, d, generator=torch.Generator().manual_seed(seed))

    def exact(layer):
        logits = torch.matmul(q.double().view(1, hkv, -1, d), layer.keys.double().transpose(-1, -2)) * 0.25
        return torch.matmul(torch.softmax(logits, -1), layer.values.double()).reshape(1, -1, 1, d).transpose(1, 2)

    err = {}
    for name, layer in (("fast", fast), ("ref", ref)):
        out, probs = layer.decode_attention(q, 0.25)
        err[name] = float((out.double() - exact(layer)).abs().max())
        assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)
    assert err["fast"] <= 2 * err["ref"] + 1e-12, err


def _two_caches(model, method, bits, **kw):
    caches = [KVTrimCache(model, method, kv_bits=bits, **kw) for _ in range(2)]
    _gather_only(caches[1])
    return caches


@pytest.mark.parametrize("bits, kw", [(8, {}), (4, {}), (2, {}), (4, {"sinks": 0}), (4, {"position": "true"}),
                                      (2, {"position": "compressed"})])
def test_streaming_in_place_equals_the_gather(model, bits, kw):
    """StreamingLLM (the token after the sinks leaves at every step) over 70 decode steps past a
    48-token budget, so that key groups empty and are freed and new ones are packed: the in-place layer
    holds bit for bit what the gather leaves (positions, rotations and offset, dequantized keys and
    values, group count, quantized length) and gives the same logits; its stored bytes are equal and
    its resident bytes exceed them by exactly the freed slots still allocated, none once a group is
    packed; the quantized part is not re-allocated between packs."""
    fast, ref = _two_caches(model, "streaming_llm", bits, max_tokens=48, **kw)
    took = _counting(fast)
    packs = moved = 0
    with torch.inference_mode(), kvtrim.attach(model):
        logits = [decoding.run(model, decoding.prefill(c, _prompt(90, 1))) for c in (fast, ref)]
        for step, tok in enumerate(_prompt(70, 2)):
            ptr = [layer.lowbit.key_codes.untyped_storage().data_ptr() for layer in fast.compressed_layers]
            logits = [decoding.run(model, decoding.prefill(c, [tok])) for c in (fast, ref)]
            assert torch.equal(logits[0], logits[1]), step
            for a, b, p in zip(fast.compressed_layers, ref.compressed_layers, ptr):
                assert (a.length, a.n_quantized, a.n_res, a.rot_offset) == (b.length, b.n_quantized, b.n_res, b.rot_offset)
                assert a.lowbit.groups == b.lowbit.groups, step
                assert all(torch.equal(x, y) for x, y in zip(
                    (a.positions, a.rotations, a.keys, a.values), (b.positions, b.rotations, b.keys, b.values))), step
                if a.lowbit.allocated() == a.n_quantized:
                    packs += 1
                else:  # dropped in place since the last pack: the same allocation
                    moved += a.lowbit.key_codes.untyped_storage().data_ptr() == p
            assert fast.kv_bytes_stored() == ref.kv_bytes_stored()
            assert fast.kv_bytes() == ref.kv_bytes() + _dead_bytes(fast), step
        _attention_within_rule(fast.compressed_layers[1], ref.compressed_layers[1], seed=bits)
    assert took and all(took), "the in-place path ran at every step"
    assert packs and moved > 30  # both states were seen


@pytest.fixture(scope="module")
def one_layer():
    from conftest import tiny_llama

    return tiny_llama(layers=1)


@pytest.mark.parametrize("bits", BITS)
def test_h2o_in_place_keeps_the_gathers_set(one_layer, bits):
    """H2O (its lowest-scored slot of each head leaves at every step, ``DropSlots``) over 60 decode
    steps: the in-place layer fills each hole with its last quantized slot, so per head it holds the
    same tokens as the gather in another order. Sorted by stream index, the positions, dequantized keys
    and values are bit for bit the gather's; the accumulated scores and the logits differ only by the
    order the attention sums its slots in; the bytes are as for StreamingLLM. One layer: its keys and
    values depend on the tokens alone (a later layer's would carry the earlier attention's rounding into
    its codes), so the stored tokens can be compared bit for bit."""
    model = one_layer
    fast, ref = _two_caches(model, "h2o", bits, max_tokens=128)
    took = _counting(fast)
    with torch.inference_mode(), kvtrim.attach(model):
        for c in (fast, ref):
            decoding.run(model, decoding.prefill(c, _prompt(200, 3)))
        for step, tok in enumerate(_prompt(60, 4)):
            logits = [decoding.run(model, decoding.prefill(c, [tok])) for c in (fast, ref)]
            torch.testing.assert_close(logits[0], logits[1], atol=2e-6, rtol=0)  # slot order only: measured <= 3e-7
            for a, b in zip(fast.compressed_layers, ref.compressed_layers):
                assert (a.length, a.n_quantized, a.lowbit.groups) == (b.length, b.n_quantized, b.lowbit.groups), step
                assert all(torch.equal(x, y) for x, y in zip(_by_position(a), _by_position(b))), step
                order_a, order_b = a.positions.argsort(-1), b.positions.argsort(-1)
                torch.testing.assert_close(a.state_view("h2o_acc").gather(-1, order_a),
                                           b.state_view("h2o_acc").gather(-1, order_b), atol=1e-5, rtol=1e-5)
            assert fast.kv_bytes_stored() == ref.kv_bytes_stored()
            assert fast.kv_bytes() == ref.kv_bytes() + _dead_bytes(fast), step
        for a, b in zip(fast.compressed_layers, ref.compressed_layers):
            _attention_within_rule(a, b, seed=bits)
    # in place wherever every head drops a quantized slot; a drop among the residual's tokens is gathered
    assert took and all(ran == quantized for ran, quantized in took) and sum(ran for ran, _ in took) > 30, took


def test_in_place_drops_decline_where_the_gather_must_run(model):
    """Outside a decode step, with a drop in the residual, with rotated keys for ``fill_dropped``, a
    lead ``keep_indices`` would re-rotate otherwise, or a slot in the back half: nothing changes and
    False is returned (the caller gathers)."""
    with torch.inference_mode(), kvtrim.attach(model):
        cache = KVTrimCache(model, "full", kv_bits=4, position="reassigned")
        decoding.run(model, decoding.prefill(cache, _prompt(90, 5)))
        layer = cache.compressed_layers[0]
        assert isinstance(layer, LowBitLayer) and layer.n_quantized == 64 and layer.n_res == 26
        before = (layer.positions.clone(), layer.rotations.clone(), layer.lowbit.key_codes.clone())
        assert not layer.drop_lead(4, 1)  # phase is prefill
        layer.phase = "decode"
        assert not layer.drop_lead(63, 2)  # a dropped slot in the residual
        assert not layer.drop_lead(layer.length // 5 + 1, 1)  # keep_indices would keep the oldest rotation
        assert not layer.fill_dropped(torch.tensor([[[3], [5]]]))  # rotated keys follow the slot order
        assert not layer.drop_slot(60)  # the back half
        assert layer.length == 90 and layer.rot_offset == 0
        assert all(torch.equal(x, y) for x, y in zip((layer.positions, layer.rotations, layer.lowbit.key_codes), before))
        assert layer.drop_lead(4, 1) and layer.length == 89 and layer.rot_offset == 1

        cache = KVTrimCache(model, "full", kv_bits=4)
        decoding.run(model, decoding.prefill(cache, _prompt(90, 5)))
        layer = cache.compressed_layers[0]
        layer.phase = "decode"
        assert not layer.fill_dropped(torch.tensor([[[3], [70]]]))  # one head's drop is in the residual
        assert layer.length == 90
        assert layer.fill_dropped(torch.tensor([[[3], [63]]])) and layer.length == 89 and layer.n_quantized == 63
        assert sorted(layer.positions[0, 0].tolist()) == [p for p in range(90) if p != 3]
        assert sorted(layer.positions[0, 1].tolist()) == [p for p in range(90) if p != 63]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("drops", [[[5], [95], [0]], [[2, 7, 95], [0, 1, 94], [40, 41, 42]], [[33, 34, 64]] * 3])
def test_fill_holes_keeps_what_take_keeps(bits, drops):
    """``LowBitKV.fill_holes`` (one or several slots per head, a head's last slot among them) against
    ``take`` of the kept slots, in order: per head the same slots (tracked through ``also``) with the same
    dequantized keys and values, and the same key groups (three of 32 slots; none emptied here: group
    freeing is ``test_drop_lead_frees_an_emptied_group``'s and the model tests')."""
    from kvtrim.attention.lowbit import LowBitKV

    g = torch.Generator().manual_seed(bits)
    h, n, d = 3, 96, 16
    kv = LowBitKV.empty(bits, 1, h, d, d, "cpu")
    kv.append_groups(torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g), 32)
    drop = torch.tensor(drops).unsqueeze(0)
    keep = torch.ones(1, h, n, dtype=torch.bool).scatter_(-1, drop, False).nonzero()[:, -1].view(1, h, -1)
    ref = kv.take(keep)
    ref.compact()
    ids = torch.arange(n).view(1, 1, n).repeat(1, h, 1)
    ptr = kv.key_codes.untyped_storage().data_ptr()
    kv.fill_holes(drop, also=[ids])
    k = n - drop.shape[-1]
    assert kv.length == k and kv.allocated() == n and kv.key_codes.untyped_storage().data_ptr() == ptr
    assert kv.groups == ref.groups
    order = ids[:, :, :k].argsort(-1)
    assert torch.equal(ids[:, :, :k].gather(-1, order), keep)
    for got, want in ((kv.keys(), ref.keys()), (kv.values(), ref.values())):
        assert torch.equal(got.gather(2, order.unsqueeze(-1).expand_as(got)), want)


def test_drop_lead_frees_an_emptied_group():
    """``LowBitKV.drop_lead`` frees the key group whose last slot it drops, as ``take`` + ``compact`` does."""
    from kvtrim.attention.lowbit import LowBitKV

    g = torch.Generator().manual_seed(0)
    kv = LowBitKV.empty(4, 1, 2, 16, 16, "cpu")
    kv.append_groups(torch.randn(1, 2, 96, 16, generator=g), torch.randn(1, 2, 96, 16, generator=g), 32)
    keep = torch.cat([torch.arange(4), torch.arange(64, 96)]).view(1, 1, -1).expand(1, 2, -1)
    ref = kv.take(keep)
    ref.compact()
    kv.drop_lead(4, 60)  # slots 4:64: the rest of group 0 (its first 4 stay) and all of group 1
    assert kv.groups == ref.groups == 2 and torch.equal(kv.key_group, ref.key_group)
    assert torch.equal(kv.keys(), ref.keys()) and torch.equal(kv.values(), ref.values())
