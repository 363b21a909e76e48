"""``kvtrim serve``: the vLLM command and environment it builds (``--dry-run``), the KV space it sizes,
and its one-line errors, all checked before anything starts.

Runs in kvtrim's own environment, without vLLM: a stand-in ``vllm`` package (a version number only)
on ``PYTHONPATH`` plays the vLLM Python's part. The server itself answers requests in the vLLM tier
(``tests/test_vllm_serve.py``).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from kvtrim.cli import main, serve
from kvtrim.integrations.vllm.config import SCHEDULER

GIB = 1 << 30


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _fake_vllm(tmp_path: Path, monkeypatch, version: str = "0.32.0") -> None:
    pkg = tmp_path / "fake-vllm" / "vllm"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pkg.parent), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture
def model_dir(tmp_path):
    from conftest import tiny_llama

    d = tmp_path / "tiny"
    tiny_llama().save_pretrained(d)
    return d


@pytest.fixture
def vllm_env(tmp_path, monkeypatch):
    """A stand-in vLLM 0.32.0, no KV space or thread binding preset, 16 GiB of memory available."""
    _fake_vllm(tmp_path, monkeypatch)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(serve, "available_memory", lambda: 16 * GIB)


def _dry_run(line: str) -> tuple[dict, list[str]]:
    """The environment assignments and the command of --dry-run's line."""
    words = shlex.split(line)
    n = next(i for i, w in enumerate(words) if "=" not in w)
    return dict(w.split("=", 1) for w in words[:n]), words[n:]


def _option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_dry_run_with_a_method_configures_plugin_scheduler_prefix_caching_and_kv_space(vllm_env, model_dir, capsys):
    rc, out, err = _run(["serve", "--model", str(model_dir), "--method", "snapkv", "--keep", "0.25",
                         "--prefill", "block_sparse", "--port", "8123", "--vllm-python", sys.executable,
                         "--dry-run", "--", "--enforce-eager", "--max-num-seqs", "4"], capsys)
    assert rc == 0, err
    env, cmd = _dry_run(out.strip())
    assert cmd[:3] == [sys.executable, "-m", serve.SERVER_MODULE]
    assert _option(cmd, "--model") == str(model_dir.resolve())
    assert json.loads(_option(cmd, "--additional-config")) == {
        "kvtrim": {"prefill": "block_sparse", "method": "snapkv", "keep": 0.25}}
    assert _option(cmd, "--scheduler-cls") == SCHEDULER and "--no-enable-prefix-caching" in cmd
    assert _option(cmd, "--port") == "8123" and _option(cmd, "--host") == "127.0.0.1"
    assert _option(cmd, "--dtype") == "float32" and _option(cmd, "--tensor-parallel-size") == "1"
    assert cmd[-3:] == ["--enforce-eager", "--max-num-seqs", "4"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    # the sizing rule on the stubbed 16 GiB: weights, activations and three processes set aside, half of the rest
    weights = serve.weight_bytes(model_dir, "float32")
    acts = serve.activation_bytes(json.loads((model_dir / "config.json").read_text()), "float32")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(serve.size_kv_space(16 * GIB, weights, acts, 1).gib) == "5"
    assert str(serve.checkout_root() / "src") == env["PYTHONPATH"].split(os.pathsep)[0]
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "snapkv" in lines[0] and "vLLM 0.32.0" in lines[0]
    assert lines[1].startswith("kvtrim serve: KV space 5 GiB per rank (VLLM_CPU_KVCACHE_SPACE)")


def test_dry_run_without_a_method_is_vllms_own_server(vllm_env, model_dir, capsys):
    rc, out, err = _run(["serve", "--model", str(model_dir), "--vllm-python", sys.executable, "--dtype", "bfloat16",
                         "--max-model-len", "2048", "--tensor-parallel-size", "2", "--dry-run"], capsys)
    assert rc == 0, err
    _, cmd = _dry_run(out.strip())
    assert "--additional-config" not in cmd and "--scheduler-cls" not in cmd and "--no-enable-prefix-caching" not in cmd
    assert _option(cmd, "--dtype") == "bfloat16" and _option(cmd, "--max-model-len") == "2048"
    assert _option(cmd, "--tensor-parallel-size") == "2"
    assert "kvtrim nothing (vLLM's own server)" in err


def test_prefill_alone_needs_no_scheduler(vllm_env, model_dir, capsys):
    rc, out, err = _run(["serve", "--model", str(model_dir), "--prefill", "a_shape", "--prefill-min-length", "64",
                         "--vllm-python", sys.executable, "--dry-run"], capsys)
    assert rc == 0, err
    _, cmd = _dry_run(out.strip())
    assert json.loads(_option(cmd, "--additional-config")) == {"kvtrim": {"prefill": "a_shape", "min_length": 64}}
    assert "--scheduler-cls" not in cmd


def test_a_kv_space_and_thread_binding_in_the_environment_are_kept(vllm_env, model_dir, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    rc, out, err = _run(["serve", "--model", str(model_dir), "--method", "h2o", "--vllm-python", sys.executable,
                         "--dry-run"], capsys)
    assert rc == 0, err
    env, _ = _dry_run(out.strip())
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env  # unchanged: not shown
    assert "KV space 3 GiB per rank (VLLM_CPU_KVCACHE_SPACE, from the environment)" in err


def test_without_dry_run_it_becomes_the_server(vllm_env, model_dir, monkeypatch, capsys):
    ran = {}

    def launch(python, cmd, env):
        ran.update(python=python, cmd=cmd, env=env)
        return 0

    monkeypatch.setattr(serve, "launch", launch)
    argv = ["serve", "--model", str(model_dir), "--method", "streaming_llm", "--max-tokens", "512",
            "--vllm-python", sys.executable]
    assert _run(argv, capsys)[0] == 0
    _, out, _ = _run([*argv, "--dry-run"], capsys)
    env, cmd = _dry_run(out.strip())
    assert ran["python"] == sys.executable and ran["cmd"] == cmd
    assert all(ran["env"][k] == v for k, v in env.items())


def test_kv_space_sizing_rule():
    # 16 GiB - 2 (weights) - 0.5 (activations) - 3 x 1.5 (processes) = 9 GiB; half of it, whole GiB
    assert serve.size_kv_space(16 * GIB, 2 * GIB, GIB // 2, 1).gib == 4
    # two ranks: four processes and two steps of activations; each rank's pool gets its share
    assert serve.size_kv_space(16 * GIB, 2 * GIB, GIB // 2, 2).gib == 1
    with pytest.raises(serve.KVTrimError, match="not enough free memory for a KV space of 1 GiB per rank"):
        serve.size_kv_space(6 * GIB, 2 * GIB, GIB // 2, 1)


def test_weight_bytes_count_the_served_dtype(model_dir):
    from safetensors.torch import load_file

    n = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
    assert serve.weight_bytes(model_dir, "float32") == 4 * n
    assert serve.weight_bytes(model_dir, "bfloat16") == 2 * n


def test_weight_bytes_never_block_on_a_fifo(model_dir):
    """The weights' headers are read as every file kvtrim reads (kvtrim.files): a FIFO in their place
    is one line, nothing opened."""
    from kvtrim.errors import KVTrimError

    (model_dir / "model.safetensors").unlink()
    os.mkfifo(model_dir / "model.safetensors")
    with pytest.raises(KVTrimError, match=r"is a FIFO \(named pipe\), not a regular file"):
        serve.weight_bytes(model_dir, "float32")


def test_default_vllm_python_is_the_checkouts_vllm_venv(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "checkout_root", lambda: tmp_path)
    assert serve.default_vllm_python() == sys.executable
    venv = tmp_path / "benchmarks" / ".venv-vllm" / "bin" / "python"
    venv.parent.mkdir(parents=True)
    venv.write_text("")
    assert serve.default_vllm_python() == str(venv)


@pytest.mark.parametrize("argv, message", [
    (["--method", "nope"], "unknown kvtrim method 'nope'"),
    (["--method", "fastv"], "rewrites the prefill forward"),
    (["--method", "snapkv", "--max-tokens", "8"], "smaller than the 36 tokens"),
    (["--keep", "0.5"], "give --method too"),
    (["--prefill-min-length", "100"], "give --prefill too"),
    (["--pattern-config", "/nonexistent/pc.json", "--prefill", "minference"], "/nonexistent/pc.json"),
    (["qwen"], "unexpected argument 'qwen'"),
    (["--method", "snapkv", "--keep", "1.5"], "--keep must be a fraction in (0, 1], got 1.5"),
    (["--port", "70000"], "--port must be an integer in [1, 65535], got 70000"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be a positive integer, got 0"),
    (["--max-model-len", "many"], "--max-model-len must be an integer, got 'many'"),
    (["--vllm-python", "/nonexistent/python"], "--vllm-python '/nonexistent/python' is not an executable file"),
])
def test_bad_settings_are_one_line_before_anything_starts(argv, message, capsys):
    rc, out, err = _run(["serve", *argv, "--dry-run"], capsys)
    assert rc == 2 and not out
    assert err.startswith("kvtrim: error: ") and err.count("\n") == 1 and message in err, err


def test_a_python_without_vllm_is_refused(model_dir, capsys):
    rc, _, err = _run(["serve", "--model", str(model_dir), "--vllm-python", sys.executable, "--dry-run"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "cannot import vllm (ModuleNotFoundError" in err and "scripts/setup_vllm.sh" in err


def test_a_vllm_version_the_plugin_is_not_tested_on_is_refused(tmp_path, monkeypatch, model_dir, capsys):
    _fake_vllm(tmp_path, monkeypatch, "0.31.0")
    rc, _, err = _run(["serve", "--model", str(model_dir), "--vllm-python", sys.executable, "--dry-run"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "has vLLM 0.31.0; kvtrim's plugin is tested on vLLM 0.32.0 only" in err


def test_a_vllm_python_without_kvtrims_plugin_is_refused(tmp_path, monkeypatch, model_dir, capsys):
    """kvtrim importable (from this checkout) but not installed there: vLLM would not load the plugin."""
    other = Path("/usr/bin/python3")
    if not other.is_file() or Path(sys.prefix) in other.resolve().parents:
        pytest.skip("no Python outside this environment")
    if any((Path(__file__).resolve().parents[1] / "src").glob("*.egg-info")):
        # an installed checkout's src/ holds kvtrim's metadata (its entry points): on PYTHONPATH, which
        # kvtrim serve sets, vLLM finds the plugin through it, so there is nothing to refuse
        pytest.skip("this checkout is installed (src/kvtrim.egg-info): the plugin is found through it")
    _fake_vllm(tmp_path, monkeypatch)
    rc, _, err = _run(["serve", "--model", str(model_dir), "--vllm-python", str(other), "--dry-run"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "plugin is not registered" in err and "pip install --no-deps -e" in err
