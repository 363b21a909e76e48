"""The evaluation's side of :mod:`kvtrim.recording`: one recorded prefill per sample, replayed
into each (method, budget) configuration's cache; :func:`make_policy` builds a configuration's
policy and lets several budgets of one prompt share their budget-independent prefill scores."""

from __future__ import annotations

from kvtrim.policies.base import Policy
from kvtrim.recording import Recorder, Recording, record_prefill, replay, replayable

__all__ = ["Recorder", "Recording", "make_policy", "record_prefill", "replay", "replayable"]


def make_policy(method: str, params: dict, memo: dict | None = None) -> Policy:
    """``create_policy(method, **params)`` (``method`` may carry parameters, ``kvtrim.registry.split_method``); with ``memo`` (one dict per prompt) a method that declares
    ``shares_prefill_scores`` computes its per-prompt prefill scores once for all budgets."""
    from kvtrim.registry import create_policy, split_method

    name, given = split_method(method)  # a method with parameters (kvtrim eval's snapkv:layers=adaptive)
    policy = create_policy(name, **given, **params)
    if memo is not None and policy.shares_prefill_scores:
        policy.share_prefill_scores(memo)
    return policy
