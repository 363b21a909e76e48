"""Long-text tasks scored without labels: perplexity and agreement with the full cache.

- ``ppl``: a window of ``length`` tokens of package prose (the context) and the next
  ``continuation`` tokens of the same text (default 128). Score: perplexity of the continuation
  under the compressed cache of the context (lower is better). The continuation is teacher-forced
  in one forward pass after the compressed prefill (a policy "turn"), so a method's prefill
  compression is what is judged.
- ``labelfree``: Elastic Cache's label-free protocol. A passage of prose and an instruction
  ("Summarize the passage above ...", seed-chosen); the reference is the *full-cache* greedy
  answer, computed in the same run. Score: ROUGE-L F1 (``rouge-score``) of a method's greedy answer
  against that reference; the perplexity of the reference under the compressed cache is recorded
  next to it.

Both return a :class:`~kvtrim.eval.common.Sample` (``metric`` ``"ppl"`` or ``"rouge"``) sized with
the same token-count convention and 2% tolerance as every other generator. ``depth`` has no meaning
here: the window is chosen by the seed.
"""

from __future__ import annotations

from kvtrim.eval.common import (
    Sample,
    check_count,
    check_depth,
    check_length,
    count_tokens,
    cut,
    fit,
    join_prompt,
    make_rng,
    pick_window,
)

LABELFREE_INSTRUCTIONS = (
    "Summarize the passage above in a few sentences.",
    "Describe what the passage above is about.",
    "What is the main point of the passage above? Answer briefly.",
    "List the key ideas of the passage above.",
    "Explain the passage above to a beginner.",
    "What does the passage above say about its main subject?",
)

#: the default number of continuation tokens ``ppl`` scores
PPL_CONTINUATION = 128


def ppl(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None,
        continuation: int = PPL_CONTINUATION) -> Sample:
    """``length`` tokens of prose as context; ``meta["continuation"]`` is the text that follows it
    (``continuation`` tokens); ``answers`` holds the same text."""
    task = "ppl"
    check_length(task, length)
    check_depth(task, depth)
    check_count(task, "continuation", continuation, 8)
    rng = make_rng(task, seed)
    window, ratio, hay_name = pick_window(task, tokenizer, length + continuation, rng, haystack)

    def build(n):
        text = cut(window, n)
        return text, text

    context, n_tok = fit(task, tokenizer, length, build, int(length * ratio), ratio)
    rest = window[len(context):]
    ids = tokenizer(rest, add_special_tokens=False)["input_ids"][:continuation]
    cont = tokenizer.decode(ids)
    if count_tokens(tokenizer, cont) < continuation // 2:
        from kvtrim.errors import KVTrimError

        raise KVTrimError(f"{task}: the {hay_name} haystack has no continuation after {length} tokens")
    meta = {"continuation": cont, "haystack": hay_name, "continuation_tokens": len(ids)}
    return Sample(task, context, "", [cont], n_tok, (), seed, length, "ppl", "", (), meta)


def labelfree(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None) -> Sample:
    """A passage of ``length`` tokens (with the instruction) and a seed-chosen instruction; no
    answers (the reference is the full cache's answer, made by the runner)."""
    task = "labelfree"
    check_length(task, length)
    check_depth(task, depth)
    rng = make_rng(task, seed)
    window, ratio, hay_name = pick_window(task, tokenizer, length, rng, haystack)
    instruction = LABELFREE_INSTRUCTIONS[rng.randrange(len(LABELFREE_INSTRUCTIONS))]
    fixed = count_tokens(tokenizer, instruction)

    def build(n):
        text = cut(window, n)
        return join_prompt("", text, instruction), text

    context, n_tok = fit(task, tokenizer, length, build, int((length - fixed) * ratio), ratio)
    return Sample(task, context, instruction, [], n_tok, (), seed, length, "rouge", "", (), {"haystack": hay_name})


LONGTEXT_TASKS = {"ppl": ppl, "labelfree": labelfree}
