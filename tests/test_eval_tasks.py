"""Offline evaluation task generators (kvtrim.eval): lengths, answers, determinism, depths, scoring."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from kvtrim.errors import KVTrimError
from kvtrim.eval import DEPTH_TASKS, SCORERS, TASKS, count_tokens, make_samples, score, score_turns
from kvtrim.eval.metrics import contains_any, exact_match, recall_all

LENGTHS = (1000, 2000, 4000)


@pytest.fixture(scope="module")
def tok():
    try:
        from kvtrim.models import resolve_model

        path = resolve_model(None)[0]
    except KVTrimError as e:  # the embedded model is not installed
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_registry_lists_every_task():
    assert set(TASKS) == {"passkey", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
                          "vt", "cwe", "fwe", "multiturn", "niah_phrase"}
    assert set(SCORERS) == set(TASKS)
    assert set(DEPTH_TASKS) == set(TASKS) - {"cwe", "fwe"}


# ----------------------------------------------------------------------------- answers in the context


def _check_needles(s):
    for needle, pos in zip(s.meta["needles"], s.meta["positions"]):
        assert s.context.count(needle) == 1, needle
        assert s.context[pos : pos + len(needle)] == needle


def _check_recoverable(s):
    ctx = s.context
    if s.task == "passkey":
        (key,) = s.answers
        assert re.fullmatch(r"\d{5}", key)
        _check_needles(s)
        assert key in s.meta["needles"][0]
        assert key not in ctx.replace(s.meta["needles"][0], "")  # only at its insertion point
    elif s.task == "niah_phrase":
        (answer,) = s.answers
        _check_needles(s)
        needle = s.meta["needles"][0]
        assert answer in needle and ctx.count(answer) == 1  # only in its needle
        assert answer.lower() not in ctx.replace(needle, "").lower()
        assert answer not in s.question
    elif s.task.startswith("niah"):
        _check_needles(s)
        values = [v for vs in s.meta["values"].values() for v in vs]
        assert len(set(values)) == len(values)  # distractor values differ
        assert len(set(s.meta["keys"])) == len(s.meta["keys"])
        for v in values:
            assert ctx.count(v) == 1
        found = {}
        for key, value in re.findall(r"special magic numbers for (\S+) is: (\d+)\.", ctx):
            found.setdefault(key, []).append(value)
        assert sorted(v for k in s.meta["queries"] for v in found[k]) == sorted(s.answers)
        for k in s.meta["queries"]:
            assert k in s.question
    elif s.task == "vt":
        _check_needles(s)
        assignments = dict(re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", ctx))
        value = s.meta["values"][0]
        assert ctx.count(value) == 1 and value in s.question

        def resolve(name, depth=0):
            rhs = assignments[name]
            return resolve(rhs[4:], depth + 1) if rhs.startswith("VAR ") else rhs

        assert sorted(n for n in assignments if resolve(n) == value) == sorted(s.answers)
    elif s.task == "cwe":
        entries = re.findall(r"(\d+)\. ([a-z]+)", ctx)
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(w for _, w in entries)
        ranked = counts.most_common()
        k = len(s.answers)
        assert {w for w, _ in ranked[:k]} == set(s.answers)
        assert ranked[k - 1][1] > ranked[k][1]
    elif s.task == "fwe":
        counts = Counter(w for w in ctx.split() if w != "....")
        ranked = counts.most_common()
        assert {w for w, _ in ranked[:3]} == set(s.answers)
        assert ranked[2][1] > ranked[3][1]
    elif s.task == "multiturn":
        _check_needles(s)
        assert len(s.turns) == len(s.meta["keys"]) and s.turns[0].question == s.question
        assert len({t.question for t in s.turns}) == len(s.turns)
        for turn in s.turns:
            (answer,) = turn.answers
            assert ctx.count(answer) == 1
            fact = next(f for f in s.meta["needles"] if answer in f)
            key = next(k for k in s.meta["keys"] if k in fact)
            assert key in turn.question
    else:  # pragma: no cover
        raise AssertionError(s.task)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", sorted(TASKS))
def test_length_and_answers(tok, task, length):
    samples = make_samples(task, tok, length, n=2, seed=3)
    for s in samples:
        assert s.task == task and s.length == length
        assert s.n_tokens == count_tokens(tok, s.prompt)
        assert abs(s.n_tokens - length) <= 0.02 * length, (s.n_tokens, length)
        _check_recoverable(s)


def test_passkey_prompt_wording(tok):
    s = make_samples("passkey", tok, 1200, n=1)[0]
    assert s.prompt == (
        "Read the text and find the pass key.\n\n" + s.context
        + "\n\nWhat is the pass key? Reply with the 5-digit number."
    )
    assert s.meta["haystack"] in ("essays", "pydoc")


@pytest.mark.parametrize("haystack", ["filler", "pydoc"])
def test_other_haystacks(tok, haystack):
    for task in ("passkey", "niah_multikey", "vt"):
        s = make_samples(task, tok, 1500, n=1, seed=2, haystack=haystack)[0]
        assert s.meta["haystack"] == haystack
        assert abs(s.n_tokens - 1500) <= 30
        _check_recoverable(s)
    if haystack == "filler":
        assert "The grass is green." in s.context


# ----------------------------------------------------------------------------- determinism and depths


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_per_seed(tok, task):
    gen = TASKS[task]
    a = gen(tok, 1000, depth=0.3, seed=11)
    b = gen(tok, 1000, depth=0.3, seed=11)
    c = gen(tok, 1000, depth=0.3, seed=12)
    assert a == b
    assert a.context != c.context and a.answers != c.answers
    # make_samples records what rebuilds each sample
    s = make_samples(task, tok, 1000, n=3, seed=5)
    assert s == make_samples(task, tok, 1000, n=3, seed=5)
    assert s != make_samples(task, tok, 1000, n=3, seed=6)
    if s[1].depth is not None:
        assert gen(tok, 1000, depth=s[1].depth, seed=s[1].seed) == s[1]


@pytest.mark.parametrize("task", DEPTH_TASKS)
def test_depths_evenly_spread(tok, task):
    samples = make_samples(task, tok, 2000, n=5, seed=1)
    assert [s.depth for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    where = [s.meta["positions"][0] / len(s.context) for s in samples]
    assert where == sorted(where)
    for s, w in zip(samples, where):
        assert abs(w - s.depth) < 0.08, (s.depth, w)  # nearest sentence boundary to the depth
    first = samples[0]
    assert first.context.startswith(first.meta["needles"][0])
    assert make_samples(task, tok, 1000, n=1)[0].depth == 0.5
    custom = make_samples(task, tok, 1000, n=2, depths=[0.1, 0.9])
    assert [s.depth for s in custom] == [0.1, 0.9]


def test_last_needle_at_the_end(tok):
    s = make_samples("passkey", tok, 1000, n=1, depths=[1.0])[0]
    assert s.context.endswith(s.meta["needles"][0])


# ----------------------------------------------------------------------------- scoring


def _wrong(answer: str) -> str:
    if answer.isdigit():
        return str((int(answer) + 1) % 10 ** len(answer)).zfill(len(answer))
    return answer[::-1] + "zq"


@pytest.mark.parametrize("task", sorted(TASKS))
def test_scorer_accepts_right_rejects_wrong(tok, task):
    s = make_samples(task, tok, 1000, n=1, seed=4)[0]
    right = "The answer is: " + ", ".join(s.answers) + "."
    wrong = "The answer is: " + ", ".join(_wrong(a) for a in s.answers) + "."
    assert score(s, right) == 1.0
    assert score(s, wrong) == 0.0
    assert SCORERS[task](right, s.answers) == 1.0
    assert SCORERS[task](wrong, s.answers) == 0.0
    if s.metric == "recall":
        assert score(s, s.answers[0]) == pytest.approx(1 / len(s.answers))
    if task == "multiturn":
        outs = [f"It is {t.answers[0]}." for t in s.turns]
        assert score_turns(s, outs) == [1.0] * len(s.turns)
        assert score(s, outs[:-1] + ["I don't know."]) == pytest.approx(1 - 1 / len(s.turns))
        assert len(s.turn_prompts()) == len(s.turns) and s.turn_prompts()[0] == s.prompt
        with pytest.raises(KVTrimError):
            score_turns(s, outs[:1])


def test_metric_functions():
    assert contains_any("The pass key is 12345.", ["12345"]) == 1.0
    assert contains_any("123456", ["12345"]) == 0.0  # not glued to other digits
    assert contains_any("Works fine", ["work"]) == 0.0
    assert recall_all("alpha and BETA", ["alpha", "beta", "gamma"]) == pytest.approx(2 / 3)
    assert recall_all("anything", []) == 0.0
    assert exact_match("  12345. ", ["12345"]) == 1.0
    assert exact_match("12345 is it", ["12345"]) == 0.0


# ----------------------------------------------------------------------------- bad input


def test_unknown_task(tok):
    with pytest.raises(KVTrimError, match=r"unknown task 'nope'.*passkey"):
        make_samples("nope", tok, 1000)
    assert issubclass(KVTrimError, ValueError)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_bad_length_and_depth(tok, task):
    with pytest.raises(KVTrimError, match="too small"):
        make_samples(task, tok, 50)
    with pytest.raises(KVTrimError, match="integer"):
        make_samples(task, tok, 1000.5)
    for depth in (-0.1, 1.5, math.nan):
        with pytest.raises(KVTrimError, match=r"depth must be"):
            TASKS[task](tok, 1000, depth=depth)
        with pytest.raises(KVTrimError, match=r"depth must be"):
            make_samples(task, tok, 1000, n=1, depths=[depth])


def test_length_too_small_for_fixed_text(tok):
    with pytest.raises(KVTrimError, match=r"too small.*at least"):
        make_samples("niah_multiquery", tok, 140, n_keys=8)
    with pytest.raises(KVTrimError, match="too small"):
        make_samples("cwe", tok, 200)


def test_other_bad_input(tok):
    with pytest.raises(KVTrimError, match="unknown haystack"):
        make_samples("passkey", tok, 1000, haystack="nonsense")
    with pytest.raises(KVTrimError, match="unknown option"):
        make_samples("passkey", tok, 1000, n_keys=3)
    with pytest.raises(KVTrimError, match="2 depths for 3 samples"):
        make_samples("passkey", tok, 1000, n=3, depths=[0.0, 1.0])
    with pytest.raises(KVTrimError, match="n must be"):
        make_samples("passkey", tok, 1000, n=0)
    with pytest.raises(KVTrimError, match="too short"):
        make_samples("passkey", tok, 10_000_000)
    with pytest.raises(KVTrimError, match="n_keys"):
        make_samples("niah_multikey", tok, 1000, n_keys=1)


def test_task_options(tok):
    s = make_samples("niah_multikey", tok, 1500, n=1, seed=7, value_kind="uuid", n_keys=6)[0]
    assert len(s.meta["keys"]) == 6 and len(s.answers) == 1
    _check_needles(s)
    values = [v for vs in s.meta["values"].values() for v in vs]
    assert len(set(values)) == 6 and all(s.context.count(v) == 1 for v in values)
    assert re.fullmatch(r"[0-9a-f-]{36}", s.answers[0]) and "uuid" in s.question
    v = make_samples("vt", tok, 2000, n=1, seed=7, n_chains=3, n_hops=2)[0]
    assert len(v.answers) == 3 and len(v.meta["chains"]) == 3
    _check_recoverable(v)  # distractor chains carry other values
    m = make_samples("multiturn", tok, 2000, n=1, seed=7, n_questions=6)[0]
    assert len(m.turns) == 6
    _check_recoverable(m)


# ----------------------------------------------------------------------------- niah_phrase


def test_niah_phrase_families(tok):
    from kvtrim.eval.needles import FAMILIES

    mixed = make_samples("niah_phrase", tok, 1000, n=8, seed=2)
    assert [s.meta["family"] for s in mixed[:4]] == [FAMILIES[s.seed % 4] for s in mixed[:4]]
    assert {s.meta["family"] for s in mixed} == set(FAMILIES)  # consecutive samples rotate the families
    for family in FAMILIES:
        for s in make_samples("niah_phrase", tok, 1500, n=3, seed=5, family=family):
            assert s.meta["family"] == family
            assert abs(s.n_tokens - 1500) <= 0.02 * 1500
            _check_recoverable(s)
            (answer,) = s.answers
            assert len(tok(" " + answer, add_special_tokens=False)["input_ids"]) >= 2  # several tokens
            if family == "code":
                assert re.fullmatch(r"\d{4}", answer)
                assert score(s, f"It was {answer}.") == 1.0 and score(s, f"It was {answer[:-1]}.") == 0.0
            elif family == "compound":
                assert score(s, f"Under the {answer}.") == 1.0 and score(s, f"Under the {answer[:-3]}.") == 0.0
            else:
                assert len(answer.split()) == (2 if family == "name" else 3)
                assert score(s, answer.rsplit(" ", 1)[0]) == 0.0
    six = make_samples("niah_phrase", tok, 1000, n=1, family="code", code_digits=6)[0]
    assert re.fullmatch(r"\d{6}", six.answers[0])


def test_niah_phrase_reproducible_and_refusals(tok):
    a, b, c = (make_samples("niah_phrase", tok, 1200, n=2, seed=s) for s in (7, 7, 8))
    assert [x.prompt for x in a] == [x.prompt for x in b]
    assert [x.prompt for x in a] != [x.prompt for x in c]
    with pytest.raises(KVTrimError, match="family must be one of"):
        make_samples("niah_phrase", tok, 1000, family="poem")
    with pytest.raises(KVTrimError, match="code_digits"):
        make_samples("niah_phrase", tok, 1000, code_digits=1)
