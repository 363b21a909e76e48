"""Lock-step decoding of many kvtrim caches as the rows of one batch (what makes ``kvtrim eval`` fast).

A sweep decodes the same sample under many (method, budget) configurations, each with its own
``KVTrimCache``. At batch size 1 a decode step of a small model is bound by reading the weights
(on 2 CPU cores, about 90% of a 135M model's step is its linear layers), so stepping the
configurations one after another reads the weights once per configuration. Here the
configurations advance together: one forward pass carries one row per configuration, the linear
layers read their weights once, and only attention runs per row, each against its own cache
(which keeps its own policy, positions and evictions, exactly as at batch 1).

``MultiCache`` is the transformers cache that fans a batch out to batch-1 ``KVTrimCache`` objects;
kvtrim's attention function (``kvtrim.integrations.hf``) attends row by row with each row's
binding. Results equal batch-1 decoding up to floating-point rounding of the batched matmuls.

Decoding logic is written as generators that ``yield Step(...)`` (feed these ids through this
cache, get the logits back) and ``yield Wait(key)`` (get another generator's result when it is
done); ``drive`` runs a set of them, batching every step that feeds the same number of tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass
from typing import TypeVar

import torch
from transformers.cache_utils import Cache

from kvtrim.cache import ACTIVE, KVTrimCache, RowBindings
from kvtrim.decoding import explicit_positions
from kvtrim.errors import KVTrimError


class MultiCache(Cache):
    """A transformers cache whose batch rows are separate batch-1 ``KVTrimCache`` objects.

    transformers' mask and position helpers see the first row's layers (kvtrim's attention
    function ignores that mask and builds each row's own); ``update`` hands each row's new keys
    and values to its cache and publishes every row's binding for the attention function.
    """

    def __init__(self, caches: list[KVTrimCache]):
        if not caches:
            raise KVTrimError("MultiCache needs at least one cache")
        super().__init__(layers=list(caches[0].layers))
        self.caches = caches

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if key_states.shape[0] != len(self.caches):
            raise KVTrimError(f"MultiCache holds {len(self.caches)} caches but the batch has {key_states.shape[0]} rows")
        extra = kwargs.get("kwargs") or {}
        pos = extra.get("position_ids") if isinstance(extra, dict) else None
        rows = []
        for b, cache in enumerate(self.caches):
            kw = dict(extra) if isinstance(extra, dict) else {}
            if pos is not None:
                kw["position_ids"] = pos[b:b + 1]
            k, v = cache.update(key_states[b:b + 1], value_states[b:b + 1], layer_idx, kwargs=kw)
            bound = ACTIVE.get()
            assert not isinstance(bound, RowBindings)  # a row's update() binds its own layer or nothing
            rows.append((bound, k, v))
            ACTIVE.set(None)
        ACTIVE.set(RowBindings(rows))
        return key_states, value_states


@torch.inference_mode()
def step_many(model, caches: list[KVTrimCache], feeds: list[list[int]], all_logits: bool = False) -> list[torch.Tensor]:
    """Feed ``feeds[b]`` through ``caches[b]`` for every row in one forward pass (inside ``attach``).

    All feeds must have the same length. Returns per row the last position's logits ``[V]``, or
    with ``all_logits`` those of every fed position ``[n, V]``.
    """
    from kvtrim.integrations.hf import cache_kwarg

    n = len(feeds[0])
    if n == 0 or any(len(f) != n for f in feeds):
        raise KVTrimError("step_many needs non-empty feeds of one length")
    device = next(model.parameters()).device
    ids = torch.tensor(feeds, device=device)
    pos = torch.stack([explicit_positions(c, n) for c in caches]).to(device)
    cache = caches[0] if len(caches) == 1 else MultiCache(caches)
    kw = {cache_kwarg(): cache, "use_cache": True, "logits_to_keep": 0 if all_logits else 1, "position_ids": pos}
    logits = model(input_ids=ids, **kw).logits.float()
    return [logits[b] if all_logits else logits[b, -1] for b in range(len(caches))]


@dataclass
class Clock:
    """Decode time charged to one generator: its share of each batched step (step time / rows)."""

    seconds: float = 0.0
    steps: int = 0
    rows: int = 0  # sum over steps of the rows that shared it

    @property
    def mean_rows(self) -> float:
        return self.rows / self.steps if self.steps else 1.0


@dataclass
class Step:
    """Request: feed ``ids`` through ``cache``; the generator receives the logits."""

    cache: KVTrimCache
    ids: list[int]
    all_logits: bool = False
    clock: Clock | None = None


@dataclass
class Wait:
    """Request: the result of the generator registered under ``key`` (once it has finished)."""

    key: Hashable


Program = Generator["Step | Wait", object, dict]
_Key = TypeVar("_Key", bound=Hashable)


@dataclass
class _Pending:
    gen: Program
    request: "Step | Wait | None" = None
    done: bool = False
    result: object = None


def drive(model, programs: dict[_Key, Program], *, batch: bool = True, max_rows: int = 64,
          on_done: Callable[[_Key, object], None] | None = None) -> dict:
    """Run generator ``programs`` to completion, batching their steps; returns ``{key: result}``.

    With ``batch=False`` every step runs alone (batch 1), in program order: the reference behaviour.
    ``on_done(key, result)`` is called as each program finishes (results are written as they come).
    """
    state = {k: _Pending(g) for k, g in programs.items()}
    results: dict = {}

    def advance(key, value) -> None:
        p = state[key]
        try:
            p.request = p.gen.send(value)
        except StopIteration as stop:
            p.done, p.request = True, None
            results[key] = stop.value
            if on_done is not None:
                on_done(key, stop.value)

    for key in list(state):
        advance(key, None)
        if not batch:  # run each program through before starting the next
            while not state[key].done and _serve(model, state, results, advance, [key], max_rows=1):
                pass
    while any(not p.done for p in state.values()):
        live = [k for k, p in state.items() if not p.done]
        if not _serve(model, state, results, advance, live, max_rows=max_rows if batch else 1):
            missing = {r.key for r in (state[k].request for k in live) if isinstance(r, Wait)}
            raise KVTrimError(f"eval programs wait for results that never come: {sorted(map(str, missing))}")
    return results


def _serve(model, state, results, advance, keys, max_rows: int) -> bool:
    """Answer what can be answered among ``keys``; False when nothing could (a dead wait)."""
    progressed = False
    for key in keys:
        req = state[key].request
        if isinstance(req, Wait) and req.key in results:
            advance(key, results[req.key])
            progressed = True
    groups: dict[tuple[int, bool], list] = {}
    for key in keys:
        req = state[key].request
        if isinstance(req, Step):
            groups.setdefault((len(req.ids), req.all_logits), []).append(key)
    for members in groups.values():
        for i in range(0, len(members), max_rows):
            chunk = members[i:i + max_rows]
            reqs = [state[k].request for k in chunk]
            t0 = time.perf_counter()
            out = step_many(model, [r.cache for r in reqs], [r.ids for r in reqs], reqs[0].all_logits)
            dt = time.perf_counter() - t0
            for k, r, logits in zip(chunk, reqs, out):
                if r.clock is not None:
                    r.clock.seconds += dt / len(chunk)
                    r.clock.steps += 1
                    r.clock.rows += len(chunk)
                advance(k, logits)
            progressed = True
    return progressed
