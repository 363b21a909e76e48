"""``kvtrim eval``: a resumable sweep of tasks x lengths x methods x budgets on one model.

The plan is checked by :mod:`kvtrim.eval.plan`, results go to the directory layout of
:mod:`kvtrim.eval.store`, and each configuration runs as a program of :mod:`kvtrim.eval.programs`.

Resumption: a line is written (one ``os.write`` on an ``O_APPEND`` descriptor) as soon as its
sample is scored; on a rerun every line already present with the same key
(:func:`kvtrim.eval.store.line_key`: task, length, sample and its seed, haystack, samples per cell,
weight digest, method, keep and every other policy parameter, prefill) is skipped, and a sample
whose configurations are all present is not even generated. A line cut short by an interruption,
or otherwise corrupted, is moved into ``<file>.corrupt`` (with its line number) and recomputed
when the sweep starts again (``kvtrim.eval.store.read_lines``; with ``--shard`` it is only
reported and skipped, since other processes may be writing). A rerun with another model, weights,
dtype, prompt format, ``--seed``, ``--haystack`` or ``--samples`` is refused before anything runs,
naming the difference (``config.json``: :func:`kvtrim.eval.store.check_out_dir`); with ``--force`` the
sweep goes to a new directory beside it instead (``DIR-2``, ...; one line says which). ``--shard I/N``
lets N processes share one directory (sample units are dealt round-robin).

How one sample unit runs (all configurations of one generated sample):

1. the sample is generated (``kvtrim.eval.TASKS`` / ``LONGTEXT_TASKS``, seed ``sample_seed(seed, i)``,
   depths spread evenly), and its prompt ids built with the chat template (kvtrim's plain prompt
   format for a model without one, or with ``--plain-prompt``; ``ppl``: the text itself);
2. the prompt's forward pass runs **once** with a recording policy (``kvtrim.eval.replay``) and each
   (method, keep) builds its compressed cache by replaying its prefill hook on the recorded
   q/k/v -- identical to running the method from scratch (tested), because kvtrim compresses
   after each layer's attention;
3. greedy decoding (``MAX_NEW_TOKENS[task]`` tokens at most; it stops early at EOS or once the
   answer is complete -- every answer found and the text ending in a non-alphanumeric character, so
   more tokens cannot change the score, see :func:`kvtrim.eval.programs.answer_complete`); multi-turn
   samples feed each later question as a new turn through the same cache; ``ppl`` and ``labelfree``
   teacher-force their continuation / the full cache's answer in one forward. The configurations
   decode **together**, one batch row each, every row attending to its own cache
   (``kvtrim.integrations.batched``): the weights are read once per step for all of them, which at batch 1
   dominates a small model's decode step. ``--unbatched`` decodes them one at a time instead.

Reported per line: ``prefill_seconds`` = the shared forward pass + this method's compression
(``record_seconds`` + ``compress_seconds``), ``decode_seconds`` (the configuration's share of the
forward steps it took part in: each step's time divided by its rows; ``decode_rows`` is the mean
number of rows per step, 1 when unbatched -- lone-generation decode speed is ``kvtrim bench``'s
job) / ``decode_steps``, ``kv_bytes``
(resident key/value buffers at the end, ``KVTrimCache.kv_bytes``), ``kv_bytes_full`` (what an
uncompressed cache holds for the same tokens).

Bit widths (``--kv-bits 16,8,4``, ``EvalPlan.kv_bits``): every configuration also runs with its
cache at each bit width (``KVTrimCache(kv_bits=)``): the replay builds a low-bit cache, whose
prefill hook sees the recorded prompt in full precision and quantizes what it keeps, as the live
path does (``tests/test_sweep_bits.py`` checks the two agree token for token). A line records
``kv_bits``; its key (:func:`kvtrim.eval.store.line_key`) carries it only where it is not 16, so a
16-bit line has the key it had before bit widths. ``kv_bytes`` is the low-bit storage's resident
bytes (codes, group ids, scales and zero points, and the residual tokens in the model's dtype);
``kv_bytes_full`` stays what a 16-bit uncompressed cache holds.
"""

from __future__ import annotations

import json
import os

from kvtrim.errors import KVTrimError
from kvtrim.eval.plan import MAX_NEW_TOKENS, REFERENCE, EvalPlan, build_sample, check_lengths
from kvtrim.eval.programs import config_program, prompt_ids
from kvtrim.eval.store import (
    append_line,
    check_out_dir,
    config_params,
    haystack_name,
    line_key,
    machine,
    read_lines,
    result_files,
    runs_file,
)
from kvtrim.eval.tasks import sample_seed
from kvtrim.files import write_atomic
from kvtrim.machine import release_memory
from kvtrim.session_file import weights_digest


def run_eval(lm, plan: EvalPlan, out: str | os.PathLike, *, shard: tuple[int, int] = (0, 1), progress: bool = True,
             stop_after: int | None = None, batch: bool = True, force: bool = False) -> dict:
    """Run (or resume) ``plan`` on the loaded model ``lm`` (``kvtrim.models.LoadedModel``), writing into ``out``.

    The configurations of a sample decode together, one batch row each (``kvtrim.integrations.batched``);
    ``batch=False`` decodes them one after another at batch 1 (slower; per-line decode times are
    then those of a lone generation). ``stop_after`` stops after that many sample units (for tests
    of resumption). ``force``: when ``out`` holds another sweep, write to a new directory beside it
    instead of refusing (:func:`kvtrim.eval.store.check_out_dir`). Returns the summary, with ``out``:
    the directory the results are in.
    """
    from tqdm import tqdm

    from kvtrim.eval.replay import record_prefill
    from kvtrim.eval.report import summarize
    from kvtrim.integrations.batched import drive
    from kvtrim.integrations.hf import attach
    from kvtrim.registry import get_policy_class, split_method

    check_lengths(plan, lm.tokenizer, lm.max_context)  # before config.json is written: a refused plan leaves nothing
    idx, n_shards = shard
    if not (0 <= idx < n_shards):
        raise KVTrimError(f"--shard must be I/N with 0 <= I < N; got {idx}/{n_shards}")
    # the weights' dtype, and the prefill's where --dtype auto computes it in another (DtypePlan.label)
    dtype = lm.dtypes.label() if lm.dtypes else str(next(lm.model.parameters()).dtype).removeprefix("torch.")
    # what every line of this sweep depends on besides its own key: recorded in config.json and on each line
    sweep = {"weights": weights_digest(lm.model), "sweep_seed": plan.seed, "haystack": haystack_name(plan.haystack),
             "samples": plan.samples}
    out_path = check_out_dir(out, lm.source, plain=plan.plain, dtype=dtype, sweep=sweep, force=force)
    params = {(m, k): config_params(m, k) for m, k in plan.configs}
    configs = plan.bit_configs()  # (method, keep, kv_bits); 16 bits alone: the sweep as before bit widths
    # move corrupted lines (cut short by an interruption, overwritten) into FILE.corrupt, then see what is done
    done = {line_key(r) for r in read_lines(result_files(out_path), repair=(n_shards == 1))}

    def key_of(task, length, i, m, k, b=16):
        """The line key the configuration (m, k) at b bits of sample i will have (:func:`kvtrim.eval.store.line_key`)."""
        return line_key({"task": task, "length": length, "sample": i, "seed": sample_seed(plan.seed, i),
                         "method": m, "keep": k, "prefill": plan.prefill, "params": params[(m, k)], "kv_bits": b}
                        | sweep)

    units = [u for j, u in enumerate(plan.units()) if j % n_shards == idx]
    todo = []
    for task, length, i in units:
        need = [(m, k, b) for m, k, b in configs if key_of(task, length, i, m, k, b) not in done]
        if need:
            todo.append((task, length, i, need))
    n_cfg = sum(len(n) for *_, n in todo)
    skipped = len(units) * len(configs) - n_cfg
    prefill_hook = None
    if plan.prefill != "dense":
        from kvtrim.integrations.prefill import make_prefill

        prefill_hook = make_prefill(lm.model, plan.prefill)
    bar = tqdm(total=n_cfg, desc="kvtrim eval", unit="run", disable=not progress, dynamic_ncols=True)
    if skipped:
        bar.write(f"kvtrim eval: {skipped} runs already in {out_path} are skipped")
    for started, (task, length, i, need) in enumerate(todo):
        if stop_after is not None and started >= stop_after:
            break
        sample = build_sample(plan, lm.tokenizer, task, length, i)
        ids = prompt_ids(lm.tokenizer, sample, plan.plain)
        bar.set_postfix_str(f"{task}@{length} #{i}")
        # the column sums H2O and Elastic Cache share, computed by the recorded forward's own attention
        sums_shared = any(get_policy_class(split_method(m)[0]).shares_prefill_scores for m, _, _ in need)
        recording = record_prefill(lm.model, ids, prefill_hook, column_sums=sums_shared)
        memo: dict = recording.score_memo()
        reference = None
        if task == "labelfree":
            # the full cache's answer is the reference: from the file if full already ran, else from its run here
            full_key = key_of(task, length, i, REFERENCE, None)
            prev = [r for r in read_lines([runs_file(out_path, task, length)]) if line_key(r) == full_key]
            if prev:
                reference = prev[-1]["answer_ids"]
            need = sorted(need, key=lambda c: c[0] != REFERENCE)
        ref_key = (REFERENCE, None, 16) if (REFERENCE, None, 16) in need else None
        # every labelfree answer is compared with the full cache's at 16 bits (the model's dtype)
        programs = {(m, k, b): config_program(lm.model, lm.tokenizer, sample, recording, m, k, memo, reference, ref_key,
                                              plain=plan.plain, kv_bits=b)
                    for m, k, b in need}

        def write(key, row, task=task, length=length, i=i, sample=sample, ids=ids, recording=recording):
            method, keep, bits = key
            line = {"task": task, "length": length, "sample": i, "seed": sample.seed, "depth": sample.depth,
                    "method": method, "keep": keep, "kv_bits": bits, "prefill": plan.prefill, "prompt_tokens": len(ids),
                    "max_new_tokens": MAX_NEW_TOKENS[task], **row, **sweep, "params": params[(method, keep)]}
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
    summary["dtype"] = dtype
    write_atomic(out_path / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary | {"out": str(out_path)}
