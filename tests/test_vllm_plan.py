"""The vLLM plugin's settings, block arithmetic and compaction (no vLLM needed: pure Python and torch)."""

from __future__ import annotations

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
    ({"method": "nope"}, "unknown kvtrim method 'nope'; known methods: full, streaming_llm"),
    ({"method": "snapkv", "keep": 0}, "snapkv: keep must be"),
    ({"method": "snapkv", "keep": 1.5}, "snapkv: keep must be"),
    ({"method": "snapkv", "kep": 0.2}, "unexpected keyword argument 'kep'; allowed parameters: keep, max_tokens"),
    ({"keep": 0.2}, "kvtrim setting(s) ['keep'] are method parameters; give a method too"),
    ({"prefill": "sparse"}, "kvtrim prefill must be one of"),
    ({"prefill": "a_shape", "pattern_config": "x.json"}, "pattern_config is used with prefill 'minference' only"),
    ({"prefill": "minference", "sizes": {"k_v": 3}}, "sizes are used with a single-pattern prefill only"),
    ({"method": "snapkv", "kernel": 4}, "kernel must be a positive odd integer"),
    ({"prefill": "a_shape", "min_length": 0}, "kvtrim min_length must be"),
    ({"method": "fastv"}, "kvtrim method 'fastv' rewrites the prefill forward"),
    ({"method": "hae", "max_tokens": 64}, "kvtrim method 'hae' rewrites the prefill forward"),
    ({"method": "streaming_llm", "max_tokens": 64, "position": "reassigned"}, "kvtrim position 'reassigned' re-rotates"),
])
def test_bad_settings_fail_with_one_line(raw, msg):
    with pytest.raises(KVTrimError) as e:
        parse({"kvtrim": raw})
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("method", ["full", "snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic"])
def test_every_text_method_builds_its_policy_from_the_registry(method):
    """The plugin takes any text method of the registry and builds it with ``create_policy``: the
    parameters are the method's own, checked by its class, and positions stay true."""
    from kvtrim.registry import create_policy

    params = {} if method == "full" else {"keep": 0.25}
    cfg = parse({"kvtrim": {"method": method, **params}})
    assert cfg is not None and cfg.method == method and cfg.params == params
    policy = cfg.policy()
    assert policy == create_policy(method, position="true", **params)
    assert policy.position_policy == "true"


def test_engine_checks():
    cfg = PluginConfig(method="snapkv", params={"keep": 0.25})
    ok = dict(vllm_version="0.32.0", prefix_caching=False, speculative=False, scheduler_cls=SCHEDULER, platform="cpu")
    check_engine(cfg, **ok)
    for change, msg in [({"vllm_version": "0.33.0"}, "tested on vLLM 0.32.0, not 0.33.0"),
                        ({"prefix_caching": True}, "prefix caching off"),
                        ({"speculative": True}, "speculative decoding"),
                        ({"scheduler_cls": None}, "--scheduler-cls " + SCHEDULER),
                        ({"platform": "cuda"}, "CPU backend only"),
                        ({"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype auto, fp8, fp8_e4m3, fp8_e5m2 (the kinds vLLM's "
                                                         "CPU attention backend lists), not 'bfloat16'"),
                        ({"kv_cache_dtype": "int8_per_token_head"}, "not 'int8_per_token_head'")]:
        with pytest.raises(KVTrimError) as e:
            check_engine(cfg, **{**ok, **change})
        assert msg in str(e.value) and "\n" not in str(e.value)
    # sparse prefill alone needs neither the scheduler nor prefix caching off
    check_engine(PluginConfig(prefill="a_shape"), **{**ok, "prefix_caching": True, "scheduler_cls": None})
    for kind in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):  # vLLM's fp8 caches are read and compacted (test_vllm_storage)
        check_engine(cfg, **{**ok, "kv_cache_dtype": kind})
    with pytest.raises(KVTrimError, match="not 'float16'"):  # with sparse prefill alone too
        check_engine(PluginConfig(prefill="a_shape"), **{**ok, "kv_cache_dtype": "float16"})


# -- the ledger: which blocks stay ------------------------------------------------------------------
def _drive(policy, steps, bs):
    """Run a ledger through ``steps`` of ``(ctx, q)``; returns, per step, (freed, live, stored, kept)."""
    ledger = plan.Ledger(bs)
    out = []
    for ctx, q in steps:
        freed, _ = ledger.begin_step(ctx, q)
        kept = ledger.end_step(policy, ctx, q)
        out.append((freed, list(ledger.live), ledger.stored, kept))
    return out


@pytest.mark.parametrize("method", ["snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic"])
@pytest.mark.parametrize("bs", [4, 16, 128])
def test_ledger_frees_whole_blocks_and_keeps_the_first_and_the_writing_one(method, bs):
    from kvtrim.registry import create_policy

    policy = create_policy(method, keep=0.3, position="true")
    steps = [(0, 150), (150, 97), *[(c, 1) for c in range(247, 520)]]
    prev_live: list[int] = []
    for (ctx, q), (freed, live, stored, kept) in zip(steps, _drive(policy, steps, bs)):
        seen = ctx + q
        assert stored % bs == seen % bs  # the next token's slot is the one vLLM computes from its position
        assert live[0] == 0 and live[-1] == (seen - 1) // bs  # the first block and the one being written stay
        assert live == sorted(set(live)) and -(-stored // bs) == len(live)
        assert not set(freed) & set(live) and 0 not in freed
        assert set(freed) <= set(prev_live)
        target = policy.eviction_target(plan.phase_of(ctx, q), seen, stored)
        if target is None or target >= stored:
            assert kept == stored
        else:  # whole blocks freed, never fewer tokens than the rule asks, and no block more than needed
            assert (stored - kept) % bs == 0 and kept >= target
            assert kept - bs < target or -(-stored // bs) - (stored - kept) // bs == 2
        prev_live = live


def test_ledger_refuses_a_step_that_skips_tokens():
    ledger = plan.Ledger(16)
    ledger.begin_step(0, 40)
    ledger.end_step(PluginConfig(method="snapkv", params={"keep": 0.5}).policy(), 0, 40)
    with pytest.raises(KVTrimError, match="continued at 50 cached tokens, its ledger is at 40"):
        ledger.begin_step(50, 1)


def test_token_major_and_stored_are_inverse():
    bs, d = 4, 3
    key_layout = torch.tensor([j * bs + t for t in range(bs) for j in range(d)])  # token-major t*d+j -> stored j*bs+t
    x = torch.arange(2 * bs * d).float().view(1, 2, bs, d)
    assert torch.equal(plan.token_major(plan.stored(x, key_layout), key_layout), x)
    assert torch.equal(plan.stored(x, key_layout)[0, 0].reshape(-1), x[0, 0].t().reshape(-1))  # channel-major
