"""The command line: contract names, JSON output, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from kvtrim.cli import main
from kvtrim.registry import method_names


def test_methods_json(capsys):
    assert main(["methods", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == method_names()
    assert all(r["description"] for r in rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--method", "nope", "--question", "q"], "unknown method 'nope'; known methods: full"),
        (["generate", "--method", "snapkv", "--keep", "1.5", "--question", "q"], "keep must be a fraction in (0, 1]"),
        (["generate", "--method", "snapkv", "--keep", "0", "--question", "q"], "keep must be a fraction in (0, 1]"),
        (["generate", "--method", "snapkv", "--max-tokens", "8", "--question", "q"], "smaller than the 36 tokens"),
        (["generate", "--question", "   "], "question is empty"),
        (["generate", "--context-file", "/nonexistent/ctx.txt", "--question", "q"], "does not exist"),
        (["generate", "--model", "/nonexistent/model", "--question", "q"], "does not exist"),
    ],
)
def test_bad_input_errors(argv, message, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # a value out of range is refused as the command line is parsed
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error:") and message in err


def test_model_that_is_not_a_causal_lm(tmp_path, capsys):
    from transformers import BertConfig

    BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--question", "q"]) == 2
    assert "not a causal language model" in capsys.readouterr().err


def test_model_file_that_is_not_gguf(tmp_path, capsys):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"0")
    assert main(["generate", "--model", str(f), "--question", "q"]) == 2
    assert "not a .gguf file" in capsys.readouterr().err


@pytest.mark.model
def test_generate_json_contract(capsys, tmp_path, real):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("The secret colour of the house is turquoise. " * 40)
    argv = ["generate", "--method", "snapkv", "--keep", "0.5", "--context-file", str(ctx),
            "--question", "What is the secret colour of the house?", "--max-new-tokens", "12", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    for k in ("answer", "method", "prompt_tokens", "new_tokens", "kv_bytes", "kv_bytes_full", "prefill_seconds", "decode_seconds"):
        assert k in d
    assert d["method"] == "snapkv" and d["prompt_tokens"] > 400 and 0 < d["new_tokens"] <= 12
    assert d["kv_bytes"] < 0.6 * d["kv_bytes_full"]
    assert "turquoise" in d["answer"].lower()


@pytest.mark.parametrize("bad", ["fake_gguf", "hub_id", "bad_config"])
@pytest.mark.parametrize("command", ["generate", "chat", "stream", "demo", "eval", "bench", "search-patterns"])
def test_every_command_refuses_a_bad_model_in_one_line(command, bad, tmp_path, monkeypatch, capsys):
    """A model that cannot load is one ``kvtrim: error:`` line and exit 2 in every command that takes --model."""
    import huggingface_hub.constants

    monkeypatch.setenv("KVTRIM_CACHE_DIR", str(tmp_path / "kvcache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # empty: nothing cached
    (tmp_path / "fake.gguf").write_text("not a model")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{oops")
    model, fragment = {
        "fake_gguf": (str(tmp_path / "fake.gguf"), "is not a GGUF file"),
        "hub_id": ("SomeOrg/not-downloaded", "kvtrim does not download models"),
        "bad_config": (str(tmp_path / "m"), "is not valid JSON"),
    }[bad]
    (tmp_path / "text.txt").write_text("Some text to stream. " * 20)
    rest = {
        "generate": ["--question", "x"],
        "chat": [],
        "stream": ["--file", str(tmp_path / "text.txt")],
        "demo": ["--methods", "full"],
        "eval": ["passkey", "--methods", "full", "--length", "512", "--samples", "1", "--out", str(tmp_path / "ev")],
        "bench": ["--methods", "full", "--lengths", "512", "--reps", "1", "--no-rss", "--quiet"],
        "search-patterns": ["--out", str(tmp_path / "pc.json")],
    }[command]
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hello\n"))
    assert main([command, "--model", model, *rest]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if not ln.startswith("kvtrim demo: loading")]  # demo's progress line
    assert len(lines) == 1 and lines[0].startswith("kvtrim: error:") and fragment in lines[0]
