"""Models without a chat template (base models) work in every command with kvtrim's plain prompt format,
and ``--plain-prompt`` / ``plain=True`` forces that format on a model that has a template."""

from __future__ import annotations

import io
import json

import pytest

from kvtrim.cli import main
from kvtrim.errors import KVTrimError
from kvtrim.models import PLAIN_TURN, build_prompt_ids, has_chat_template, plain_turn, plain_turn_ids


@pytest.fixture(scope="module")
def tokenizers(embedded_tokenizer):
    """The embedded model's tokenizer (with its chat template) and a copy without one."""
    import copy

    tok = embedded_tokenizer
    base = copy.deepcopy(tok)
    base.chat_template = None
    assert has_chat_template(tok) and not has_chat_template(base)
    return tok, base


def _save(tmp_path_factory, tok, name):
    from conftest import tiny_llama

    d = tmp_path_factory.mktemp(name)
    tiny_llama(vocab_size=len(tok), max_position_embeddings=2048).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def base_dir(tokenizers, tmp_path_factory):
    """A tiny random Llama saved with a tokenizer that has no chat template (a base model)."""
    d = _save(tmp_path_factory, tokenizers[1], "tiny-base")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(d).chat_template is None  # it stays template-less once saved
    return d


@pytest.fixture(scope="module")
def instruct_dir(tokenizers, tmp_path_factory):
    return _save(tmp_path_factory, tokenizers[0], "tiny-instruct")


def test_the_plain_format():
    assert PLAIN_TURN == "User: {message}\nAssistant:"
    assert plain_turn("Hi?") == "User: Hi?\nAssistant:"
    assert plain_turn("Next.", first=False) == "\nUser: Next.\nAssistant:"


def test_prompt_ids_without_a_template_and_forced(tokenizers):
    tok, base = tokenizers
    q = "What is the capital of France?"
    want = list(base("User: " + q + "\nAssistant:", add_special_tokens=True)["input_ids"])
    assert build_prompt_ids(base, q) == want == plain_turn_ids(base, q)
    # a model with a template: the template by default, the plain format when forced
    templated = build_prompt_ids(tok, q)
    assert templated != want and "<|im_start|>" in tok.decode(templated)
    assert build_prompt_ids(tok, q, plain=True) == want
    assert build_prompt_ids(tok, q, chat=False) == list(tok(q, add_special_tokens=True)["input_ids"])
    with pytest.raises(KVTrimError, match="raw text"):
        build_prompt_ids(tok, q, chat=False, plain=True)


def test_eval_turn_tail_follows_the_prompt_format(tokenizers):
    from kvtrim.eval.programs import turn_tail

    tok, base = tokenizers
    plain_tail = list(base("\nUser: And then?\nAssistant:", add_special_tokens=False)["input_ids"])
    assert turn_tail(base, "And then?") == plain_tail == turn_tail(tok, "And then?", plain=True)
    assert "<|im_start|>user" in tok.decode(turn_tail(tok, "And then?"))


def test_session_turns_in_the_plain_format(tokenizers, tmp_path):
    """The cache holds exactly the plain transcript: first turn with the tokenizer's special tokens, a
    scripted reply, then the next turn on a new line; a forced-plain session saves and loads as plain."""
    from conftest import tiny_llama

    from kvtrim.session import Session

    tok, base = tokenizers
    model = tiny_llama(vocab_size=len(tok), max_position_embeddings=2048)
    for t, kw in ((base, {}), (tok, {"plain": True})):
        s = Session(model, t, "inf_mllm", max_tokens=4096, **kw)
        assert s.chat and s.plain
        fed = s.add_turn("Remember 42.", " Noted.")
        assert fed == len(plain_turn_ids(t, "Remember 42.")) + len(t(" Noted.", add_special_tokens=False)["input_ids"])
        seen = s.seen
        s.send("What number?", max_new_tokens=3)
        assert s.turns[-1]["prompt_tokens"] == len(plain_turn_ids(t, "What number?", first=False))
        assert s.seen == seen + s.turns[-1]["prompt_tokens"] + s.turns[-1]["new_tokens"] - 1  # the last token pends
    s.save(tmp_path / "s")
    assert json.loads((tmp_path / "s" / "session.json").read_text())["plain"] is True
    assert Session.load(tmp_path / "s", model, tok).plain
    assert not Session(model, tok, "inf_mllm").plain  # the template by default
    with pytest.raises(KVTrimError, match="plain=True formats chat turns"):
        Session(model, None, "inf_mllm", plain=True)


def test_base_model_generate_chat_eval_exit_0(base_dir, tmp_path, monkeypatch, capsys):
    assert main(["generate", "--model", base_dir, "--question", "What is 2+2?", "--max-new-tokens", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    from transformers import AutoTokenizer

    assert d["prompt_tokens"] == len(plain_turn_ids(AutoTokenizer.from_pretrained(base_dir), "What is 2+2?"))
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there.\nAnd again?\n/quit\n"))
    assert main(["chat", "--model", base_dir, "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert err.count("tokens stored of") == 2 and "error" not in err
    out = tmp_path / "ev"
    assert main(["eval", "passkey,multiturn", "--model", base_dir, "--methods", "snapkv", "--keep", "0.5",
                 "--length", "256", "--samples", "1", "--quiet", "--out", str(out)]) == 0
    lines = [json.loads(x) for f in (out / "runs").glob("*.jsonl") for x in f.read_text().splitlines()]
    assert {(r["task"], r["method"]) for r in lines} == {(t, m) for t in ("passkey", "multiturn") for m in ("full", "snapkv")}
    assert main(["demo", "--model", base_dir, "--methods", "full", "--length", "200"]) == 0


def test_plain_prompt_flag_changes_the_prompt_ids(instruct_dir, tokenizers, tmp_path, capsys):
    tok = tokenizers[0]
    q = "What is the capital of France?"
    got = {}
    for flag in ([], ["--plain-prompt"]):
        assert main(["generate", "--model", instruct_dir, "--question", q, "--max-new-tokens", "2", "--json", *flag]) == 0
        got[bool(flag)] = json.loads(capsys.readouterr().out)["prompt_tokens"]
    assert got == {False: len(build_prompt_ids(tok, q)), True: len(plain_turn_ids(tok, q))} and got[False] != got[True]
    out = tmp_path / "ev"
    argv = ["eval", "passkey", "--model", instruct_dir, "--methods", "snapkv", "--keep", "0.5", "--length", "256",
            "--samples", "1", "--quiet", "--out", str(out)]
    assert main([*argv, "--plain-prompt"]) == 0
    plain_tokens = json.loads(next((out / "runs").glob("*.jsonl")).read_text().splitlines()[0])["prompt_tokens"]
    capsys.readouterr()
    assert main(argv) == 2  # the directory holds plain prompts: not mixed with templated ones
    assert "holds a sweep with --plain-prompt" in capsys.readouterr().err
    assert main([*argv[:-1], str(tmp_path / "ev2")]) == 0
    templated_tokens = json.loads(next((tmp_path / "ev2" / "runs").glob("*.jsonl")).read_text().splitlines()[0])["prompt_tokens"]
    assert templated_tokens != plain_tokens
