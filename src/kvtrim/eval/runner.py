"""``kvtrim eval``: a resumable sweep of tasks x lengths x methods x budgets on one model.

Layout of an output directory::

    DIR/config.json              the model the sweep belongs to (a rerun with another model is refused)
    DIR/runs/{task}-{length}.jsonl   one JSON line per (sample, method, keep, prefill) -- see LINE_FIELDS
    DIR/summary.json             aggregated cells (kvtrim.eval.report.summarize), rewritten after each run

Resumption: a line is written (one ``os.write`` on an ``O_APPEND`` descriptor) as soon as its
sample is scored; on a rerun every (task, length, sample, method, keep, prefill) already present
is skipped, and a sample whose configurations are all present is not even generated. A line cut
short by an interruption is dropped when the sweep starts again. ``--shard I/N`` lets N processes
share one directory (sample units are dealt round-robin).

How one sample unit runs (all configurations of one generated sample):

1. the sample is generated (``kvtrim.eval.TASKS`` / ``LONGTEXT_TASKS``, seed ``sample_seed(seed, i)``,
   depths spread evenly), and its prompt ids built with the chat template (``ppl``: plain text);
2. the prompt's forward pass runs **once** with a recording policy (``kvtrim.eval.replay``) and each
   (method, keep) builds its compressed cache by replaying its prefill hook on the recorded
   q/k/v -- identical to running the method from scratch (tested), because kvtrim compresses
   after each layer's attention;
3. greedy decoding (``MAX_NEW_TOKENS[task]`` tokens at most; it stops early at EOS or once the
   answer is complete -- every answer found and the text ending in a non-alphanumeric character, so
   more tokens cannot change the score, see :func:`answer_complete`); multi-turn
   samples feed each later question as a new turn through the same cache; ``ppl`` and ``labelfree``
   teacher-force their continuation / the full cache's answer in one forward. The configurations
   decode **together**, one batch row each, every row attending to its own cache
   (``kvtrim.eval.batched``): the weights are read once per step for all of them, which at batch 1
   dominates a small model's decode step. ``--unbatched`` decodes them one at a time instead.

Reported per line: ``prefill_seconds`` = the shared forward pass + this method's compression
(``record_seconds`` + ``compress_seconds``), ``decode_seconds`` (the configuration's share of the
forward steps it took part in: each step's time divided by its rows; ``decode_rows`` is the mean
number of rows per step, 1 when unbatched -- lone-generation decode speed is ``kvtrim bench``'s
job) / ``decode_steps``, ``kv_bytes``
(resident key/value buffers at the end, ``KVTrimCache.kv_bytes``), ``kv_bytes_full`` (what an
uncompressed cache holds for the same tokens).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtrim.errors import KVTrimError
from kvtrim.eval.batched import Clock, Step, Wait, drive
from kvtrim.eval.longtext import LONGTEXT_TASKS
from kvtrim.eval.metrics import METRICS
from kvtrim.eval.tasks import TASKS, even_depths, sample_seed

ALL_TASKS = {**TASKS, **LONGTEXT_TASKS}

#: greedy tokens per answer (per turn for multiturn); ppl teacher-forces instead of generating
MAX_NEW_TOKENS = {"passkey": 12, "niah_single": 28, "niah_multikey": 28, "niah_multivalue": 64,
                  "niah_multiquery": 64, "vt": 40, "cwe": 64, "fwe": 32, "multiturn": 24, "labelfree": 32, "ppl": 0}
# (the model restates the question before the answer: "The special magic number for X mentioned in the
# provided text is 1234567" is ~25 tokens; this tokenizer splits numbers into single digits)

#: the fields every result line has (task-specific extras follow them)
LINE_FIELDS = ("task", "length", "sample", "seed", "depth", "method", "keep", "prefill", "score", "correct", "answer",
               "prompt_tokens", "new_tokens", "kv_bytes", "kv_bytes_full", "kv_bytes_stored", "stored_tokens",
               "prefill_seconds", "record_seconds", "compress_seconds", "decode_seconds", "decode_steps")

#: tokens a task adds after the prompt besides the answer (ppl's teacher-forced continuation)
LONGTEXT_EXTRA = {"ppl": 128}

DEFAULT_KEEPS = (0.1, 0.25, 0.5)
DEFAULT_METHODS = ("full", "streaming_llm", "h2o", "snapkv")


def line_key(d: dict) -> tuple:
    keep = d.get("keep")
    return (d["task"], int(d["length"]), int(d["sample"]), d["method"], None if keep is None else round(float(keep), 6),
            d.get("prefill", "dense"))


# ----------------------------------------------------------------------------- configuration
@dataclass
class EvalPlan:
    """What a sweep runs. Build it with :func:`make_plan`, which checks every field."""

    tasks: list[str]
    lengths: list[int]
    methods: list[str]
    keeps: list[float]
    samples: int = 20
    seed: int = 0
    prefill: str = "dense"
    haystack: str | None = None
    configs: list[tuple[str, float | None]] = field(default_factory=list)

    def units(self) -> list[tuple[str, int, int]]:
        """(task, length, sample index) in the order they run: by length, then sample (even indices
        first, so a partial sweep still spans all depths), then task -- every task progresses together."""
        order = list(range(0, self.samples, 2)) + list(range(1, self.samples, 2))
        return [(t, n, i) for n in self.lengths for i in order for t in self.tasks]


def _split(value, what: str) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [str(x).strip() for x in items]
    if not items or any(not x for x in items):
        raise KVTrimError(f"--{what} takes a comma-separated list without empty items; got {value!r}")
    return items


def make_plan(tasks, lengths, methods, keeps, samples: int = 20, seed: int = 0, prefill: str = "dense",
              haystack: str | None = None) -> EvalPlan:
    """Validate a sweep (names, ranges) before any model loads; raises ``KVTrimError`` naming the problem."""
    from kvtrim.attention.prefill import PREFILL_MODES
    from kvtrim.eval.replay import NOT_REPLAYABLE
    from kvtrim.registry import get_policy_class, method_names

    task_list = _split(tasks, "tasks")
    for t in task_list:
        if t not in ALL_TASKS:
            raise KVTrimError(f"unknown task {t!r}; known tasks: {', '.join(ALL_TASKS)}")
    method_list = _split(methods, "methods")
    for m in method_list:
        if m not in method_names():
            raise KVTrimError(f"unknown method {m!r}; known methods: {', '.join(method_names())}")
        if m in NOT_REPLAYABLE:
            raise KVTrimError(
                f"method {m!r} compresses visual tokens only; the eval tasks are text, so it would equal 'full'. "
                "Evaluate it on images with kvtrim generate --image (see docs/multimodal.md)"
            )
    try:
        length_list = [int(x) for x in _split(lengths, "length")]
    except ValueError:
        raise KVTrimError(f"--length takes comma-separated token counts, e.g. 2048,4096; got {lengths!r}") from None
    from kvtrim.eval.common import MIN_LENGTH

    for n in length_list:
        if n < MIN_LENGTH:
            raise KVTrimError(f"--length must be >= {MIN_LENGTH} tokens; got {n}")
    try:
        keep_list = [float(x) for x in _split(keeps, "keep")]
    except ValueError:
        raise KVTrimError(f"--keep takes comma-separated fractions, e.g. 0.1,0.25,0.5; got {keeps!r}") from None
    for k in keep_list:
        if not (0.0 < k < 1.0) or math.isnan(k):
            raise KVTrimError(f"--keep must be a fraction in (0, 1) (1 is the full cache, run as method 'full'); got {k}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise KVTrimError(f"--samples must be a positive integer; got {samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise KVTrimError(f"--seed must be a non-negative integer; got {seed!r}")
    if prefill not in PREFILL_MODES:
        raise KVTrimError(f"unknown --prefill {prefill!r}; choose one of: {', '.join(PREFILL_MODES)}")
    # full is every score's reference (and labelfree's reference answer): always part of the sweep
    if "full" not in method_list:
        method_list = ["full", *method_list]
    configs: list[tuple[str, float | None]] = []
    for m in dict.fromkeys(method_list):
        if get_policy_class(m).takes_budget:
            configs += [(m, k) for k in dict.fromkeys(keep_list)]
        else:
            configs.append((m, None))
    return EvalPlan(task_list, list(dict.fromkeys(length_list)), list(dict.fromkeys(method_list)),
                    list(dict.fromkeys(keep_list)), samples, seed, prefill, haystack, configs)


def check_lengths(plan: EvalPlan, tokenizer, max_context: int) -> None:
    """Refuse lengths whose prompt (with the chat template and the answer) exceeds the model's context.

    kvtrim eval runs each prompt in one prefill (its forward pass is shared by all methods), so
    every method needs the prompt inside the context; a streaming method can go further with
    ``kvtrim stream`` / ``kvtrim.Session``, not here.
    """
    if not max_context:
        return
    from kvtrim.models import build_prompt_ids

    overhead = max(0, len(build_prompt_ids(tokenizer, "x")) - len(tokenizer("x", add_special_tokens=False)["input_ids"]))
    for task in plan.tasks:
        # beyond the prompt: the template, the 2% length tolerance, the answer(s), later turns, ppl's continuation
        extra = overhead + MAX_NEW_TOKENS[task] + LONGTEXT_EXTRA.get(task, 0)
        if task == "multiturn":
            extra += 4 * (MAX_NEW_TOKENS[task] + 40)
        for n in plan.lengths:
            need = n + int(n * 0.02) + extra
            if need > max_context:
                limit = int((max_context - extra) / 1.02)
                raise KVTrimError(
                    f"--length {n} for task {task!r} needs up to {need} tokens (prompt + template + answer), more than "
                    f"the model's context of {max_context}; methods {', '.join(plan.methods)} run the prompt in one "
                    f"prefill and cannot stream past it. Use --length <= {limit}, or stream long inputs with "
                    "`kvtrim stream` (streaming methods)."
                )



def check_out_dir(out: str | os.PathLike, model_source: str | None = None) -> Path:
    """Create ``out`` (and ``out/runs``), check it is writable and belongs to this model."""
    path = Path(out)
    try:
        (path / "runs").mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"  # per process: shards start together
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise KVTrimError(f"cannot write to the output directory {str(path)!r}: {e.strerror or e}") from None
    cfg = path / "config.json"
    if model_source is not None:
        if cfg.is_file():
            try:
                held = json.loads(cfg.read_text()).get("model")
            except (OSError, json.JSONDecodeError):
                held = None
            if held is not None and held != model_source:
                raise KVTrimError(
                    f"{str(path)!r} holds a sweep of model {held!r}, not {model_source!r}; use another --out directory"
                )
        cfg.write_text(json.dumps({"model": model_source, "format": 1}, indent=2) + "\n")
    return path


# ----------------------------------------------------------------------------- result files
def runs_file(out: Path, task: str, length: int) -> Path:
    return out / "runs" / f"{task}-{length}.jsonl"


def read_lines(paths: Iterable[Path], repair: bool = False) -> list[dict]:
    """Every complete JSON line of ``paths``; with ``repair`` a cut-off last line is removed from its file."""
    rows: list[dict] = []
    for p in paths:
        if not p.is_file():
            continue
        data = p.read_bytes()
        if repair and data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            with open(p, "r+b") as f:
                f.truncate(cut)
            data = data[:cut]
        for raw in data.splitlines():
            if not raw.strip():
                continue
            try:
                rows.append(json.loads(raw))
            except json.JSONDecodeError:
                continue  # a line cut short by an interruption
    return rows


def result_files(out: str | os.PathLike) -> list[Path]:
    return sorted((Path(out) / "runs").glob("*.jsonl"))


def append_line(path: Path, row: dict) -> None:
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- running one sample
def _prompt_ids(tokenizer, sample) -> list[int]:
    from kvtrim.models import build_prompt_ids

    if sample.task == "ppl":
        return list(tokenizer(sample.context, add_special_tokens=True)["input_ids"])
    return build_prompt_ids(tokenizer, sample.prompt)


def _greedy(cache, logits, max_new: int, eos, finished=None, clock=None):
    """Greedy decoding program (see ``kvtrim.eval.batched``): returns ``(tokens, forward steps)``."""
    out: list[int] = []
    steps = 0
    for step in range(max_new):
        tok = int(logits.argmax())
        out.append(tok)
        if tok == eos or step == max_new - 1 or (finished is not None and finished(out)):
            break
        logits = yield Step(cache, [tok], False, clock)
        steps += 1
    return out, steps


def _forced_nll(cache, logits, target: list[int], clock=None):
    """Program: sum of -log p(target), the first token predicted by ``logits``, the rest in one forward."""
    nll = -float(torch.log_softmax(logits, -1)[target[0]])
    if len(target) > 1:
        all_logits = yield Step(cache, list(target[:-1]), True, clock)
        lp = torch.log_softmax(all_logits, -1)
        idx = torch.tensor(target[1:], device=lp.device).unsqueeze(1)
        nll -= float(lp.gather(1, idx).sum())
    return nll


def _turn_tail(tokenizer, question: str) -> list[int]:
    """Ids that close the assistant's reply and open the next user turn with ``question``."""
    if getattr(tokenizer, "chat_template", None) is not None:
        mark = "\u2063REPLY\u2063"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": mark}, {"role": "user", "content": question}],
            add_generation_prompt=True, tokenize=False)
        tail = text[text.index(mark) + len(mark):]
    else:
        tail = "\n" + question + "\n"
    return list(tokenizer(tail, add_special_tokens=False)["input_ids"])


_ROUGE = None


def rouge_l(prediction: str, reference: str) -> float:
    global _ROUGE
    if _ROUGE is None:
        try:
            from rouge_score import rouge_scorer
        except ImportError:
            raise KVTrimError("the labelfree task needs the `rouge-score` package: pip install 'kvtrim[eval]'") from None
        _ROUGE = rouge_scorer.RougeScorer(["rougeL"])
    return float(_ROUGE.score(reference, prediction)["rougeL"].fmeasure)


def config_program(model, tokenizer, sample, recording, method: str, keep: float | None, memo: dict | None,
                   reference: list[int] | None = None, reference_key=None):
    """Program (``kvtrim.eval.batched``) for one (method, keep) on one recorded sample: replay, then
    decode/teacher-force and score; returns the line's fields. For ``labelfree`` a compressed
    configuration needs the full cache's answer: ``reference``, or the result of the program
    registered under ``reference_key``."""
    from kvtrim.eval.metrics import score as score_text
    from kvtrim.eval.replay import make_policy, replay

    params = {} if keep is None else {"keep": keep}
    eos = getattr(tokenizer, "eos_token_id", None)
    t0 = time.perf_counter()
    cache = replay(model, make_policy(method, params, memo), recording)
    compress = time.perf_counter() - t0
    logits = recording.logits
    extra: dict = {}
    max_new = MAX_NEW_TOKENS[sample.task]
    clock = Clock()
    if sample.task == "ppl":
        target = tokenizer(sample.meta["continuation"], add_special_tokens=False)["input_ids"]
        nll = yield from _forced_nll(cache, logits, target, clock)
        out, steps = [], 1
        extra = {"nll_sum": nll, "n_target": len(target)}
        value = math.exp(nll / len(target))
        answer = ""
    elif sample.task == "labelfree":
        out, steps = yield from _greedy(cache, logits, max_new, eos, None, clock)
        answer = tokenizer.decode([t for t in out if t != eos], skip_special_tokens=True).strip()
        if method == "full":  # the full cache's answer is the reference
            reference = out
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
                feed = ([] if not out or out[-1] == eos else [out[-1]]) + _turn_tail(tokenizer, turn.question)
                logits = yield Step(cache, feed, False, clock)
                steps += 1
            done = _finished(tokenizer, sample.metric, turn.answers, eos)
            out, s = yield from _greedy(cache, logits, max_new, eos, done, clock)
            steps += s
            text = tokenizer.decode([t for t in out if t != eos], skip_special_tokens=True).strip()
            answers.append(text)
            scores.append(score_text_one(tokenizer, sample.metric, out, turn.answers, eos))
        value = sum(scores) / len(scores)
        answer = answers[0]
        extra = {"answers": answers, "turn_scores": scores}
    else:
        done = _finished(tokenizer, sample.metric, sample.answers, eos)
        out, steps = yield from _greedy(cache, logits, max_new, eos, done, clock)
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
    del cache
    if sample.task == "labelfree" and method != "full":
        ref_nll = None
        # perplexity of the full cache's answer under this method's cache: a fresh replay (the greedy run moved it)
        if reference:
            cache2 = replay(model, make_policy(method, params, memo), recording)
            ref_nll = yield from _forced_nll(cache2, recording.logits, list(reference))
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


def _finished(tokenizer, metric: str, answers: Sequence[str], eos) -> Callable[[list[int]], bool]:
    """The decoder's ``finished(ids)`` test for one set of answers (see :func:`answer_complete`)."""
    return lambda ids: answer_complete(tokenizer, metric, ids, answers, eos)


def score_text_one(tokenizer, metric: str, ids: list[int], answers: Sequence[str], eos) -> float:
    text = tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)
    return METRICS[metric](text, answers)


# ----------------------------------------------------------------------------- the sweep
def build_sample(plan: EvalPlan, tokenizer, task: str, length: int, i: int):
    depth = even_depths(plan.samples)[i]
    kw = {} if plan.haystack is None else {"haystack": plan.haystack}
    return ALL_TASKS[task](tokenizer, length, depth=depth, seed=sample_seed(plan.seed, i), **kw)


def run_eval(lm, plan: EvalPlan, out: str | os.PathLike, *, shard: tuple[int, int] = (0, 1), progress: bool = True,
             stop_after: int | None = None, batch: bool = True) -> dict:
    """Run (or resume) ``plan`` on the loaded model ``lm`` (``kvtrim.models.LoadedModel``), writing into ``out``.

    The configurations of a sample decode together, one batch row each (``kvtrim.eval.batched``);
    ``batch=False`` decodes them one after another at batch 1 (slower; per-line decode times are
    then those of a lone generation). ``stop_after`` stops after that many sample units (for tests
    of resumption). Returns the summary.
    """
    from tqdm import tqdm

    from kvtrim.eval.replay import record_prefill
    from kvtrim.eval.report import summarize
    from kvtrim.integrations.hf import attach

    out_path = check_out_dir(out, lm.source)
    check_lengths(plan, lm.tokenizer, lm.max_context)
    idx, n_shards = shard
    if not (0 <= idx < n_shards):
        raise KVTrimError(f"--shard must be I/N with 0 <= I < N; got {idx}/{n_shards}")
    # drop lines cut short by an interruption, then see what is done
    done = {line_key(r) for r in read_lines(result_files(out_path), repair=(n_shards == 1))}
    units = [u for j, u in enumerate(plan.units()) if j % n_shards == idx]
    todo = []
    for task, length, i in units:
        need = [(m, k) for m, k in plan.configs
                if (task, length, i, m, None if k is None else round(k, 6), plan.prefill) not in done]
        if need:
            todo.append((task, length, i, need))
    n_cfg = sum(len(n) for *_, n in todo)
    skipped = len(units) * len(plan.configs) - n_cfg
    prefill_hook = None
    if plan.prefill != "dense":
        from kvtrim.attention.prefill import make_prefill

        prefill_hook = make_prefill(lm.model, plan.prefill)
    bar = tqdm(total=n_cfg, desc="kvtrim eval", unit="run", disable=not progress, dynamic_ncols=True)
    if skipped:
        bar.write(f"kvtrim eval: {skipped} runs already in {out_path} are skipped")
    for started, (task, length, i, need) in enumerate(todo):
        if stop_after is not None and started >= stop_after:
            break
        sample = build_sample(plan, lm.tokenizer, task, length, i)
        ids = _prompt_ids(lm.tokenizer, sample)
        bar.set_postfix_str(f"{task}@{length} #{i}")
        recording = record_prefill(lm.model, ids, prefill_hook)
        memo: dict = {}
        reference = None
        if task == "labelfree":
            # the full cache's answer is the reference: from the file if full already ran, else from its run here
            prev = [r for r in read_lines([runs_file(out_path, task, length)])
                    if r["sample"] == i and r["method"] == "full" and r.get("prefill", "dense") == plan.prefill]
            if prev:
                reference = prev[-1]["answer_ids"]
            need = sorted(need, key=lambda c: c[0] != "full")
        ref_key = ("full", None) if ("full", None) in need else None
        programs = {(m, k): config_program(lm.model, lm.tokenizer, sample, recording, m, k, memo, reference, ref_key)
                    for m, k in need}

        def write(key, row, task=task, length=length, i=i, sample=sample, ids=ids, recording=recording):
            method, keep = key
            line = {"task": task, "length": length, "sample": i, "seed": sample.seed, "depth": sample.depth,
                    "method": method, "keep": keep, "prefill": plan.prefill, "prompt_tokens": len(ids),
                    "max_new_tokens": MAX_NEW_TOKENS[task], **row}
            if recording.prefill_stats is not None:
                line["prefill_stats"] = {k: v for k, v in recording.prefill_stats.items() if isinstance(v, (int, float, str)) or v is None}
            append_line(runs_file(out_path, task, length), line)
            bar.update(1)

        with attach(lm.model):
            drive(lm.model, programs, batch=batch, on_done=write)
        del programs, write
        del recording, memo
        release_memory()
    bar.close()
    summary = summarize(read_lines(result_files(out_path)))
    summary["machine"] = machine()
    (out_path / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    A sweep allocates and frees caches of many sizes per sample; without trimming, glibc keeps the
    freed pages and a long sweep's resident memory grows to several times what one sample needs.
    """
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name and platform.system() == "Linux":
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


def machine() -> dict:
    import transformers

    import kvtrim

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "kvtrim": getattr(kvtrim, "__version__", "?"), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
