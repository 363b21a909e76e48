"""Property-based fuzzing of saved sessions: a real session directory (a tiny model's), mutated --
fields of ``manifest.json`` and ``session.json`` deleted, retyped or replaced (with the manifest's
checksums recomputed or not, so the checks behind the checksums run too), ``cache.safetensors``
cut, bit-flipped or emptied, any file replaced by a FIFO, a directory, a symbolic link or nothing,
stray files added -- then loaded with :func:`kvtrim.session_file.read_session` and
:meth:`kvtrim.session.Session.load`, and saved over.

The property: a load either gives a session that goes on working, or raises one
:class:`~kvtrim.errors.SessionError` line; never another exception, never a hang, never a change
to the directory it read; a save either replaces a session directory or refuses, and never writes
through a link. Examples per run: ``tests/fuzzing.py`` (``KVTRIM_FUZZ_PROFILE``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import tiny_llama
from fuzzing import changed_outside, count, fuzz_settings, no_hang, snapshot
from hypothesis import given
from hypothesis import strategies as st

from kvtrim.errors import KVTrimError, SessionError
from kvtrim.session import Session
from kvtrim.session_file import CACHE_FILE, MANIFEST_FILE, SESSION_FILE, read_session

FILES = (MANIFEST_FILE, SESSION_FILE, CACHE_FILE)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model and a session of it saved after a fed stream and two turns (chat=False: no tokenizer)."""
    model = tiny_llama(vocab_size=128, max_position_embeddings=512)
    s = Session(model, None, "inf_mllm", max_tokens=48, position="reassigned", chat=False)
    s.feed_ids(list(range(3, 90)), chunk=32)
    s.send_ids([5, 6, 7, 8], max_new_tokens=4)
    s.send_ids([9, 10], max_new_tokens=3)
    d = tmp_path_factory.mktemp("fuzz-session") / "orig"
    s.save(d)
    return model, d


def _paths(obj, prefix=()):
    """Every (path, value) inside a JSON document."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


@st.composite
def json_edit(draw, doc):
    """``doc`` with one field deleted, replaced by another JSON value, or retyped."""
    paths = [p for p, _ in _paths(doc) if p]
    if not paths:
        return draw(JSON_VALUES)
    path = draw(st.sampled_from(paths))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    how = draw(st.sampled_from(["delete", "replace", "retype"]))
    if how == "delete":
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    elif how == "replace":
        parent[path[-1]] = draw(JSON_VALUES)
    else:
        v = parent[path[-1]]
        parent[path[-1]] = (str(v) if not isinstance(v, str) else [v]) if draw(st.booleans()) else \
            (v * 1000 + 17 if isinstance(v, int) and not isinstance(v, bool) else None)
    return doc


def _rehash(d: Path) -> None:
    """Recompute the manifest's checksums of the (edited) files, so the checks behind them run."""
    m = json.loads((d / MANIFEST_FILE).read_bytes())
    if isinstance(m, dict) and isinstance(m.get("files"), dict):
        for name in (SESSION_FILE, CACHE_FILE):
            if (d / name).is_file() and not (d / name).is_symlink():
                m["files"][name] = hashlib.sha256((d / name).read_bytes()).hexdigest()
        (d / MANIFEST_FILE).write_text(json.dumps(m))


@st.composite
def mutation(draw):
    return draw(st.lists(st.tuples(st.sampled_from(FILES), st.sampled_from(
        ["edit", "edit", "edit", "cut", "flip", "empty", "fifo", "dir", "link", "dangling", "remove", "garbage"]),
        st.integers(0, 10**6)), min_size=1, max_size=3)), draw(st.booleans()), draw(st.booleans())


def _apply(d: Path, victim: Path, steps, rehash: bool, extra: bool, data) -> None:
    for name, how, n in steps:
        p = d / name
        if p.is_symlink() or not p.exists():
            if how in ("fifo", "dir", "link", "dangling", "garbage"):
                p.unlink(missing_ok=True) if p.is_symlink() else None
            else:
                continue
        elif not p.is_file():
            continue
        if how == "edit" and name != CACHE_FILE:
            try:
                doc = json.loads(p.read_bytes())
            except ValueError:
                continue
            p.write_text(json.dumps(data.draw(json_edit(doc))))
        elif how in ("cut", "edit"):
            raw = p.read_bytes()
            p.write_bytes(raw[: n % (len(raw) + 1)])
        elif how == "flip":
            raw = bytearray(p.read_bytes())
            if raw:
                raw[n % len(raw)] ^= 1 << (n % 8)
            p.write_bytes(bytes(raw))
        elif how == "empty":
            p.write_bytes(b"")
        elif how == "garbage":
            p.unlink(missing_ok=True)
            p.write_bytes(data.draw(st.binary(max_size=64)))
        else:
            p.unlink(missing_ok=True)
            if how == "fifo":
                os.mkfifo(p)
            elif how == "dir":
                p.mkdir()
            elif how == "link":
                p.symlink_to(victim)
            elif how == "dangling":
                p.symlink_to(d / "nowhere")
    if rehash and (d / MANIFEST_FILE).is_file() and not (d / MANIFEST_FILE).is_symlink():
        try:
            _rehash(d)
        except ValueError:
            pass
    if extra:
        (d / "stray.txt").write_text("x")


@fuzz_settings(0.2)
@given(data=st.data(), m=mutation())
def test_a_damaged_session_loads_and_works_or_is_one_line(saved, tmp_path_factory, data, m):
    model, orig = saved
    steps, rehash, extra = m
    root = tmp_path_factory.mktemp("s")
    victim = root / "victim.txt"
    victim.write_text("precious\n")
    d = root / "sess"
    shutil.copytree(orig, d)
    _apply(d, victim, steps, rehash, extra, data)
    before = snapshot(root)
    outcome = "ok"
    with no_hang():
        try:
            read_session(d, model)
            s = Session.load(d, model)
        except SessionError as e:
            assert "\n" not in str(e), str(e)
            outcome = "refused"
        else:
            try:  # a loaded session goes on working
                s.send_ids([11, 12, 13], max_new_tokens=2)
            except KVTrimError as e:
                assert "\n" not in str(e)
                outcome = "ok, refused a turn"
    count("sessions: load", outcome)
    assert changed_outside(before, snapshot(root), []) == [], "loading changed the files it read"
    # saving over it: a session directory is replaced, anything else refused; the victim never changes
    with no_hang():
        fresh = Session(model, None, "inf_mllm", max_tokens=48, position="reassigned", chat=False)
        fresh.send_ids([5, 6], max_new_tokens=2)
        try:
            fresh.save(d)
            count("sessions: save over", "ok")
            Session.load(d, model)  # what a save left is a whole session
        except SessionError as e:
            assert "\n" not in str(e)
            count("sessions: save over", "refused")
            assert changed_outside(before, snapshot(root), []) == [], "a refused save changed files"
    assert victim.read_text() == "precious\n"
