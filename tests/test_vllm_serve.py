"""The vLLM tier of ``kvtrim serve``: the one command starts vLLM's OpenAI server with kvtrim's plugin,
and the ``openai`` client gets answers with KV compression on.

Runs in vLLM's own venv (``scripts/setup_vllm.sh``); skipped where vLLM or the ``openai`` client is
not importable::

    benchmarks/.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_serve.py

The model is the embedded SmolLM2-135M-Instruct (kvtrim's converted copy under ``~/.cache/kvtrim``,
or ``KVTRIM_VLLM_MODEL=DIR``); one server starts (a few minutes on a loaded 2-core machine).
"""

from __future__ import annotations

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> list[str]:
    """``--model DIR`` when KVTRIM_VLLM_MODEL names one; else nothing: kvtrim serve's default, the embedded model."""
    if os.environ.get("KVTRIM_VLLM_MODEL"):
        return ["--model", os.environ["KVTRIM_VLLM_MODEL"]]
    from kvtrim.errors import ModelLoadError
    from kvtrim.models import embedded_model_dir

    try:
        embedded_model_dir()
    except ModelLoadError:
        pytest.skip("no SmolLM2-135M-Instruct directory (run `kvtrim models install` or set KVTRIM_VLLM_MODEL)")
    return []


def test_kvtrim_serve_answers_the_openai_client_with_compression_on(tmp_path):
    openai = pytest.importorskip("openai")
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for these prompts, small for a shared machine
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "kvtrim", "serve", *_model(), "--method", "snapkv", "--keep", "0.25",
           "--port", str(port), "--max-model-len", "2048", "--vllm-python", sys.executable,
           "--", "--enforce-eager", "--max-num-batched-tokens", "512"]
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
        deadline = time.time() + 900
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            try:
                models = [m.id for m in client.models.list().data]
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "kvtrim serve did not come up"
                time.sleep(5)
        assert models == ["smollm2" if not os.environ.get("KVTRIM_VLLM_MODEL") else models[0]]
        story = " ".join(f"Note {i}: the lamp in room {i} is {'red' if i % 3 else 'blue'}." for i in range(60))

        def ask(i: int) -> str:
            r = client.chat.completions.create(
                model=models[0], temperature=0.0, max_tokens=8,
                messages=[{"role": "user", "content": f"{story}\nWhat colour is the lamp in room {i}?"}])
            assert r.choices[0].finish_reason in ("stop", "length")
            return r.choices[0].message.content or ""

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, [3, 10, 21, 40]))
        assert all(isinstance(a, str) for a in answers) and any(answers)
        text = log_path.read_text()
        own = [line for line in text.splitlines() if line.startswith("kvtrim serve: ")]  # said before the exec
        assert len(own) == 2 and "method=snapkv" in own[0] and own[1].startswith("kvtrim serve: KV space "), text[:3000]
        assert "kvtrim: configured: prefill=None method=snapkv keep=0.25" in text  # the workers got the settings
        assert "kvtrim: snapkv frees evicted KV blocks" in text  # the scheduler kvtrim serve named freed blocks
    finally:
        server.terminate()  # the server itself: kvtrim serve became it (exec)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
