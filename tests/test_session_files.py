"""Saved sessions cannot be silently corrupted: every damaged, edited or mixed-up file is refused with
one clear ``SessionError``; saves are atomic, follow no symbolic link and are private (0600/0700)."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtrim.errors import KVTrimError, SessionError
from kvtrim.session import Session


class ToyChatTokenizer:
    """One id per character, with a toy chat template (so the session's chat flag is true)."""

    chat_template = "toy"
    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + (ord(c) % 120) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 3) if i >= 3 else "" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        text = "".join(f"<{m['role'][0]}>{m['content']}|\n" for m in messages)
        return text + ("<a>" if add_generation_prompt else "")


TOK = ToyChatTokenizer()


def _conversation(model, tokenizer, method: str = "inf_mllm", code: str = "4821") -> Session:
    kw = {"max_tokens": 40, "window": 8} if method == "inf_mllm" else {"max_tokens": 40, "position": "reassigned"}
    s = Session(model, tokenizer, method, **kw)
    s.add_turn(f"Remember: the code is {code}.", "Noted.")
    s.send("What is the code?", max_new_tokens=4)
    return s


# --- the corruptions of the bad-input probe (rows L_*), written from their descriptions ----------
def _edit_json(d: Path, change: Callable[[dict], object]) -> None:
    info = json.loads((d / "session.json").read_text())
    out = change(info)
    (d / "session.json").write_text(json.dumps(info if out is None else out, indent=1))


def _set_layers(key: str, value: Callable[[dict], object]) -> Callable[[dict], None]:
    def change(info: dict) -> None:
        for m in info["layers"]:
            m[key] = value(m)
    return change


def _copy_file(name: str, kind: str) -> Callable[[Path, Callable[[str], Path]], None]:
    def corrupt(d: Path, other: Callable[[str], Path]) -> None:
        (d / name).write_bytes((other(kind) / name).read_bytes())
    return corrupt


def _bitflip(d: Path, other) -> None:
    data = bytearray((d / "cache.safetensors").read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # the first tensor byte
    for i in range(start, min(len(data), start + 40_000)):
        data[i] ^= 0xFF
    (d / "cache.safetensors").write_bytes(bytes(data))


# row id -> (corruption, message with the manifest as saved, message once the manifest's checksums are
# recomputed to match the edited files, as a deliberate editor could; None: only the checksum catches it)
CHANGED = "does not match its SHA-256 in manifest.json"
ROWS: dict[str, tuple[Callable[[Path, Callable[[str], Path]], None], str, str | None]] = {
    "L_a_trunc_tensor": (lambda d, o: (d / "cache.safetensors").write_bytes((d / "cache.safetensors").read_bytes()[:(d / "cache.safetensors").stat().st_size // 2]),
                         CHANGED, "cache.safetensors is not a readable safetensors file"),
    "L_a2_zero_tensor": (lambda d, o: (d / "cache.safetensors").write_bytes(b""), CHANGED,
                         "cache.safetensors is not a readable safetensors file"),
    "L_b_badjson": (lambda d, o: (d / "session.json").write_text((d / "session.json").read_text()[:43]), CHANGED,
                    "session.json is not valid JSON"),
    "L_c_length_plus50": (lambda d, o: _edit_json(d, _set_layers("length", lambda m: m["length"] + 50)), CHANGED,
                          "length"),
    "L_c2_length_5": (lambda d, o: _edit_json(d, _set_layers("length", lambda m: 5)), CHANGED, "stored keys but length 5"),
    "L_d_policy_param": (lambda d, o: _edit_json(d, lambda i: i["policy"]["params"].update(evil=1)), CHANGED,
                         "session.json names method 'inf_mllm'.*'evil': 1.*the manifest"),
    "L_e_policy_name": (lambda d, o: _edit_json(d, lambda i: i["policy"].update(name="nosuch")), CHANGED,
                        "session.json names method 'nosuch'"),
    "L_f_json_method_h2o": (lambda d, o: _edit_json(d, lambda i: i.update(policy=json.loads((o("h2o") / "session.json").read_text())["policy"])),
                            CHANGED, "session.json names method 'h2o'"),
    "L_f2_cache_from_h2o": (_copy_file("cache.safetensors", "h2o"), CHANGED, "cache.safetensors comes from another session"),
    "L_f3_cache_from_other_conv": (_copy_file("cache.safetensors", "other_conversation"), CHANGED,
                                   "cache.safetensors comes from another session"),
    "L_g_cache_from_tiny": (_copy_file("cache.safetensors", "smaller_model"), CHANGED,
                            "cache.safetensors comes from another session"),
    "L_g2_json_from_tiny": (_copy_file("session.json", "smaller_model"), CHANGED,
                            "session.json comes from another save"),
    "L_h_no_model_key": (lambda d, o: _edit_json(d, lambda i: i.pop("model") and None), CHANGED, r"model fingerprint \('model'\) is missing"),
    "L_i_one_layer": (lambda d, o: _edit_json(d, lambda i: i.update(layers=i["layers"][:1])), CHANGED,
                      "saved state has 1 layers, the model has 3"),
    "L_i2_extra_layers": (lambda d, o: _edit_json(d, lambda i: i["layers"].extend(i["layers"][:1] * 5)), CHANGED,
                          "saved state has 8 layers, the model has 3"),
    "L_j_pending_oov": (lambda d, o: _edit_json(d, lambda i: i.update(pending_ids=[10**9])), CHANGED,
                        "pending token id 1000000000 is outside the model's vocabulary of 128"),
    "L_k_maxtok_str": (lambda d, o: _edit_json(d, lambda i: i["policy"]["params"].update(max_tokens="1024")), CHANGED,
                       "session.json names method 'inf_mllm'.*'1024'"),
    "L_l_json_list": (lambda d, o: _edit_json(d, lambda i: [1, 2, 3]), CHANGED, "session.json must hold a JSON object, got list"),
    "L_m_seen_huge": (lambda d, o: _edit_json(d, _set_layers("seen", lambda m: 100000)), CHANGED, None),
    "L_n_messages_str": (lambda d, o: _edit_json(d, lambda i: i.update(messages="hello")), CHANGED, "messages must be a list"),
    "L_o_chat_true_to_false": (lambda d, o: _edit_json(d, lambda i: i.update(chat=False)), CHANGED,
                               "chat is false but chat-template text is pending"),
    "L_p_prefill_chunk0": (lambda d, o: _edit_json(d, lambda i: i.update(prefill_chunk=0)), CHANGED,
                           "prefill_chunk must be null or a positive integer, got 0"),
    "L_q_bitflip": (_bitflip, CHANGED, None),
}


def _reseal(d: Path) -> None:
    """Recompute the manifest's checksums for the files as they are now (a deliberate edit)."""
    manifest = json.loads((d / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = hashlib.sha256((d / name).read_bytes()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(manifest))


def _others(model, tokenizer, root: Path, smaller) -> Callable[[str], Path]:
    """Sessions that the mixing corruptions take a file from."""
    def other(kind: str) -> Path:
        d = root / kind
        if not d.exists():
            if kind == "h2o":
                s = _conversation(model, tokenizer, "h2o")
            elif kind == "other_conversation":
                s = _conversation(model, tokenizer, code="7390")
            else:
                s = _conversation(smaller(), tokenizer)
            s.save(d)
        return d
    return other


def test_the_table_has_the_23_session_rows_of_the_probe():
    assert len(ROWS) == 23


@pytest.mark.parametrize("resealed", [False, True], ids=["as_saved", "checksums_recomputed"])
@pytest.mark.parametrize("row", list(ROWS))
def test_corrupted_session_is_refused_with_one_clear_error(model, tmp_path, row, resealed):
    from conftest import tiny_llama

    corrupt, message, semantic = ROWS[row]
    if resealed and semantic is None:
        pytest.skip(f"{row}: an edit with recomputed checksums is caught only by the checksum")
    d = tmp_path / "s"
    _conversation(model, TOK).save(d)
    assert Session.load(d, model, TOK).seen > 0  # loadable before the corruption
    corrupt(d, _others(model, TOK, tmp_path / "others", lambda: tiny_llama(layers=2)))
    if resealed:
        _reseal(d)
    with pytest.raises(SessionError, match=semantic if resealed else message) as e:
        Session.load(d, model, TOK)
    assert str(d) in str(e.value) and "\n" not in str(e.value)


def test_session_of_another_dtype_or_other_weights_is_refused(model, tmp_path):
    """Probe S8: a float32 session onto a bfloat16 model failed only at the first turn."""
    from conftest import tiny_llama

    s = Session(model, None, "inf_mllm", max_tokens=40, window=8)
    s.send_ids(list(range(3, 40)), max_new_tokens=3, stop_ids=())
    s.save(tmp_path / "s")
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.raises(SessionError, match="saved with a float32 model, this model is bfloat16"):
        Session.load(tmp_path / "s", bf16)
    with pytest.raises(SessionError, match="saved with other weights"):
        Session.load(tmp_path / "s", tiny_llama(seed=1))  # same architecture, other weights
    with pytest.raises(SessionError, match=r"different model: num_hidden_layers 3 .this model: 2."):
        Session.load(tmp_path / "s", tiny_llama(layers=2))


def test_round_trip_continues_identically_and_keeps_the_conversation_id(model, tmp_path):
    a = _conversation(model, TOK)
    a.save(tmp_path / "s")
    b = Session.load(tmp_path / "s", model, TOK)
    assert b.messages == a.messages and b._pending_text == a._pending_text and b.chat
    assert a.send("And again?", max_new_tokens=5) == b.send("And again?", max_new_tokens=5)
    b.save(tmp_path / "s")  # replaces the earlier save of the same conversation
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["session"] == a._session_id and manifest["dtype"] == "float32" and manifest["version"] == 2
    assert manifest["policy"] == {"name": "inf_mllm", "params": a.policy.params()}
    c = Session.load(tmp_path / "s", model, TOK)
    assert c.messages == a.messages and c.seen == a.seen


def test_files_are_private(model, tmp_path):
    d = _save(model, tmp_path / "s")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    names = sorted(p.name for p in d.iterdir())
    assert names == ["cache.safetensors", "manifest.json", "session.json"]
    assert all(stat.S_IMODE((d / n).stat().st_mode) == 0o600 for n in names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no temporary directory left


def _save(model, d: Path, n: int = 20) -> Path:
    s = Session(model, None, "inf_mllm", max_tokens=40, window=8)
    s.feed_ids(list(range(3, 3 + n)), chunk=16)
    s.save(d)
    return d


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("fail_at", ["write", "swap"])
def test_a_failed_save_leaves_the_previous_session_loadable_and_unchanged(model, tmp_path, monkeypatch, fail_at):
    import kvtrim.session_file as session_module

    d = _save(model, tmp_path / "s", n=20)
    before = _snapshot(d)
    s = Session(model, None, "inf_mllm", max_tokens=40, window=8)
    s.feed_ids(list(range(3, 60)), chunk=16)
    if fail_at == "write":  # the disk fills up after the first file
        written = []
        real_write = session_module.write_atomic

        def write(path, data, **kw):
            if written:
                raise OSError(28, "No space left on device")
            written.append(path)
            return real_write(path, data, **kw)
        monkeypatch.setattr(session_module, "write_atomic", write)
    else:  # the new directory cannot be renamed into place after the old one was moved aside
        real_rename = os.rename

        def rename(src, dst):
            if Path(src).name.startswith(".s.tmp-"):
                raise OSError(5, "Input/output error")
            real_rename(src, dst)
        monkeypatch.setattr(session_module.os, "rename", rename)
    with pytest.raises(SessionError, match=r"cannot save the session to .*(No space left|Input/output)"):
        s.save(d)
    monkeypatch.undo()
    assert _snapshot(d) == before and Session.load(d, model).seen == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_save_refuses_files_links_and_foreign_directories(model, tmp_path):
    s = Session(model, None, "inf_mllm", max_tokens=40, window=8)
    s.feed_ids(list(range(3, 23)), chunk=16)
    f = tmp_path / "file.txt"
    f.write_text("keep me")
    with pytest.raises(SessionError, match="exists and is not a directory"):  # probe S5 (was FileExistsError)
        s.save(f)
    victim = tmp_path / "victim.txt"
    victim.write_text("unrelated")
    sym = tmp_path / "symsess"
    sym.mkdir()
    (sym / "session.json").symlink_to(victim)  # probe 68: the symlink was followed, victim overwritten
    with pytest.raises(SessionError, match=r"symsess/session.json' is a symbolic link"):
        s.save(sym)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(SessionError, match=r"'.*link' is a symbolic link"):
        s.save(tmp_path / "link")
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(SessionError, match=r"not a kvtrim session .it holds notes.txt.; refusing to replace it"):
        s.save(home)
    assert f.read_text() == "keep me" and victim.read_text() == "unrelated" and (home / "notes.txt").read_text() == "mine"
    assert not list((tmp_path / "real").iterdir())
    s.save(tmp_path / "real")  # an empty directory is taken
    assert Session.load(tmp_path / "real", model).seen == 20
    assert isinstance(SessionError("x"), KVTrimError)


def test_load_follows_no_link(model, tmp_path):
    d = _save(model, tmp_path / "s")
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(SessionError, match="is a symbolic link"):
        Session.load(tmp_path / "link", model)
    other = _save(model, tmp_path / "other", n=30)
    (d / "cache.safetensors").unlink()
    (d / "cache.safetensors").symlink_to(other / "cache.safetensors")
    with pytest.raises(SessionError, match=r"cache.safetensors' is a symbolic link"):
        Session.load(d, model)


def test_format_v1_session_loads_with_a_warning(model, tmp_path, caplog):
    """A session saved before the manifest (format v1) still loads, saying it cannot be verified."""
    d = _save(model, tmp_path / "s")
    (d / "manifest.json").unlink()
    _edit_json(d, lambda i: [i.pop(k) for k in ("session", "save")] and i.update(version=1))
    with caplog.at_level(logging.WARNING, logger="kvtrim.session_file"):
        s = Session.load(d, model)
    assert s.seen == 20 and "format v1 session (no manifest): its files cannot be verified" in caplog.text
    _edit_json(d, lambda i: i.update(pending_ids=[500]))  # v1 files still get every structural check
    with pytest.raises(SessionError, match="outside the model's vocabulary"):
        Session.load(d, model)


# --- command line -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["chat", "--save", "{f}"], ["stream", "--file", "{f}", "--save", "{f}"]])
def test_cli_save_target_is_checked_before_the_model_loads(argv, tmp_path, capsys, monkeypatch):
    from kvtrim.cli import main

    def no_model(*a, **k):
        raise AssertionError("the model should not be loaded")
    monkeypatch.setattr("kvtrim.models.load_model", no_model)
    f = tmp_path / "t.txt"
    f.write_text("some text " * 10)
    assert main([a.format(f=f) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error:") and "exists and is not a directory" in err and len(err.splitlines()) == 1


@pytest.mark.model
def test_cli_load_refuses_every_corruption_with_one_line(real, tmp_path, capsys, monkeypatch):
    """The 23 rows through ``kvtrim chat --load DIR`` on the embedded model: exit 2, one line."""
    from conftest import tiny_llama

    from kvtrim.cli import main

    monkeypatch.setattr("kvtrim.models.load_model", lambda *a, **k: real)
    base = tmp_path / "base"
    s = Session(real.model, real.tokenizer, "inf_mllm", max_tokens=256)
    s.add_turn("Remember: the code is 4821.", "Noted.")
    s.save(base)
    root = tmp_path / "others"
    root.mkdir()

    def other(kind: str) -> Path:
        d = root / kind
        if not d.exists():
            if kind == "smaller_model":
                o = _conversation(tiny_llama(layers=2), TOK)
            else:
                o = Session(real.model, real.tokenizer, *(("h2o",) if kind == "h2o" else ("inf_mllm",)),
                            max_tokens=256, **({"position": "reassigned"} if kind == "h2o" else {}))
                o.add_turn("Remember: the code is 7390." if kind != "h2o" else "Remember: the code is 4821.", "Noted.")
            o.save(d)
        return d

    results = {}
    for row, (corrupt, _, _) in ROWS.items():
        d = tmp_path / row
        d.mkdir(mode=0o700)
        for p in base.iterdir():
            (d / p.name).write_bytes(p.read_bytes())
        corrupt(d, other)
        monkeypatch.setattr("sys.stdin", io.StringIO("What is the code?\n"))
        rc = main(["chat", "--load", str(d), "--max-new-tokens", "4"])
        out, err = capsys.readouterr()
        results[row] = (rc, err)
        assert rc == 2 and not out, (row, err)
        assert err.startswith("kvtrim: error:") and len(err.splitlines()) == 1 and CHANGED in err, (row, err)
    assert len(results) == 23
