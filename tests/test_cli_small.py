"""The small things a first hour trips on: the chat banner reads as text, ``chat --load`` finds the model
the session was saved with, ``kvtrim report`` says where it wrote, the reference model is named as it
is (Qwen2.5-Coder-0.5B-Instruct), and the README says where its parts come from and how the SHA-256
ties them to the published GGUF."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvtrim.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _chat(argv, monkeypatch, capsys, stdin: str = "/quit\n") -> tuple[int, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(["chat", *argv])
    return rc, capsys.readouterr().err


def test_chat_banner_reads_as_text(tiny_dir, monkeypatch, capsys):
    rc, err = _chat(["--model", tiny_dir, "--max-tokens", "64"], monkeypatch, capsys)
    assert rc == 0, err
    banner = next(line for line in err.splitlines() if line.startswith("kvtrim chat: "))
    assert "method tova (max_tokens=64, position=reassigned, " in banner, banner  # the default method
    assert "{" not in banner and "'" not in banner and "None" not in banner


def test_chat_load_uses_the_model_the_session_was_saved_with(tiny_dir, tmp_path, monkeypatch, capsys):
    import kvtrim
    from kvtrim.session import Session
    from kvtrim.session_file import MANIFEST_FILE, saved_model_source

    lm = kvtrim.load_model(tiny_dir)
    s = Session(lm.model, lm.tokenizer, "inf_mllm", max_tokens=64, position="reassigned")
    s.send("Hello there", max_new_tokens=2)
    saved = tmp_path / "session"
    s.save(saved)
    assert json.loads((saved / MANIFEST_FILE).read_text())["source"] == str(Path(tiny_dir))
    assert saved_model_source(saved) == str(Path(tiny_dir))
    rc, err = _chat(["--load", str(saved)], monkeypatch, capsys)  # no --model
    assert rc == 0, err
    assert any(line.startswith("kvtrim chat: ") and "inf_mllm" in line for line in err.splitlines()), err
    # --model still chooses, and the session's checks still refuse another model
    rc, err = _chat(["--load", str(saved), "--model", str(tmp_path / "nowhere")], monkeypatch, capsys)
    assert rc == 2 and "does not exist" in err


def test_saved_model_source_is_none_without_a_manifest(tmp_path):
    from kvtrim.session_file import MANIFEST_FILE, saved_model_source

    assert saved_model_source(tmp_path) is None
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    assert saved_model_source(tmp_path) is None
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"source": 3}))
    assert saved_model_source(tmp_path) is None


def test_saved_model_source_never_blocks_on_a_fifo_or_follows_a_link(tmp_path):
    """The manifest is read as every session file is (kvtrim.files.read_bytes): a FIFO in its place is
    None at once (the full load then says what it is), and so is a link to a real manifest."""
    import os
    import signal

    from kvtrim.session_file import MANIFEST_FILE, saved_model_source

    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / MANIFEST_FILE)
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("saved_model_source blocked on a FIFO"))
    signal.alarm(10)
    try:
        assert saved_model_source(fifo) is None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"source": "/some/model"}))
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / MANIFEST_FILE).symlink_to(real)
    assert saved_model_source(linked) is None


@pytest.mark.parametrize("plots", [False, True])
def test_report_says_where_it_wrote(plots, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "rep"
    argv = ["report", str(ROOT / "benchmarks" / "results" / "eval_baseline"), "--out", str(out)]
    assert main(argv + ([] if plots else ["--no-plots"])) == 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"kvtrim report: wrote {out / 'report.md'}"), err
    pngs = sorted(p.name for p in out.glob("*.png"))
    if plots:
        assert pngs and f"and {len(pngs)} plots beside it ({', '.join(pngs)})" in err
    else:
        assert not pngs and "plots" not in err


def test_the_reference_model_is_named_as_it_is():
    """Code-made labels and the README call it Qwen2.5-Coder-0.5B-Instruct (its short name qwen2.5-0.5b stays)."""
    from kvtrim.tools import docs_tables

    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md"))]
    for text in (docs_tables.headline(ROOT), docs_tables.guide(ROOT), docs_tables.eval_qwen(ROOT),
                 *(p.read_text() for p in pages)):
        assert "Qwen2.5-0.5B" not in text
    assert "Qwen2.5-Coder-0.5B-Instruct" in docs_tables.headline(ROOT)


def test_readme_states_the_reference_models_provenance():
    from kvtrim.reference_models import QWEN

    text = " ".join((ROOT / "README.md").read_text().split())
    assert f"`{QWEN.packages[0].split('==')[0]}` to `-part6`, {QWEN.packages[0].split('==')[1]}" in text
    assert f"(`{QWEN.sha256[:8]}...{QWEN.sha256[-6:]}`)" in text
    assert "nothing in them is imported or run" in text and "`Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF`" in text
    assert len(QWEN.packages) == 6 and all(p.endswith("==0.9.0") for p in QWEN.packages)


def test_chat_stats_tell_stored_bytes_from_resident_ones(tiny_dir, monkeypatch, capsys):
    """After a short chat the buffers' spare room can make the resident KV exceed an uncompressed
    cache's; the status line says how much of it the stored tokens take, which cannot."""
    import re

    rc, err = _chat(["--model", tiny_dir, "--max-tokens", "64", "--max-new-tokens", "3"], monkeypatch, capsys,
                    stdin="hello there\n/stats\n")
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("[KV ")]
    assert len(lines) == 2, err  # after the reply and for /stats
    size = r"([\d.]+ [KM]iB)"
    m = re.fullmatch(rf"\[KV {size} resident, {size} of it stored tokens \(uncompressed: {size}\); "
                     r"(\d+) tokens stored of (\d+) seen\]", lines[-1])
    assert m, lines[-1]

    def num(text: str) -> float:
        value, unit = text.split()
        return float(value) * (2**20 if unit == "MiB" else 2**10)

    resident, stored, full = (num(m.group(i)) for i in (1, 2, 3))
    assert 0 < stored <= resident and stored <= full
    assert int(m.group(4)) <= int(m.group(5))
