"""Evaluation suite: offline long-context task generators and their scorers.

See :mod:`kvtrim.eval.tasks` for the tasks and :mod:`kvtrim.eval.common` for the token-count
convention (the plain prompt text, no special tokens, no chat template).
"""

from kvtrim.eval.common import Sample, Turn, count_tokens
from kvtrim.eval.metrics import contains_any, exact_match, recall_all, score, score_turns
from kvtrim.eval.tasks import DEPTH_TASKS, SCORERS, TASKS, even_depths, get_task, make_samples

__all__ = [
    "DEPTH_TASKS",
    "SCORERS",
    "Sample",
    "TASKS",
    "Turn",
    "contains_any",
    "count_tokens",
    "even_depths",
    "exact_match",
    "get_task",
    "make_samples",
    "recall_all",
    "score",
    "score_turns",
]
