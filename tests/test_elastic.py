"""Elastic Cache (``elastic``): importance, anchors, merge, elastic budget, fixed-point eviction.

Oracles are independent of the policy's code: transformers' eager attention probabilities for the
importance, the uncompressed ``DynamicCache`` keys/values for the merge.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import eager_attentions, load_benchmark
from transformers import DynamicCache

import kvtrim
from kvtrim import decoding
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.generation import generate_ids
from kvtrim.policies.base import SINKS
from kvtrim.policies.elastic import Elastic, attention_importance, nearest_anchor
from kvtrim.registry import create_policy
from kvtrim.rope import rotate


def _full_kv(model, ids):
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=full, use_cache=True)
    return [(layer.keys, layer.values) for layer in full.layers]


def _prefill(model, ids, **kw):
    cache = KVTrimCache(model, "elastic", **kw)
    with kvtrim.attach(model), torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache, out


def _members(a, anchors, targets, t):
    """Anchor ``a`` and the non-anchor positions whose nearest merge target it is (ties -> earlier)."""
    return [a] + [j for j in range(t) if j not in anchors and min(targets, key=lambda x: (abs(x - j), x)) == a]


def _expected_anchors(attn, budget):
    imp = attn.sum(dim=2).mean(dim=1)[0]  # column sums, averaged over all query heads: [T]
    imp[0] = imp[-1] = float("inf")
    return torch.topk(imp, budget).indices.sort().values


# --- importance --------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["sum", "mean", "ema", "query"])
@pytest.mark.parametrize("q_len,past,chunk", [(63, 0, 256), (63, 0, 7), (40, 25, 9)])
def test_importance_matches_dense_reference(how, q_len, past, chunk):
    torch.manual_seed(0)
    b, n_kv, g, d = 1, 2, 3, 16
    s = q_len + past
    q = torch.randn(b, n_kv * g, q_len, d)
    k = torch.randn(b, n_kv, s, d)
    scale = d**-0.5
    kx = k.double().repeat_interleave(g, dim=1)
    logits = torch.einsum("bhqd,bhkd->bhqk", q.double(), kx) * scale
    qi = torch.arange(past, s).unsqueeze(1)
    logits = logits.masked_fill(torch.arange(s).unsqueeze(0) > qi, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [B, Hq, q, S]
    if how == "ema":
        w = 0.9 ** torch.arange(q_len - 1, -1, -1, dtype=torch.float64) * 0.1
        probs = probs * w.view(1, 1, -1, 1)
    if how == "query":  # only the last ``rows`` queries (the question) count
        probs = probs[:, :, -11:]
    ref = probs.sum(dim=2).mean(dim=1)
    if how == "mean":
        ref = ref / (probs > 0).sum(dim=2)[:, 0].clamp(min=1)
    got = attention_importance(q, k, scale, how, decay=0.9, chunk=chunk, rows=11)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_nearest_anchor_tie_goes_to_the_earlier_anchor():
    pos = torch.arange(11)
    anchors = torch.tensor([0, 4, 10])
    got = nearest_anchor(pos, anchors)
    # 2 is half-way between 0 and 4 -> 0; 7 is half-way between 4 and 10 -> 4
    assert got.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]


# --- prefill: anchors and merge ------------------------------------------------------------------
@pytest.mark.parametrize("keep", [0.3, 0.5])
def test_anchors_are_exactly_the_top_gamma_tokens(model, prompt, keep):
    cache, _ = _prefill(model, prompt, keep=keep, combine="drop")
    t = prompt.shape[1]
    budget = math.floor(keep * t)
    for attn, layer in zip(eager_attentions(model, prompt), cache.compressed_layers):
        expect = _expected_anchors(attn, budget)
        assert layer.length == budget
        for h in range(layer.positions.shape[1]):  # one index set shared by every KV head
            assert torch.equal(layer.positions[0, h], expect)


@pytest.mark.parametrize("merge_protected", [False, True])
def test_every_other_token_is_merged_into_its_nearest_anchor(model, prompt, merge_protected):
    keep = 0.3
    cache, _ = _prefill(model, prompt, keep=keep, merge_protected=merge_protected)
    t = prompt.shape[1]
    budget = math.floor(keep * t)
    for attn, layer, (k_full, v_full) in zip(eager_attentions(model, prompt), cache.compressed_layers, _full_kv(model, prompt)):
        anchors = _expected_anchors(attn, budget).tolist()
        assert layer.positions[0, 0].tolist() == anchors
        targets = anchors if merge_protected else [a for a in anchors if a not in (0, t - 1)]
        members: dict[int, list[int]] = {a: [a] for a in anchors}
        for j in range(t):
            if j in anchors:
                continue
            best = min(targets, key=lambda a: (abs(a - j), a))  # nearest; ties -> earlier anchor
            members[best].append(j)
        assert sum(len(m) for m in members.values()) == t  # every token is in exactly one bucket
        for slot, a in enumerate(anchors):
            ix = torch.tensor(members[a])
            torch.testing.assert_close(layer.keys[0, :, slot], k_full[0, :, ix].mean(dim=1), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(layer.values[0, :, slot], v_full[0, :, ix].mean(dim=1), atol=1e-6, rtol=1e-5)
        if not merge_protected:  # the first and the last prompt token stay exact
            torch.testing.assert_close(layer.keys[0, :, 0], k_full[0, :, 0])
            torch.testing.assert_close(layer.values[0, :, -1], v_full[0, :, -1])


def test_merge_in_bfloat16_is_the_float32_mean_rounded(model, prompt):
    """A bfloat16 cache is averaged in float32 and written back: every anchor slot is the mean of its
    members (not the anchor left as it was), rounded once to bfloat16. First layer only: its keys and
    values come from the same embeddings in both runs, while a later layer's inputs already differ by
    bfloat16 rounding between kvtrim's attention and transformers' (in slots nothing was merged into too)."""
    import copy

    bf = copy.deepcopy(model).to(torch.bfloat16)
    cache, _ = _prefill(bf, prompt, keep=0.3)
    t = prompt.shape[1]
    merged = 0
    layer, (k_full, v_full) = cache.compressed_layers[0], _full_kv(bf, prompt)[0]
    assert layer.keys.dtype == torch.bfloat16
    anchors = layer.positions[0, 0].tolist()
    targets = [a for a in anchors if a not in (0, t - 1)]
    for slot, a in enumerate(anchors):
        mem = _members(a, anchors, targets, t)
        ix = torch.tensor(mem)
        for got, full in ((layer.keys, k_full), (layer.values, v_full)):
            torch.testing.assert_close(got[0, :, slot], full[0][:, ix].float().mean(dim=1).to(torch.bfloat16))
        merged += len(mem) > 1
    assert merged > 0


def test_aligned_merge_rotates_members_to_the_anchor_position(model, prompt):
    keep = 0.3
    cache, _ = _prefill(model, prompt, keep=keep, align=True)
    plain, _ = _prefill(model, prompt, keep=keep)
    t = prompt.shape[1]
    inv = cache.inv_freq
    layer, k_full = cache.compressed_layers[0], _full_kv(model, prompt)[0][0]
    anchors = layer.positions[0, 0].tolist()
    targets = [a for a in anchors if a not in (0, t - 1)]
    for slot, a in enumerate(anchors):
        if a not in targets:
            continue
        ix = torch.tensor(_members(a, anchors, targets, t))
        aligned = rotate(k_full[0][:, ix].double(), (a - ix).double().view(1, -1), inv)
        torch.testing.assert_close(layer.keys[0, :, slot].double(), aligned.mean(dim=1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(layer.keys, plain.compressed_layers[0].keys)
    torch.testing.assert_close(layer.values, plain.compressed_layers[0].values)


# --- generation: elastic budget and fixed-point eviction ------------------------------------------
def _decode(model, cache, first_logits, steps, check):
    logits = first_logits
    with kvtrim.attach(model), torch.no_grad():
        for t in range(1, steps + 1):
            before = [(layer.positions.clone(), layer.keys.clone(), layer.length) for layer in cache.compressed_layers]
            out = model(input_ids=logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
            check(t, before)


@pytest.mark.parametrize("keep,position", [(0.5, "true"), (0.3, "compressed"), (0.5, "reassigned")])
def test_cache_follows_elastic_budget_and_evicts_only_at_p(model, prompt, keep, position):
    cache, out = _prefill(model, prompt, keep=keep, position=position)
    t_prompt = prompt.shape[1]
    length0 = math.floor(keep * t_prompt)
    p = length0 - 24
    assert cache.stored_tokens() == [length0] * model.config.num_hidden_layers
    for layer in cache.compressed_layers:
        assert layer.state["elastic_P"] == p
    evictions = []

    def check(t, before):
        budget = math.floor(keep * (t_prompt + t))
        assert cache.stored_tokens() == [budget] * model.config.num_hidden_layers
        for (pos0, k0, len0), layer in zip(before, cache.compressed_layers):
            # the frozen prefix (slots < P) is untouched: same tokens, same keys
            assert torch.equal(layer.positions[..., :p], pos0[..., :p])
            torch.testing.assert_close(layer.keys[:, :, :p], k0[:, :, :p], atol=0, rtol=0)
            if layer.length == len0:  # grew by one and evicted one: the evicted token sat at slot P
                evictions.append(t)
                kept_old = layer.positions[0, 0, :-1]
                expect = torch.cat([pos0[0, 0, :p], pos0[0, 0, p + 1 :]])
                assert torch.equal(kept_old, expect)
            else:
                assert layer.length == len0 + 1
            assert layer.positions[0, 0, -1] == t_prompt + t - 1  # the newest token is always there

    _decode(model, cache, out.logits[:, -1], 12, check)
    assert evictions  # the test did see evictions


def test_short_prompt_guard_keeps_the_sinks(model):
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    cache, out = _prefill(model, ids, max_tokens=10)
    assert all(layer.state["elastic_P"] == SINKS for layer in cache.compressed_layers)  # L = 10 < 24 + 4

    def check(t, before):
        for layer in cache.compressed_layers:
            assert layer.positions[0, 0, :SINKS].tolist() == list(range(SINKS))
            assert layer.length == 10

    _decode(model, cache, out.logits[:, -1], 6, check)


@pytest.mark.parametrize("eviction", ["recent", "frequency"])
def test_ablation_evictions_keep_first_and_newest(model, prompt, eviction):
    cache, out = _prefill(model, prompt, keep=0.5, eviction=eviction)

    def check(t, before):
        for (pos0, _, len0), layer in zip(before, cache.compressed_layers):
            assert layer.positions[0, 0, :SINKS].tolist() == list(range(SINKS))
            assert layer.positions[0, 0, -1] == prompt.shape[1] + t - 1
            if eviction == "recent" and layer.length == len0:  # the entry after the sinks is evicted
                assert torch.equal(layer.positions[0, 0, :-1], torch.cat([pos0[0, 0, :SINKS], pos0[0, 0, SINKS + 1:]]))

    _decode(model, cache, out.logits[:, -1], 6, check)


def test_frequency_eviction_removes_the_least_important_entry(model, prompt):
    seen_state = []

    class Spy(Elastic):
        def eviction_slot(self, layer, length, importance=None):
            slot = super().eviction_slot(layer, length, importance)
            assert importance is not None and importance.numel() == length
            seen_state.append((layer.layer_idx, importance.clone(), layer.positions[0, 0, :length].clone(), slot))
            return slot

    cache = KVTrimCache(model, Spy(keep=0.5, eviction="frequency"))
    with kvtrim.attach(model), torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for _ in range(4):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert seen_state
    for _layer_idx, acc, pos, slot in seen_state:
        # the argmin over slots 1..stored-2 (first token and newest token protected)
        assert slot == 1 + int(torch.argmin(acc[1:-1]))
        assert 0 < slot < pos.numel() - 1
    # and the accumulated importance grew with the decode rows (it is not the prefill value any more)
    layer = cache.compressed_layers[0]
    assert float(layer.state_view("elastic_importance")[0, 0, -1]) > 0


def test_compressed_positions_give_new_tokens_the_stored_length(model, prompt):
    cache, out = _prefill(model, prompt, keep=0.5, position="compressed")
    with kvtrim.attach(model), torch.no_grad():
        model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    layer = cache.compressed_layers[0]
    assert int(layer.rotations[0, 0, -1]) == math.floor(0.5 * prompt.shape[1])  # position = stored length
    assert int(layer.positions[0, 0, -1]) == prompt.shape[1]  # stream index stays true


@pytest.mark.parametrize(
    "kw", [dict(keep=1.0), dict(keep=1.0, position="compressed"), dict(keep=1.0, combine="drop", eviction="frequency")]
)
def test_keep_one_equals_full(model, prompt, kw):
    ref = generate_ids(model, None, prompt[0].tolist(), create_policy("full"), max_new_tokens=6, stop_at_eos=False)
    got = generate_ids(model, None, prompt[0].tolist(), create_policy("elastic", **kw), max_new_tokens=6, stop_at_eos=False)
    assert got.token_ids == ref.token_ids and got.stored_tokens == ref.stored_tokens


def test_turn_re_merges_to_the_budget(model, prompt):
    res = generate_ids(model, None, prompt[0].tolist(), create_policy("elastic", keep=0.5), max_new_tokens=3,
                       stop_at_eos=False, prefill_chunk=40)
    assert res.stored_tokens == math.floor(0.5 * (prompt.shape[1] + 2))


# --- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [0.0, -0.5, 1.01])
def test_gamma_outside_unit_interval(keep):
    with pytest.raises(KVTrimError, match=r"keep must be a fraction in \(0, 1\]"):
        create_policy("elastic", keep=keep)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(combine="cluster"), "combine must be one of merge, drop"),
        (dict(importance="max"), "importance must be one of sum, mean, ema"),
        (dict(eviction="lru"), "eviction must be one of fixed, recent, frequency"),
        (dict(distance=-1), "distance must be a non-negative integer"),
        (dict(per_head=True), "one index set per layer"),
        (dict(ema_decay=1.0), r"ema_decay must be in \(0, 1\)"),
        (dict(max_tokens=4), r"smaller than the 5 tokens .*4 attention sinks \+ the last prompt token"),
    ],
)
def test_bad_parameters(kw, msg):
    with pytest.raises(KVTrimError, match=msg):
        Elastic(**kw)


def test_prompt_shorter_than_protected_tokens(model):
    with pytest.raises(KVTrimError, match="fewer than the 5 it always keeps"):
        generate_ids(model, None, [5], create_policy("elastic", max_tokens=5), max_new_tokens=2)
    # under a keep budget such a prompt is kept whole (too short to save memory), and said so
    res = generate_ids(model, None, [5], create_policy("elastic", keep=0.5), max_new_tokens=2)
    assert not res.compressed and "kept whole" in res.reason


# --- the reproduction's shortcuts change no number ------------------------------------------------
def _repro():
    return load_benchmark("repro_elastic")


def test_repro_replay_and_shared_scores_equal_the_plain_path(model, prompt):
    mod = _repro()
    keep = {"elastic@0.3", "h2o@0.3", "local@0.3", "elastic-compressed@0.5", "elastic-frequency@0.5"}
    cfgs = {k: v for k, v in mod.configs([0.3]).items() if k in keep}
    with kvtrim.attach(model), torch.inference_mode():
        mod.selfcheck(model, prompt[0].tolist(), cfgs, steps=3)


def test_repro_cell_teacher_forcing_and_fork_equal_separate_runs(model, prompt):
    mod = _repro()
    ids = prompt[0].tolist()
    pol_kw = dict(keep=0.3)
    ref = generate_ids(model, None, ids, create_policy("full"), max_new_tokens=8, stop_at_eos=False).token_ids
    gen = generate_ids(model, None, ids, create_policy("elastic", **pol_kw), max_new_tokens=8, stop_at_eos=False).token_ids
    with kvtrim.attach(model), torch.inference_mode():
        rec = mod.record_prefill(model, ids)
        cache = mod.replay(model, mod.make_policy("elastic", pol_kw, {}), rec)
        cell = decoding.run(model, mod.cell_program(cache, rec.logits, ref, 8, None))
        # teacher forcing by hand through a fresh compressed cache
        cache = mod.replay(model, create_policy("elastic", **pol_kw), rec)
        logits, nll = rec.logits, 0.0
        for i, r in enumerate(ref):
            nll -= float(torch.log_softmax(logits, -1)[r])
            if i < len(ref) - 1:
                logits = decoding.forward(model, cache, [r])
    assert cell["gen_ids"] == gen
    assert cell["nll_sum"] == pytest.approx(nll, rel=1e-5)
    assert cell["n_tokens"] == len(ref)


def test_window_keeps_the_last_prompt_tokens_exact(model, prompt):
    w = 6
    cache, _ = _prefill(model, prompt, keep=0.3, window=w)
    t = prompt.shape[1]
    for layer, (k_full, v_full) in zip(cache.compressed_layers, _full_kv(model, prompt)):
        assert layer.positions[0, 0, -w:].tolist() == list(range(t - w, t))
        torch.testing.assert_close(layer.keys[:, :, -w:], k_full[:, :, -w:])
        torch.testing.assert_close(layer.values[:, :, -w:], v_full[:, :, -w:])
    with pytest.raises(KVTrimError, match="the last 6 prompt tokens"):
        Elastic(max_tokens=5, window=6)


# --- size-aware (proportional) merging ----------------------------------------------------------
def test_proportional_merge_attends_like_the_tokens_it_stands_for(model, prompt):
    """A merged key with bias log(size) must attend exactly like ``size`` copies of itself: a plain
    DynamicCache holding every merged key/value repeated by its bucket size gives the same logits,
    for one decode step and for a multi-token turn (causal mask plus the bias)."""
    t = prompt.shape[1]
    for nxt in (torch.tensor([[7]]), torch.tensor([[7, 19, 42, 5]])):
        _check_proportional_against_copies(model, prompt, t, nxt)


def _check_proportional_against_copies(model, prompt, t, nxt):
    logits, sizes = {}, {}
    for proportional in (True, False):
        cache, _ = _prefill(model, prompt, keep=0.3, proportional=proportional)
        dup = DynamicCache(config=model.config)
        for i, layer in enumerate(cache.compressed_layers):
            if proportional:
                size = layer.state_view("logit_bias")[0, 0].exp()
                counts = size.round().long()
                torch.testing.assert_close(size, counts.float(), atol=1e-4, rtol=0)
                assert int(counts.sum()) == t and int(counts.min()) >= 1
                assert int(counts[0]) == 1 and int(counts[-1]) == 1  # the first and last token stay exact
            else:  # same anchors and (first merge: all sizes 1) the same means; reuse the sizes from above
                assert "logit_bias" not in layer.token_state
                counts = sizes[i]
            if proportional:
                sizes[i] = counts
            dup.update(layer.keys.repeat_interleave(counts, dim=2), layer.values.repeat_interleave(counts, dim=2), i)
        with torch.no_grad():
            ref = model(input_ids=nxt, past_key_values=dup, use_cache=True).logits[0]
            with kvtrim.attach(model):
                logits[proportional] = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[0]
        if proportional:
            torch.testing.assert_close(logits[True], ref, atol=1e-4, rtol=1e-4)
        else:  # plain merging counts each merged key once: it differs from the size-weighted reference
            assert (logits[False] - ref).abs().max() > 1e-3


def test_proportional_sizes_add_up_over_turns(model, prompt):
    cache, _ = _prefill(model, prompt, keep=0.4, proportional=True)
    turn = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    with kvtrim.attach(model), torch.no_grad():
        model(input_ids=turn, past_key_values=cache, use_cache=True)
    seen = prompt.shape[1] + 30
    for layer in cache.compressed_layers:
        assert layer.length == math.floor(0.4 * seen)
        torch.testing.assert_close(layer.state_view("logit_bias")[0].exp().sum(-1), torch.full((layer.keys.shape[1],), float(seen)))


def test_proportional_needs_merge():
    with pytest.raises(KVTrimError, match="proportional=True needs combine='merge'"):
        Elastic(keep=0.5, combine="drop", proportional=True)


def test_pooled_importance_keeps_the_neighbours_of_a_peak():
    # one peak at slot 20 of 40; with kernel 5 its two neighbours on each side outrank everything else
    imp = torch.full((1, 40), 0.01)
    imp[0, 10] = 0.5  # a second, lower peak
    imp[0, 20] = 1.0
    plain = Elastic(keep=0.5, kernel=1).select_anchors(imp, SINKS + 1 + 5)[0].tolist()
    pooled = Elastic(keep=0.5, kernel=5).select_anchors(imp, SINKS + 1 + 5)[0].tolist()
    assert {10, 20} <= set(plain)
    assert pooled == [*range(SINKS), 18, 19, 20, 21, 22, 39]
    with pytest.raises(KVTrimError, match="kernel"):
        Elastic(keep=0.5, kernel=4)
