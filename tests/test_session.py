"""Sessions: turns, streams, save/restore continuing identically, clear errors; the recall task generator."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli_status, spy_fed

from kvtrim.errors import KVTrimError
from kvtrim.session import Session


class CharTokenizer:
    """A toy tokenizer for the tiny models: one id per character (no chat template)."""

    chat_template = None
    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + (ord(c) % 120) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 3) if i >= 3 else "" for i in ids)


def _ids(n, seed):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("method, kw", [("inf_mllm", {"max_tokens": 40, "window": 8, "decode_cap": 8}),
                                        ("h2o", {"max_tokens": 40, "position": "reassigned"}),
                                        ("streaming_llm", {"max_tokens": 40})])
def test_saved_and_restored_session_continues_identically(model, tmp_path, method, kw):
    a = Session(model, None, method, **kw)
    a.send_ids(_ids(50, 1), max_new_tokens=10, stop_ids=())  # > decode_cap for inf_mllm: a decode trim
    a.feed_ids(_ids(30, 2), chunk=16)
    a.send_ids(_ids(9, 3), max_new_tokens=3, stop_ids=(), do_sample=True)  # advances the sampling RNG
    a.save(tmp_path / "s")
    b = Session.load(tmp_path / "s", model)
    assert b.seen == a.seen and b.stored() == a.stored() and b.policy == a.policy
    for la, lb in zip(a.cache.compressed_layers, b.cache.compressed_layers):
        assert torch.equal(la.positions, lb.positions) and torch.equal(la.keys, lb.keys)
        assert la.token_state.keys() == lb.token_state.keys()
    for s in (a, b):
        s.out1 = s.send_ids(_ids(20, 4), max_new_tokens=5, stop_ids=(), do_sample=True)
        s.stats = s.feed_ids(_ids(40, 5), chunk=16)
        s.out2 = s.send_ids(_ids(7, 6), max_new_tokens=4, stop_ids=())
    assert a.out1 == b.out1 and a.out2 == b.out2
    assert [x.nll_sum for x in a.stats] == pytest.approx([x.nll_sum for x in b.stats], abs=1e-4)
    torch.testing.assert_close(a._last_logits, b._last_logits, atol=1e-5, rtol=0)
    saved = json.loads((tmp_path / "s" / "session.json").read_text())
    assert saved["policy"]["name"] == method and not list((tmp_path / "s").glob("*.pkl"))


def test_saved_file_layout_keeps_the_format_v1_names(model, tmp_path):
    """The cache's state_dict/state_meta write exactly the names sessions of format v1 hold, so sessions
    saved before them still load (format v2 adds manifest.json and two ids; tests/test_session_files.py)."""
    from safetensors.torch import load_file

    a = Session(model, None, "h2o", max_tokens=40, position="reassigned")
    a.send_ids(_ids(50, 1), max_new_tokens=3, stop_ids=())
    a.save(tmp_path / "s")
    info = json.loads((tmp_path / "s" / "session.json").read_text())
    tensors = load_file(str(tmp_path / "s" / "cache.safetensors"))
    n = len(a.cache.layers)
    want = {"last_logits", "rng_state"} | {f"layers.{i}.{k}" for i in range(n)
                                           for k in ("keys", "values", "positions", "rotations", "state.h2o_acc")}
    assert set(tensors) == want and info["version"] == 2 and (tmp_path / "s" / "manifest.json").is_file()
    assert [list(m) for m in info["layers"]] == [["initialized", "seen", "length", "phase", "n_new", "token_state", "state"]] * n
    assert info["policy"]["params"] == {"keep": None, "max_tokens": 40, "position": "reassigned", "per_head": True,
                                        "recent_ratio": 0.5}
    for i, (layer, meta) in enumerate(zip(a.cache.compressed_layers, info["layers"])):
        assert meta["length"] == layer.length == tensors[f"layers.{i}.keys"].shape[2] and meta["seen"] == a.seen


def test_text_turns_and_restore_with_a_tokenizer(model, tmp_path):
    tok = CharTokenizer()
    a = Session(model, tok, "inf_mllm", max_tokens=64, window=8)
    a.add_turn("remember 42", "ok")
    r1 = a.send("hello there", max_new_tokens=6)
    assert isinstance(r1, str) and len(a.messages) == 4
    a.save(tmp_path / "t")
    b = Session.load(tmp_path / "t", model, tok)
    assert b.messages == a.messages
    assert a.send("and then?", max_new_tokens=8) == b.send("and then?", max_new_tokens=8)


def test_feed_reports_per_chunk_and_stays_in_budget(model):
    s = Session(model, None, "inf_mllm", max_tokens=48, window=8)
    stats = s.feed_ids(_ids(400, 7), chunk=64)  # past the tiny model's 256-token context
    assert [x.tokens for x in stats] == [64] * 6 + [16]
    assert stats[0].scored == 63 and all(x.scored == x.tokens for x in stats[1:])
    assert all(x.stored <= 48 for x in stats) and stats[-1].seen == 400
    assert all(1.0 < x.ppl < 1e4 for x in stats)
    assert len({x.kv_bytes for x in stats[1:]}) == 1  # flat once the budget is reached
    assert all(x.rss_bytes > 0 and x.tokens_per_s > 0 for x in stats)


def test_feed_perplexity_equals_full_model_loss_without_eviction(model):
    ids = _ids(90, 8)
    s = Session(model, None, "inf_mllm", max_tokens=4096)
    stats = s.feed_ids(ids, chunk=32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    ref = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum")
    assert sum(x.nll_sum for x in stats) == pytest.approx(float(ref), rel=1e-5)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: s.send_ids([], 4), "turn is empty"),
        (lambda s: s.send("   ", 4), "turn is empty"),
        (lambda s: s.add_turn("", "x"), "turn is empty"),
        (lambda s: s.feed_ids([5, 6], chunk=0), "chunk must be a positive number"),
        (lambda s: s.feed(""), "nothing to feed"),
        (lambda s: s.send_ids([5], 0), "max_new_tokens must be a positive integer"),
    ],
)
def test_bad_input(model, call, message):
    s = Session(model, CharTokenizer(), "inf_mllm", max_tokens=40, window=8)
    with pytest.raises(KVTrimError, match=message):
        call(s)


def test_the_chat_and_stream_default_holds_its_budget_over_a_chat_far_past_the_context(model):
    """kvtrim chat's and kvtrim stream's default method, built as the commands build it, keeps at most its
    budget plus the reply being decoded after every turn of a chat five times the model's context, and
    its resident KV stops growing once the budget is full."""
    from argparse import Namespace

    from kvtrim.cli.session import DEFAULT_METHOD, _policy

    args = Namespace(method=DEFAULT_METHOD, keep=None, quality=None, max_tokens=48, position=None)
    for streaming in (False, True):
        policy = _policy(args, streaming=streaming)
        assert policy.name == DEFAULT_METHOD and policy.can_stream()
        s = Session(model, None, policy)
        stored, kv = [], []
        for t in range(40):
            s.send_ids(_ids(20, 200 + t), max_new_tokens=12, stop_ids=())
            stored.append(s.stored())
            kv.append(s.cache.kv_bytes())
        assert s.seen >= 40 * 31 > 4 * s.max_context
        assert max(stored) <= 48 + 12 and stored[-1] >= 48
        assert max(kv[5:]) <= kv[5]  # flat: nothing accumulates turn after turn


def test_chat_and_stream_default_to_the_same_method():
    from kvtrim.cli import build_parser
    from kvtrim.cli.session import DEFAULT_METHOD

    parser = build_parser()
    assert parser.parse_args(["stream", "--file", "x"]).method == DEFAULT_METHOD
    assert parser.parse_args(["chat"]).method is None  # cmd_chat takes DEFAULT_METHOD unless --load
    assert DEFAULT_METHOD in parser._subparsers._group_actions[0].choices["chat"].format_help()


def test_budget_below_window_and_non_streaming_past_context(model):
    with pytest.raises(KVTrimError, match="smaller than the 36 tokens this method always keeps"):
        Session(model, None, "inf_mllm", max_tokens=16)
    s = Session(model, None, "snapkv", keep=0.5)
    with pytest.raises(KVTrimError, match="cannot stream past it"):
        s.feed_ids(_ids(300, 9), chunk=100)


def test_load_errors(model, tmp_path):
    from conftest import tiny_llama

    with pytest.raises(KVTrimError, match="not a saved kvtrim session"):
        Session.load(tmp_path / "missing", model)
    a = Session(model, None, "inf_mllm", max_tokens=40, window=8)
    a.feed_ids(_ids(20, 1), chunk=20)
    a.save(tmp_path / "s")
    with pytest.raises(KVTrimError, match="different model"):
        Session.load(tmp_path / "s", tiny_llama(layers=2))


def test_recall_generator_is_deterministic_and_scored_by_exact_match():
    from kvtrim.eval.recall import recall_sample, score_reply

    tok = _WordTokenizer()
    a = recall_sample(tok, n_facts=3, context_turns=2, context_tokens=50, seed=5)
    b = recall_sample(tok, n_facts=3, context_turns=2, context_tokens=50, seed=5)
    c = recall_sample(tok, n_facts=3, context_turns=2, context_tokens=50, seed=6)
    assert a == b and a != c
    kinds = [t.kind for t in a.turns]
    assert kinds == ["fact"] * 3 + ["context"] * 2 + ["question"] * 3
    values = a.meta["values"]
    assert sorted(q.answer for q in a.questions) == sorted(values)
    for q in a.questions:  # each question names the key of its fact, and the value is nowhere else
        i = values.index(q.answer)
        assert a.meta["keys"][i] in q.user
        assert all(q.answer not in t.user for t in a.turns if t.kind == "context")
    assert score_reply("The code is 4821.", "4821") == 1.0
    assert score_reply("48210", "4821") == 0.0 and score_reply("no idea", "4821") == 0.0
    assert score_reply("1234 or 4821", "4821") == 0.0  # the first number counts


class _WordTokenizer:
    """Whitespace tokenizer (one id per word) for the recall generator's token counting."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.inv: list[str] = []

    def __call__(self, text, add_special_tokens=False):
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.inv)
                self.inv.append(w)
            ids.append(self.vocab[w])
        return {"input_ids": ids}

    def decode(self, ids):
        return " ".join(self.inv[i] for i in ids)


def test_recall_bad_input():
    from kvtrim.eval.recall import recall_sample

    with pytest.raises(KVTrimError, match="n_facts must be a positive integer"):
        recall_sample(_WordTokenizer(), n_facts=0)


@pytest.mark.model
def test_chat_turns_hold_exactly_the_templated_conversation(real):
    """After generated and scripted replies, the cache has been fed the chat template of the whole history."""
    s = Session(real.model, real.tokenizer, "full")
    fed = spy_fed(s)
    s.send("Name a colour.", max_new_tokens=5)  # likely cut mid-reply: exercises the pending token
    s.add_turn("Thanks.", "You are welcome.")
    s.send("Name a fruit.", max_new_tokens=40)
    s.send_ids(s._turn_ids("Bye.")[0], max_new_tokens=1)
    text = real.tokenizer.apply_chat_template(s.messages + [{"role": "user", "content": "Bye."}],
                                              add_generation_prompt=True, tokenize=False)
    assert real.tokenizer.decode(fed) == text and s.seen == len(fed)
    with torch.no_grad():
        ref = real.model(input_ids=torch.tensor([fed])).logits[0, -1]
    torch.testing.assert_close(s._last_logits, ref.float(), atol=1e-3, rtol=1e-3)


# --- command line: kvtrim chat / kvtrim stream --------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["stream", "--file", "/nonexistent/t.txt"], "does not exist"),
        (["stream", "--file", "{f}", "--chunk", "0"], "--chunk must be a positive number of tokens"),
        (["stream", "--file", "{f}", "--method", "inf_mllm", "--max-tokens", "8"],
         "smaller than the 36 tokens this method always keeps (4 attention sinks + the retrieval window"),
        (["stream", "--file", "{f}", "--max-tokens", "4"], "smaller than the 5 tokens this method always keeps"),
        (["stream", "--file", "{f}", "--method", "snapkv"], "cannot stream"),
        (["stream", "--file", "{empty}"], "is empty"),
        (["chat", "--method", "inf_mllm", "--max-tokens", "16"], "smaller than the 36 tokens"),
        (["chat", "--max-tokens", "3"], "smaller than the 5 tokens"),
        (["chat", "--method", "nope"], "unknown method 'nope'"),
        (["chat", "--load", "/nonexistent/session"], "does not exist"),
        (["chat", "--load", "{f}", "--method", "h2o"], "--load continues a saved session"),
        (["chat", "--load", "{f}", "--max-tokens", "64"], "--max-tokens cannot change them"),
    ],
)
def test_cli_bad_input(argv, message, tmp_path, capsys):

    f, empty = tmp_path / "t.txt", tmp_path / "e.txt"
    f.write_text("some text " * 10)
    empty.write_text("  \n")
    assert cli_status([a.format(f=f, empty=empty) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error:") and message in err


@pytest.mark.model
def test_cli_stream_json_lines(real, tmp_path, capsys):
    from kvtrim.cli import main
    from kvtrim.data import pydoc_text

    f = tmp_path / "doc.txt"
    f.write_text(pydoc_text()[:12000])
    assert main(["stream", "--file", str(f), "--chunk", "256", "--max-tokens", "256", "--limit", "1100", "--json",
                 "--no-progress"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    chunks, summary = lines[:-1], lines[-1]
    assert [c["tokens"] for c in chunks] == [256] * 4 + [76] and summary["tokens"] == 1100
    assert all(c["stored"] <= 256 and c["rss_bytes"] > 0 and c["tokens_per_s"] > 0 and 1 < c["ppl"] < 1000 for c in chunks)
    assert summary["kv_bytes"] < summary["kv_bytes_full"]


@pytest.mark.model
def test_cli_chat_streams_and_reports_memory(real, tmp_path, capsys, monkeypatch):
    import io

    from kvtrim.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n\n/stats\n"))
    assert main(["chat", "--max-tokens", "256", "--max-new-tokens", "12", "--save", str(tmp_path / "s")]) == 0
    out, err = capsys.readouterr()
    assert out.strip()  # the streamed reply
    assert "turn is empty" in err and "resident" in err and "tokens stored of" in err
    assert (tmp_path / "s" / "session.json").is_file()


@pytest.mark.model
def test_cli_chat_keeps_going_when_a_save_fails_and_parses_commands_exactly(real, tmp_path, capsys, monkeypatch):
    import io

    from kvtrim.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    # /save into a path under a regular file fails; "/savepoints ..." is a message, not /save
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/save {blocker}/s\n/savepoints are useful\n/stats\n"))
    assert main(["chat", "--max-tokens", "256", "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert "kvtrim: error: could not save" in err
    assert out.strip()  # the reply to "/savepoints are useful"
    assert "tokens stored of" in err and "[saved to" not in err


def test_chat_and_stream_take_a_method_with_parameters():
    """--method takes kvtrim eval's method syntax (name:key=value...); the budget and positions stay flags."""
    from argparse import Namespace

    from kvtrim.cli.session import _policy

    def args(method, **kw):
        return Namespace(method=method, keep=None, quality=None, max_tokens=kw.get("max_tokens", 64), position=None)

    p = _policy(args("snapkv:chunk=8:kernel=11"), streaming=False)
    assert (p.name, p.chunk, p.kernel, p.max_tokens) == ("snapkv", 8, 11, 64)
    p = _policy(args("tova:kernel=1"), streaming=True)  # a streaming method gets reassigned positions
    assert (p.name, p.kernel, p.position_policy) == ("tova", 1, "reassigned") and p.can_stream()
    with pytest.raises(KVTrimError, match="give max_tokens with --max-tokens"):
        _policy(args("snapkv:max_tokens=32"), streaming=False)
    with pytest.raises(KVTrimError, match="snapkv"):
        _policy(args("snapkv:nonsense=1"), streaming=False)
    with pytest.raises(KVTrimError, match=r"cannot stream.*tova"):
        _policy(args("snapkv:chunk=8"), streaming=True)


def test_chat_under_quality_falls_back_to_a_calibrated_method_and_says_so(capsys, tmp_path):
    """A calibration made before tova (a user's own, say): chat --quality without --method runs
    inf_mllm, with one stderr line; the shipped calibrations hold tova, so chat's default is used
    with them; an explicit --method, or no --quality, is taken as given."""
    from argparse import Namespace

    from kvtrim.budget import Calibration, calibration_for
    from kvtrim.cli.session import DEFAULT_METHOD, QUALITY_FALLBACK, _chat_method

    for model in (None, "qwen2.5-0.5b"):  # the shipped calibrations
        assert DEFAULT_METHOD in calibration_for(model).methods
        assert _chat_method(Namespace(method=None, quality=0.8, model=model, calibration=None)) == DEFAULT_METHOD
    assert capsys.readouterr().err == ""
    shipped = calibration_for(None)
    old = tmp_path / "old.json"
    Calibration(model=shipped.model, made=shipped.made,
                methods={m: p for m, p in shipped.methods.items() if m != DEFAULT_METHOD}).save(old)
    args = Namespace(method=None, quality=0.8, model=None, calibration=str(old))
    assert _chat_method(args) == QUALITY_FALLBACK
    assert f"the calibration has no {DEFAULT_METHOD}" in capsys.readouterr().err
    assert _chat_method(Namespace(method=None, quality=None, model=None, calibration=str(old))) == DEFAULT_METHOD
    assert _chat_method(Namespace(method="tova", quality=0.8, model=None, calibration=str(old))) == "tova"
    assert capsys.readouterr().err == ""
