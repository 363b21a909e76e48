"""The vLLM plugin's settings, block arithmetic and compaction (no vLLM needed: pure Python and torch)."""

from __future__ import annotations

import math

import pytest
import torch

from kvtrim.errors import KVTrimError
from kvtrim.integrations.vllm import plan
from kvtrim.integrations.vllm.config import SCHEDULER, PluginConfig, check_engine, parse


# -- settings ---------------------------------------------------------------------------------------
def test_no_kvtrim_key_means_no_plugin():
    assert parse({}) is None
    assert parse({"other_plugin": {"x": 1}}) is None
    assert parse({"kvtrim": {}}) is None  # nothing asked for: nothing changes


@pytest.mark.parametrize("raw, msg", [
    ({"method": "h2o"}, "unknown kvtrim method 'h2o'"),
    ({"method": "snapkv", "keep": 0}, "kvtrim keep must be a fraction"),
    ({"method": "snapkv", "keep": 1.5}, "kvtrim keep must be a fraction"),
    ({"method": "snapkv", "kep": 0.2}, "unknown kvtrim setting(s) ['kep']"),
    ({"prefill": "sparse"}, "kvtrim prefill must be one of"),
    ({"prefill": "a_shape", "pattern_config": "x.json"}, "pattern_config is used with prefill 'minference' only"),
    ({"prefill": "minference", "sizes": {"k_v": 3}}, "sizes are used with a single-pattern prefill only"),
    ({"method": "snapkv", "kernel": 4}, "kernel must be a positive odd integer"),
    ({"prefill": "a_shape", "min_length": 0}, "kvtrim min_length must be"),
])
def test_bad_settings_fail_with_one_line(raw, msg):
    with pytest.raises(KVTrimError) as e:
        parse({"kvtrim": raw})
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_engine_checks():
    cfg = PluginConfig(method="snapkv")
    ok = dict(vllm_version="0.32.0", prefix_caching=False, speculative=False, scheduler_cls=SCHEDULER, platform="cpu")
    check_engine(cfg, **ok)
    for change, msg in [({"vllm_version": "0.33.0"}, "tested on vLLM 0.32.0, not 0.33.0"),
                        ({"prefix_caching": True}, "prefix caching off"),
                        ({"speculative": True}, "speculative decoding"),
                        ({"scheduler_cls": None}, "--scheduler-cls " + SCHEDULER),
                        ({"platform": "cuda"}, "CPU backend only")]:
        with pytest.raises(KVTrimError) as e:
            check_engine(cfg, **{**ok, **change})
        assert msg in str(e.value) and "\n" not in str(e.value)
    # sparse prefill alone needs neither the scheduler nor prefix caching off
    check_engine(PluginConfig(prefill="a_shape"), **{**ok, "prefix_caching": True, "scheduler_cls": None})


# -- block arithmetic ------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [5, 127, 128, 129, 700, 1000, 4097])
@pytest.mark.parametrize("keep", [0.05, 0.25, 0.5, 1.0])
def test_snapkv_range_keeps_the_budget_rounded_up_to_blocks(prompt_len, keep):
    bs = 128
    cfg = PluginConfig(method="snapkv", keep=keep)
    first, stop = plan.evicted_range(cfg, prompt_len, prompt_len, bs)
    full, tail = prompt_len // bs, prompt_len % bs
    assert stop == max(first, full) and first <= max(full, 0)
    kept = first * bs + tail if full else prompt_len
    assert kept >= min(prompt_len, math.ceil(keep * prompt_len))  # never fewer than asked
    assert kept - bs < max(math.ceil(keep * prompt_len), cfg.sinks + cfg.window, bs)  # at most one block more
    if keep == 1.0:
        assert first == stop  # keep 1: nothing evicted
    # the decision is made once: later steps see the same range
    assert plan.evicted_range(cfg, prompt_len, prompt_len + 50, bs) == (first, stop)


def test_streaming_range_slides_with_the_stream():
    bs = 32
    cfg = PluginConfig(method="streaming_llm", keep=0.25, sinks=4)
    prompt_len = 400
    recent = math.ceil(0.25 * prompt_len) - 4
    last = (0, 0)
    for ctx in range(prompt_len, prompt_len + 200):
        first, stop = plan.evicted_range(cfg, prompt_len, ctx, bs)
        assert first == 1  # the sinks' block stays
        assert stop * bs <= ctx - recent  # every token of the recent window is still there
        assert (stop + 1) * bs > ctx - recent  # and no more than one extra block of older tokens
        assert stop >= last[1]
        last = (first, stop)


def test_compacted_row():
    row = torch.tensor([7, 3, 9, 4, 8, 0, 0])
    assert plan.compacted_row(row, 1, 3).tolist() == [7, 4, 8, 0, 0, 0, 0]
    assert plan.compacted_row(row, 2, 2).tolist() == row.tolist()


# -- token selection and compaction ------------------------------------------------------------------
def test_select_tokens_is_the_top_k_with_sinks_and_window_forced():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 40, generator=g)
    idx = plan.select_tokens(scores, 16, sinks=4, protect_from=36)
    for h in range(3):
        got = set(idx[h].tolist())
        assert {0, 1, 2, 3, 36, 37, 38, 39} <= got
        rest = sorted(range(4, 36), key=lambda i: -scores[h, i].item())[:8]
        assert got == {0, 1, 2, 3, 36, 37, 38, 39, *rest}
        assert idx[h].tolist() == sorted(idx[h].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_moves_each_heads_tokens_in_order(dtype):
    g = torch.Generator().manual_seed(1)
    nb, hkv, bs, d = 9, 3, 4, 5
    kv = torch.randn(nb, hkv, 2 * bs, d, generator=g).to(dtype)  # vLLM's CPU layout: keys then values per block
    key_cache, value_cache = kv[:, :, :bs], kv[:, :, bs:]
    blocks = torch.tensor([6, 2, 5, 8])  # the request's blocks in logical order: 16 tokens
    logical_k = key_cache[blocks].permute(1, 0, 2, 3).reshape(hkv, -1, d).clone()
    logical_v = value_cache[blocks].permute(1, 0, 2, 3).reshape(hkv, -1, d).clone()
    untouched = kv[[0, 1, 3, 4, 7]].clone()
    keep = torch.stack([torch.tensor([0, 1, 5, 6, 9, 10, 14, 15]), torch.arange(8), torch.arange(8, 16)])
    plan.compact(key_cache, value_cache, blocks, keep)
    got_k = key_cache[blocks[:2]].permute(1, 0, 2, 3).reshape(hkv, -1, d)
    got_v = value_cache[blocks[:2]].permute(1, 0, 2, 3).reshape(hkv, -1, d)
    for h in range(hkv):
        assert torch.equal(got_k[h], logical_k[h, keep[h]])
        assert torch.equal(got_v[h], logical_v[h, keep[h]])
    assert torch.equal(kv[[0, 1, 3, 4, 7]], untouched)  # other requests' blocks are not written


def test_compact_reads_and_writes_the_kernels_block_layout():
    # vLLM's CPU kernel stores a block's keys channel-major ([D, bs]) and its values token-major;
    # compaction must move tokens, not stored rows, whatever the layout
    g = torch.Generator().manual_seed(2)
    nb, hkv, bs, d = 6, 2, 4, 3
    key_layout = torch.tensor([j * bs + t for t in range(bs) for j in range(d)])  # token-major t*d+j -> stored j*bs+t
    assert plan.token_major(plan.stored(torch.arange(bs * d).float().view(1, 1, bs, d), key_layout), key_layout).flatten().tolist() \
        == list(range(bs * d))
    logical_k = torch.randn(nb, hkv, bs, d, generator=g)
    logical_v = torch.randn(nb, hkv, bs, d, generator=g)
    key_cache, value_cache = plan.stored(logical_k, key_layout).clone(), logical_v.clone()
    # the stored keys of a block head are the token-major ones transposed
    assert torch.equal(key_cache[0, 0].reshape(-1), logical_k[0, 0].t().reshape(-1))
    blocks = torch.tensor([5, 0, 3])
    flat_k = logical_k[blocks].permute(1, 0, 2, 3).reshape(hkv, -1, d)
    flat_v = logical_v[blocks].permute(1, 0, 2, 3).reshape(hkv, -1, d)
    keep = torch.stack([torch.tensor([0, 2, 7, 11]), torch.tensor([1, 4, 5, 9])])
    plan.compact(key_cache, value_cache, blocks, keep, (key_layout, None))
    got_k = plan.token_major(key_cache[blocks[:1]], key_layout)[0]
    for h in range(hkv):
        assert torch.equal(got_k[h], flat_k[h, keep[h]])
        assert torch.equal(value_cache[blocks[0], h], flat_v[h, keep[h]])
    assert torch.equal(plan.token_major(key_cache[[1, 2, 4]], key_layout), logical_k[[1, 2, 4]])  # others untouched


def test_snapkv_scores_outside_a_kvtrim_cache():
    """The plugin's workers score a prompt with ``SnapKV.score(None, q, k, scale)`` (no kvtrim cache layer,
    so no fused scores to read): the window scores are computed from q and k, as kvtrim's own path does."""
    from kvtrim.policies.snapkv import SnapKV
    from kvtrim.scores import group_reduce, window_probs

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 6, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    policy = SnapKV(keep=0.25, window=8, kernel=1)
    got = policy.score(None, q, k, 0.25)
    want = group_reduce(window_probs(q, k, 0.25, 8).sum(dim=-2), "mean")
    torch.testing.assert_close(got, want)
