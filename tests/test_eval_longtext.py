"""The label-free long-text tasks (ppl, labelfree): lengths, determinism, continuation."""

from __future__ import annotations

import pytest

from kvtrim.errors import KVTrimError
from kvtrim.eval import count_tokens
from kvtrim.eval.longtext import LABELFREE_INSTRUCTIONS, LONGTEXT_TASKS, labelfree, ppl


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer


@pytest.mark.parametrize("length", (512, 2048, 4096))
@pytest.mark.parametrize("task", sorted(LONGTEXT_TASKS))
def test_lengths_within_two_percent(tok, task, length):
    s = LONGTEXT_TASKS[task](tok, length, seed=3)
    assert abs(count_tokens(tok, s.prompt) - length) <= 0.02 * length
    assert s.n_tokens == count_tokens(tok, s.prompt)


@pytest.mark.parametrize("task", sorted(LONGTEXT_TASKS))
def test_deterministic_per_seed(tok, task):
    a, b, c = (LONGTEXT_TASKS[task](tok, 1024, seed=s) for s in (5, 5, 6))
    assert a == b
    assert a.context != c.context


def test_ppl_continuation_follows_the_context(tok):
    s = ppl(tok, 1024, seed=1, haystack="pydoc", continuation=64)
    cont = s.meta["continuation"]
    assert s.metric == "ppl" and s.answers == [cont]
    assert 32 <= len(tok(cont, add_special_tokens=False)["input_ids"]) <= 66
    from kvtrim.data import pydoc_text

    text = pydoc_text()
    at = text.find(s.context[-200:])
    assert at >= 0  # the context is a stretch of the source ...
    following = text[at + 200 : at + 200 + len(cont) + 50]
    assert cont.strip()[:40] in following  # ... and the continuation is what comes next


def test_labelfree_prompt(tok):
    s = labelfree(tok, 1024, seed=2)
    assert s.metric == "rouge" and s.answers == []
    assert s.question in LABELFREE_INSTRUCTIONS and s.prompt.endswith(s.question)


def test_bad_input(tok):
    with pytest.raises(KVTrimError, match="length"):
        ppl(tok, 10)
    with pytest.raises(KVTrimError, match="continuation"):
        ppl(tok, 512, continuation=2)
    with pytest.raises(KVTrimError, match="haystack"):
        labelfree(tok, 512, haystack="nope")
