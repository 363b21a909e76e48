"""The programs of ``kvtrim eval``: one (method, budget) configuration on one recorded sample.

A program (``kvtrim.decoding``) replays the sample's recorded prefill into the configuration's
own cache (``kvtrim.eval.replay``), then decodes greedily (``kvtrim.decoding.decode``) or
teacher-forces (``kvtrim.decoding.teacher_forced_nll``) and scores the answer; it returns the
fields of its result line. Programs only ``yield`` steps, so a sweep runs all configurations of a
sample together as rows of one batch (``kvtrim.integrations.batched.drive``) or one at a time.

Greedy decoding stops at EOS, at ``MAX_NEW_TOKENS[task]``, or once the answer is complete --
every answer found and the text ending in a non-alphanumeric character, so more tokens cannot
change the score (:func:`answer_complete`). Multi-turn samples feed each later question as a new
turn through the same cache; ``ppl`` teacher-forces its continuation; ``labelfree`` scores a
compressed cache's answer against the full cache's (ROUGE-L) and the full answer's perplexity
under the compressed cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from kvtrim.decoding import Clock, Step, Wait, decode, teacher_forced_nll
from kvtrim.errors import KVTrimError
from kvtrim.eval.metrics import METRICS, rouge_l
from kvtrim.eval.metrics import score as score_text
from kvtrim.eval.plan import MAX_NEW_TOKENS, REFERENCE


def prompt_ids(tokenizer, sample, plain: bool = False) -> list[int]:
    """The sample's prompt ids: one user turn (the chat template, or kvtrim's plain format without one or
    with ``plain``: ``kvtrim.models.build_prompt_ids``); ``ppl``: the plain text."""
    from kvtrim.models import build_prompt_ids

    if sample.task == "ppl":
        return list(tokenizer(sample.context, add_special_tokens=True)["input_ids"])
    return build_prompt_ids(tokenizer, sample.prompt, plain=plain)


def turn_tail(tokenizer, question: str, plain: bool = False) -> list[int]:
    """:func:`kvtrim.models.next_turn_ids`: the ids of a later question, in the prompt's format."""
    from kvtrim.models import next_turn_ids

    return next_turn_ids(tokenizer, question, plain)


def config_program(model, tokenizer, sample, recording, method: str, keep: float | None, memo: dict | None,
                   reference: list[int] | None = None, reference_key=None, plain: bool = False,
                   params: dict | None = None, kv_bits: int = 16):
    """Program (``kvtrim.decoding``) for one (method, keep) on one recorded sample: replay, then
    decode/teacher-force and score; returns the line's fields. For ``labelfree`` a compressed
    configuration needs the full cache's answer: ``reference``, or the result of the program
    registered under ``reference_key``. ``plain``: later turns in kvtrim's plain format (as the
    prompt, :func:`prompt_ids`). ``params``: further policy parameters (a benchmark's variants;
    ``kvtrim eval`` runs every method with its defaults). ``kv_bits``: the bits per stored key and
    value element of the configuration's cache (``KVTrimCache(kv_bits=)``; 16: the model's dtype)."""
    from kvtrim.eval.replay import make_policy, replay

    params = ({} if keep is None else {"keep": keep}) | dict(params or {})
    eos = getattr(tokenizer, "eos_token_id", None)
    stop = () if eos is None else (eos,)
    def policy_for_replay():
        policy = make_policy(method, params, memo)
        if policy.needs_reconstruction:  # kvzip: the reconstruction forward, once per prompt (memo)
            from kvtrim.reconstruction import prepare, recorded_kv, repeat_ids

            prepare(policy, model, recorded_kv(recording), prompt_ids(tokenizer, sample, plain),
                    repeat_ids(tokenizer, plain), memo=memo)
        return policy

    policy = policy_for_replay()
    t0 = time.perf_counter()
    cache = replay(model, policy, recording, kv_bits=kv_bits)
    # kvzip: its reconstruction is computed once per prompt for every budget (memo); each budget's line
    # counts it, as each counts the shared recorded prefill (record_seconds)
    reconstruct = float(getattr(policy, "reconstruction_seconds", 0.0)) if policy.needs_reconstruction else None
    compress = time.perf_counter() - t0 + (reconstruct or 0.0)
    logits = recording.logits
    extra: dict = {}
    max_new = MAX_NEW_TOKENS[sample.task]
    clock = Clock()
    if sample.task == "ppl":
        target = tokenizer(sample.meta["continuation"], add_special_tokens=False)["input_ids"]
        nll = yield from teacher_forced_nll(cache, logits, target, clock)
        out, steps = [], 1
        extra = {"nll_sum": nll, "n_target": len(target)}
        value = math.exp(nll / len(target))
        answer = ""
    elif sample.task == "labelfree":
        out, steps = yield from decode(cache, logits, max_new, stop_ids=stop, clock=clock)
        answer = tokenizer.decode([t for t in out if t != eos], skip_special_tokens=True).strip()
        if method == REFERENCE and kv_bits == 16:  # the full cache's answer is the reference
            reference = out  # (a full cache at fewer bits is scored against it, as every other configuration)
        elif reference is None:
            if reference_key is None:
                raise KVTrimError("labelfree needs the full cache's answer (reference or reference_key)")
            reference = (yield Wait(reference_key))["answer_ids"]
        ref_text = tokenizer.decode([t for t in reference if t != eos], skip_special_tokens=True).strip()
        value = rouge_l(answer, ref_text) if ref_text else float(answer == ref_text)
        extra = {"answer_ids": out}
    elif sample.turns:
        answers, scores, steps = [], [], 0
        for ti, turn in enumerate(sample.turns):
            if ti:
                feed = ([] if not out or out[-1] == eos else [out[-1]]) + turn_tail(tokenizer, turn.question, plain)
                logits = yield Step(cache, feed, False, clock)
                steps += 1
            def done(ids, t=turn):
                return answer_complete(tokenizer, sample.metric, ids, t.answers, eos)

            out, s = yield from decode(cache, logits, max_new, stop_ids=stop, finished=done, clock=clock)
            steps += s
            text = tokenizer.decode([t for t in out if t != eos], skip_special_tokens=True).strip()
            answers.append(text)
            scores.append(score_text_one(tokenizer, sample.metric, out, turn.answers, eos))
        value = sum(scores) / len(scores)
        answer = answers[0]
        extra = {"answers": answers, "turn_scores": scores}
    else:
        def complete(ids):
            return answer_complete(tokenizer, sample.metric, ids, sample.answers, eos)

        out, steps = yield from decode(cache, logits, max_new, stop_ids=stop, finished=complete, clock=clock)
        answer = tokenizer.decode([t for t in out if t != eos], skip_special_tokens=True).strip()
        value = score_text(sample, answer)
    stored = cache.stored_tokens()
    row = {
        "score": value,
        "correct": bool(value >= 1.0) if sample.metric not in ("ppl", "rouge") else None,
        "answer": answer,
        "new_tokens": len(out),
        "kv_bytes": cache.kv_bytes(),
        "kv_bytes_full": cache.kv_bytes_full(),
        "kv_bytes_stored": cache.kv_bytes_stored(),
        "stored_tokens": max(stored) if stored else 0,
        "record_seconds": recording.seconds,
        "compress_seconds": compress,
        "prefill_seconds": recording.seconds + compress,
        "decode_seconds": clock.seconds,
        "decode_steps": steps,
        "decode_rows": round(clock.mean_rows, 3),
    }
    if reconstruct is not None:
        row["reconstruct_seconds"] = reconstruct  # included in compress_seconds and prefill_seconds
    del cache
    if sample.task == "labelfree" and method != REFERENCE:
        ref_nll = None
        # perplexity of the full cache's answer under this method's cache: a fresh replay (the greedy run moved it)
        if reference:
            cache2 = replay(model, policy_for_replay(), recording, kv_bits=kv_bits)
            ref_nll = yield from teacher_forced_nll(cache2, recording.logits, list(reference))
            del cache2
        extra.update({"ref_nll_sum": ref_nll, "ref_tokens": len(reference or [])})
    row.update(extra)
    return row


def answer_complete(tokenizer, metric: str, ids: list[int], answers: Sequence[str], eos) -> bool:
    """True once more tokens cannot change the score: every answer is found (score 1) *and* the text
    ends in a character that is not a letter or digit. (An answer at the very end could still be
    extended -- "14314" + "5" -- which the metrics' word-boundary check would then reject.)"""
    text = tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)
    return bool(text) and not text[-1].isalnum() and METRICS[metric](text, answers) >= 1.0


def score_text_one(tokenizer, metric: str, ids: list[int], answers: Sequence[str], eos) -> float:
    text = tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)
    return METRICS[metric](text, answers)
