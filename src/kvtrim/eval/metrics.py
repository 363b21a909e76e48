"""Scoring a model's output against a sample's answers (RULER-style string matching).

- ``contains_any``: 1.0 if any acceptable answer occurs in the output (RULER ``string_match_part``).
- ``recall_all``: the fraction of the answers that occur in the output (RULER ``string_match_all``).
- ``exact_match``: 1.0 if the normalised output equals a normalised answer.
- ``rouge_l``: ROUGE-L F1 of an output against a reference text (``labelfree``: a compressed
  cache's answer against the full cache's; needs the ``rouge-score`` package).

Matching is case-insensitive, and an answer must not be glued to letters or digits on either side
(so ``12345`` is not found in ``123456``, nor ``work`` in ``works``); RULER matches plain
substrings, which is laxer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvtrim.errors import KVTrimError


def _found(answer: str, prediction: str) -> bool:
    pattern = r"(?<![0-9A-Za-z])" + re.escape(answer.strip()) + r"(?![0-9A-Za-z])"
    return re.search(pattern, prediction, flags=re.IGNORECASE) is not None


def _norm(text: str) -> str:
    text = re.sub(r"\s+", " ", text.strip().lower())
    return text.strip(" .,;:!?\"'`")


def contains_any(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any acceptable answer occurs in ``prediction``, else 0.0."""
    return float(any(_found(a, prediction) for a in answers))


def recall_all(prediction: str, answers: Sequence[str]) -> float:
    """The fraction of ``answers`` that occur in ``prediction`` (all must be returned for 1.0)."""
    if not answers:
        return 0.0
    return sum(_found(a, prediction) for a in answers) / len(answers)


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if ``prediction`` equals an answer after lower-casing, trimming spaces and end punctuation."""
    p = _norm(prediction)
    return float(any(p == _norm(a) for a in answers))


_ROUGE = None


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 of ``prediction`` against ``reference`` (``rouge-score``'s ``rougeL``)."""
    global _ROUGE
    if _ROUGE is None:
        try:
            from rouge_score import rouge_scorer
        except ImportError:
            raise KVTrimError("the labelfree task needs the `rouge-score` package: pip install 'kvtrim[eval]'") from None
        _ROUGE = rouge_scorer.RougeScorer(["rougeL"])
    return float(_ROUGE.score(reference, prediction)["rougeL"].fmeasure)


METRICS = {"contains": contains_any, "recall": recall_all, "exact": exact_match}


def score(sample, prediction) -> float:
    """Score ``prediction`` for ``sample`` with the sample's metric.

    For a multi-turn sample pass one output per turn (a list); the result is the mean over turns.
    A single string scores the first turn only.
    """
    metric = METRICS.get(sample.metric)
    if metric is None:
        raise KVTrimError(f"unknown metric {sample.metric!r}; known: {', '.join(METRICS)}")
    if isinstance(prediction, str):
        return metric(prediction, sample.answers)
    turns = score_turns(sample, prediction)
    return sum(turns) / len(turns)


def score_turns(sample, predictions: Sequence[str]) -> list[float]:
    """Per-turn scores of a multi-turn sample (one prediction per turn, in order)."""
    turns = sample.turns or ()
    if not turns:
        raise KVTrimError(f"{sample.task}: not a multi-turn sample; pass one string to score()")
    if isinstance(predictions, str) or len(predictions) != len(turns):
        raise KVTrimError(f"{sample.task}: expected {len(turns)} predictions, one per turn")
    metric = METRICS[sample.metric]
    return [metric(p, t.answers) for p, t in zip(predictions, turns)]
