"""Property-based fuzzing of the Python API: policies built from every registered method with
generated parameters (each field of the method's dataclass, and unknown ones) of awkward values,
caches over them, ``generate_ids`` and ``generate_batch`` with generated prompts, budgets and
sampler settings, and sessions fed generated turns and streams -- on a tiny random model.

The property: each call returns, or raises one :class:`~kvtrim.errors.KVTrimError` line; never
another exception, never a hang; a generation that returns has at most ``max_new_tokens`` tokens
and a bounded method's cache holds what its budget allows. Examples per run: ``tests/fuzzing.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from conftest import tiny_llama
from fuzzing import count, fuzz_settings, no_hang
from hypothesis import given
from hypothesis import strategies as st

import kvtrim
from kvtrim.errors import KVTrimError
from kvtrim.registry import get_policy_class, method_names
from kvtrim.session import Session

VOCAB = 128
ODD = st.one_of(st.integers(-3, 300), st.sampled_from([0, 1, 2**31, 2**64, -(2**63)]),
                st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([None, True, "0.5", "true", [], (1,)]),
                st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0, 1.5]))


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(vocab_size=VOCAB, max_position_embeddings=256)


def mostly(valid, odd=ODD):
    """``valid`` seven times in eight: enough calls get past every check to exercise what follows them."""
    return st.integers(0, 7).flatmap(lambda i: odd if i == 7 else valid)


@st.composite
def policy_args(draw):
    name = draw(mostly(st.sampled_from(method_names()), st.just("nosuch")))
    fields = [f.name for f in dataclasses.fields(get_policy_class(name))] if name != "nosuch" else ["keep"]
    keys = draw(st.one_of(st.just([]), st.just([]), st.lists(st.sampled_from([*fields, "bogus"]), max_size=3, unique=True)))
    kw = {k: draw(ODD) for k in keys}
    if name != "nosuch" and get_policy_class(name).takes_budget and draw(st.integers(0, 3)):  # a sensible budget
        kw.pop("keep", None), kw.pop("max_tokens", None)
        kw[draw(st.sampled_from(["keep", "max_tokens"]))] = draw(st.sampled_from([0.5, 0.25, 48, 64]))
    return name, kw


def _one_line(e: KVTrimError) -> None:
    assert str(e) and "\n" not in str(e), repr(str(e))


def _call(what: str, fn):
    """Run ``fn``; a KVTrimError is a refusal (one line), anything else fails the test."""
    try:
        with no_hang():
            result = fn()
    except KVTrimError as e:
        _one_line(e)
        count(what, "refused")
        return None
    count(what, "ok")
    return result




#: token counts: valid small ones, or values that must be refused (a valid count in the millions is a
#: legitimately long run, not a hang: a streaming method has no context limit and no EOS here)
TOKEN_COUNTS = mostly(st.integers(0, 6), ODD.filter(lambda v: not (isinstance(v, int) and v > 64)))

ids = st.one_of(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=40),
                st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=40),
                st.lists(st.one_of(st.integers(3, VOCAB - 1), st.sampled_from([-1, VOCAB, 10**9, 2.5, True, None])),
                         max_size=40))


@fuzz_settings(0.15)
@given(p=policy_args(), prompt=ids, new=TOKEN_COUNTS, sample=st.booleans(),
       temperature=mostly(st.floats(0.1, 2.0)), top_p=mostly(st.floats(0.05, 1.0)), seed=mostly(st.integers(0, 99)),
       chunk=mostly(st.one_of(st.none(), st.integers(2, 50))))
def test_policies_caches_and_generation_succeed_or_refuse_in_one_line(lm, p, prompt, new, sample, temperature, top_p,
                                                                     seed, chunk):
    name, kw = p
    policy = _call("api: create_policy", lambda: kvtrim.create_policy(name, **kw))
    if policy is None:
        return
    _call("api: KVTrimCache", lambda: kvtrim.KVTrimCache(lm, policy))
    r = _call("api: generate_ids", lambda: kvtrim.generate_ids(
        lm, None, prompt, policy, max_new_tokens=new, do_sample=sample, temperature=temperature, top_p=top_p,
        seed=seed, prefill_chunk=chunk))
    if r is not None:
        assert r.new_tokens <= new and r.prompt_tokens == len(prompt)
        if policy.max_tokens is not None and policy.can_stream():
            assert r.stored_tokens <= policy.max_tokens + max(new, 0) + len(prompt)
    b = _call("api: generate_batch", lambda: kvtrim.generate_batch(
        lm, None, [prompt, prompt[:5]], policy, max_new_tokens=new, do_sample=sample, temperature=temperature,
        top_p=top_p, seed=seed))
    if b is not None:
        assert len(b) == 2


@fuzz_settings(0.1)
@given(p=policy_args(), turns=st.lists(st.tuples(ids, TOKEN_COUNTS), min_size=1, max_size=4),
       stream=ids, chunk=mostly(st.integers(1, 16)), seed=mostly(st.integers(0, 99)))
def test_sessions_succeed_or_refuse_in_one_line(lm, p, turns, stream, chunk, seed):
    name, kw = p
    s = _call("api: Session", lambda: Session(lm, None, name, seed=seed, **kw))
    if s is None:
        return
    for prompt, new in turns:
        out = _call("api: send_ids", lambda prompt=prompt, new=new: s.send_ids(prompt, max_new_tokens=new))
        if out is not None:
            assert len(out) <= new
    stats = _call("api: feed_ids", lambda: s.feed_ids(stream, chunk=chunk))
    if stats is not None:
        assert sum(c.tokens for c in stats) == len(stream)
        assert all(math.isfinite(c.nll_sum) for c in stats)
