"""Anchor: NVIDIA kvpress 0.5.5 on the same generated samples and budgets as kvtrim's sweep.

Run it with the Python that has kvtrim; it sets up its own environment for kvpress and drives it:

    python benchmarks/anchor_kvpress.py --out results/anchor_kvpress                    # run / resume into results/anchor_kvpress/
    python benchmarks/anchor_kvpress.py --table benchmarks/results/anchor_kvpress      # markdown table of the committed lines

``--out DIR`` names the folder of result lines (an existing one is continued) and the summary is
written beside it (``DIR_summary.json``, as ``benchmarks/results/anchor_kvpress_summary.json``
beside the committed lines); nothing under ``benchmarks/results/`` is written unless ``--out``
names it.

What it does:

1. **Setup** (idempotent, printed): a venv at ``benchmarks/.venv-kvpress`` with ``kvpress==0.5.5``
   (it pins transformers < 5.3), the CPU build of ``torch==2.13.0``, ``gguf`` and ``accelerate``,
   from PyPI only. A finished setup is recognised by importing kvpress at the pinned version.
2. **Samples** (main venv): ``kvtrim.eval.make_samples(task, tokenizer, length, n=POOL, seed=0)[i]``
   and ``kvtrim.models.build_prompt_ids(tokenizer, sample.prompt)`` (chat template applied); the
   token ids go to the kvpress side as JSONL, so both sides see identical ids.
3. **Worker** (kvpress venv, this same file with ``--worker``): for each sample one dense prefill of
   the whole prompt (question included: the "question inside the compressed context" setting),
   then for each press and compression ratio the press compresses the cache and greedy decoding
   follows, as kvpress's own pipeline does it (true positions passed as ``position_ids``, stop at
   EOS). The prefill is shared: during the dense prefill each attention layer's forward arguments
   are recorded, and each press's own ``forward_hook`` is then replayed on a copy of the full cache.
   kvpress presses compress *after* each layer's prefill attention, so the prefill itself is dense
   and identical for every press; the replay gives the same compressed cache as running the
   prefill under ``with press(model)``, which the worker checks on the first sample it runs
   (``replay_check`` in the summary: max |difference| of the kept keys/values per press).
4. **Scoring** (main venv): ``kvtrim.eval.metrics.score(sample, answer)``; one JSON line per
   (task, length, sample, press, ratio) in ``DIR/{task}-{length}.jsonl`` in the schema of
   ``kvtrim eval``; finished lines are skipped on a rerun (resumable), and ``DIR_summary.json`` is
   rewritten at the end.

The worker is the one part of ``benchmarks/`` that keeps its own decode loop, clock and machine
record: it runs in the kvpress environment (kvpress pins transformers < 5.3), where kvtrim is not
importable on purpose (``PYTHONPATH`` is removed for it), and it decodes as kvpress's own pipeline
does, which is what the anchor measures.

Defaults and decisions:

- ``--model``: kvtrim's model name (default the embedded model; ``qwen2.5-0.5b`` the reference
  model): the worker loads kvtrim's plain transformers copy of it, the same weights.
- Tasks ``passkey,niah_single,niah_multikey,vt,multiturn,labelfree`` at lengths 2048 and 4096;
  presses StreamingLLM, SnapKV, TOVA, ExpectedAttention, PyramidKV, ``AdaKV-SnapKV`` and
  ``AdaKV-ExpectedAttention`` (``AdaKVPress`` around the scorer: per-head budgets), KVzip, with
  their kvpress defaults (Knorm on request); compression ratios 0.9/0.75/0.5 (kvtrim keep =
  1 - ratio = 0.1/0.25/0.5) plus no press (``kvpress:none``).
- ``multiturn`` as kvtrim's runner does it: the first question is inside the compressed prompt;
  each later one is fed through the same cache after the previous answer (its last token unless
  EOS, then ``kvtrim.eval.programs.turn_tail``'s ids), each answer stopped where kvtrim stops it;
  the turns are scored alone and averaged. ``labelfree``: ROUGE-L against kvpress's own full-cache
  answer (``kvpress:none``, run first for each sample).
- KVzip reconstructs the context once per sample (its own forward passes over the dense cache,
  through kvpress's ``KVzipPress``); its scores do not depend on the ratio, so each ratio then
  applies kvpress's selection (``compress_post``) to the same scores. Its time is in every ratio's
  ``compress_seconds``.
- AdaKV and KVzip only **mask** keys (kvpress's attention patch; the tensors stay resident):
  ``kv_bytes`` is what stays in memory, ``kv_bytes_unmasked`` what the press would hold were its
  masked (key, head) pairs freed, ``masked_pairs`` their number.
- A configuration kvpress itself cannot run is recorded in ``DIR/skipped.log`` (and the summary's
  ``skipped``), not scored: PyramidKV's uneven layers under a multi-token turn (transformers 5.2
  sizes the mask from layer 0).
- Sample pool ``--pool 20`` (the lead's sweep size: sample ``i``'s depth is ``i / (pool - 1)``, so
  the pool must match for sample ``i`` to be the same sample); ``--samples N`` of the pool are run,
  in the order even indices first, then odd ones, so a partial run still spreads its depths evenly
  and a later ``--samples 20`` adds the rest without redoing anything.
- max_new_tokens: passkey 12, niah_single 28, niah_multikey 28, vt 40, multiturn 24 per turn,
  labelfree 32 (as kvtrim's runner; a line
  decoded with another budget is not counted as done). ``--lengths 2048`` first, then 4096, if time is short.
- float32, 1 torch thread (the machine is shared; ``OMP_NUM_THREADS=1``), ``nice`` is up to the caller.
- ``kv_bytes``: bytes of the cache's key and value tensors after compression (before decoding);
  ``kv_bytes_full``: the same for the uncompressed prompt. ``prefill_seconds`` = the shared dense
  prefill + this press's compression (the replay), ``compress_seconds`` the latter alone.

The table (``--table DIR``, a folder of these lines) joins them with kvtrim's sweep lines
(``--kvtrim-dir``, default the committed ``benchmarks/results/eval_baseline/runs``; several sweeps
of the same samples comma-separated, the full cache taken from the first) on (task, length,
sample, keep), counting only samples whose seed and depth agree on both sides, and prints
``mean score (n)`` per cell (``--by-keep``: a row per method and keep, the tasks' mean, and per keep
kvtrim's best method against the best press). The pure functions (``load_lines``, ``joined_keys``,
``cell_stats``, ``markdown_table``, ``keep_table``) import nothing heavy, so tests can use them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv-kvpress"
WORK = HERE / ".anchor_kvpress_work"
KVTRIM_DIR = HERE / "results" / "eval_baseline" / "runs"

KVPRESS_VERSION = "0.5.5"
REQUIREMENTS = [f"kvpress=={KVPRESS_VERSION}", "torch==2.13.0", "transformers>=4.56,<5.3", "gguf", "accelerate"]

TASKS = ("passkey", "niah_single", "niah_multikey", "vt", "multiturn", "labelfree")
LENGTHS = (2048, 4096)
#: the presses run by default: kvpress's strongest that need no training. ``AdaKV-X`` is
#: ``AdaKVPress(XPress())`` (per-head budgets, simulated by masking keys); ``KVzip`` scores by
#: context reconstruction (one extra pass over the context per sample, shared by the ratios), also
#: by masking. Knorm (the earlier anchor's) can still be named with ``--presses``.
PRESSES = ("StreamingLLM", "SnapKV", "TOVA", "ExpectedAttention", "PyramidKV", "AdaKV-SnapKV",
           "AdaKV-ExpectedAttention", "KVzip")
KNOWN_PRESSES = (*PRESSES, "Knorm")
RATIOS = (0.9, 0.75, 0.5)
#: as kvtrim's runner (kvtrim.eval.plan.MAX_NEW_TOKENS): the model restates the question before the
#: number (~25 tokens), so 16 cut the 7-digit answers off; lines with other budgets are not reused
MAX_NEW_TOKENS = {"passkey": 12, "niah_single": 28, "niah_multikey": 28, "vt": 40, "multiturn": 24, "labelfree": 32}
KVTRIM_METHODS = ("full", "streaming_llm", "h2o", "snapkv", "inf_mllm", "elastic")


def log(msg: str) -> None:
    print(f"[anchor_kvpress {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- pure helpers


def method_name(press: str | None) -> str:
    """``kvpress:<press lower-case>``, ``kvpress:none`` for the full cache."""
    return "kvpress:" + (press.lower() if press else "none")


def keep_of(ratio: float | None) -> float | None:
    """kvtrim's keep fraction for a kvpress compression ratio (None for no press)."""
    return None if ratio is None else round(1.0 - ratio, 6)


def sample_order(pool: int, n: int) -> list[int]:
    """The first ``n`` sample indices of a pool of ``pool``: even indices first, then odd ones."""
    order = list(range(0, pool, 2)) + list(range(1, pool, 2))
    return order[:n]


def line_key(d: dict) -> tuple:
    """The identity of one result line: (task, length, sample, method, keep)."""
    keep = d.get("keep")
    return (d["task"], int(d["length"]), int(d["sample"]), d["method"], None if keep is None else round(float(keep), 6))


def load_lines(paths) -> list[dict]:
    """JSON objects from ``*.jsonl`` files (a missing file gives nothing; a torn last line is skipped)."""
    rows = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            continue
        for raw in p.read_text().splitlines():
            raw = raw.strip()
            if not raw:
                continue
            try:
                rows.append(json.loads(raw))
            except json.JSONDecodeError:
                continue  # an interrupted write; the line is redone on the next run
    return rows


def _is_full(d: dict) -> bool:
    return d.get("keep") is None or float(d["keep"]) >= 1.0 or d["method"] in ("full", "kvpress:none")


def _ident(d: dict) -> tuple:
    depth = d.get("depth")
    return (d.get("seed"), None if depth is None else round(float(depth), 6))


def joined_keys(anchor: list[dict], kvtrim: list[dict]) -> tuple[set, int]:
    """(task, length, sample) present on both sides with the same seed and depth, and the number of
    (task, length, sample) present on both sides whose seed or depth disagree (left out)."""
    a = {(d["task"], int(d["length"]), int(d["sample"])): _ident(d) for d in anchor}
    k = {(d["task"], int(d["length"]), int(d["sample"])): _ident(d) for d in kvtrim}
    both = set(a) & set(k)
    same = {s for s in both if a[s] == k[s]}
    return same, len(both) - len(same)


def cell_stats(rows: list[dict], keys: set | None) -> dict:
    """{(method, task, length, keep or 'full'): (n, mean score)} over rows whose sample is in ``keys``
    (all rows when ``keys`` is None)."""
    acc = defaultdict(list)
    for d in rows:
        s = (d["task"], int(d["length"]), int(d["sample"]))
        if keys is not None and s not in keys:
            continue
        col = "full" if _is_full(d) else round(float(d["keep"]), 6)
        acc[(d["method"], d["task"], int(d["length"]), col)].append(float(d["score"]))
    return {k: (len(v), sum(v) / len(v)) for k, v in acc.items()}


def full_agreement(anchor: list[dict], kvtrim: list[dict], keys: set) -> tuple[int, int, int]:
    """Full cache on both sides (``kvpress:none`` vs kvtrim ``full``) over the joined samples:
    (samples with both, same score, same answer text up to kvtrim's early stop). The two sides run
    different transformers versions and attention paths, so this is the sanity check of the setup."""
    a = {(d["task"], int(d["length"]), int(d["sample"])): d for d in anchor if d["method"] == "kvpress:none"}
    k = {(d["task"], int(d["length"]), int(d["sample"])): d for d in kvtrim if d["method"] == "full"}
    both = [s for s in keys if s in a and s in k]
    same_score = sum(a[s]["score"] == k[s]["score"] for s in both)
    same_text = sum(a[s]["answer"].strip().startswith(k[s]["answer"].strip()) for s in both)
    return len(both), same_score, same_text


def _method_rank(m: str) -> tuple:
    if m.startswith("kvpress:"):
        name = m.split(":", 1)[1]
        order = ["none"] + [p.lower() for p in KNOWN_PRESSES]
        return (0, order.index(name) if name in order else len(order), m)
    return (1, KVTRIM_METHODS.index(m) if m in KVTRIM_METHODS else len(KVTRIM_METHODS), m)


def markdown_table(stats: dict, keeps=(0.1, 0.25, 0.5)) -> str:
    """Rows = methods, columns = task/length x (keep..., full); cells ``mean (n)``, blank when no data."""
    if not stats:
        return "(no matched samples)"
    methods = sorted({k[0] for k in stats}, key=_method_rank)
    tl = sorted({(k[1], k[2]) for k in stats}, key=lambda x: (TASKS.index(x[0]) if x[0] in TASKS else 99, x[0], x[1]))
    cols = [(t, n, c) for t, n in tl for c in (*[round(k, 6) for k in keeps], "full")]
    head = ["method"] + [f"{t} {n // 1024}k {'full' if c == 'full' else f'@{c:g}'}" for t, n, c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        cells = [m]
        for t, n, c in cols:
            v = stats.get((m, t, n, c))
            cells.append("" if v is None else f"{v[1]:.2f} ({v[0]})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def keep_table(stats: dict, length: int, keeps=(0.1, 0.25, 0.5)) -> str:
    """Rows = the full caches, then each keep's methods; columns = the tasks and their mean; cells
    ``mean (n)``. Under each keep a verdict: kvtrim's best method against the best press on the mean
    over the tasks both ran (the mean of a method covers only tasks where it has lines)."""
    tasks = sorted({k[1] for k in stats if k[2] == length}, key=lambda t: (TASKS.index(t) if t in TASKS else 99, t))
    if not tasks:
        return "(no matched samples)"
    head = ["method @ keep", *tasks, "mean"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

    def cells(m, col):
        got = [stats.get((m, t, length, col)) for t in tasks]
        mean = [v[1] for v in got if v is not None]
        return ([("" if v is None else f"{v[1]:.2f} ({v[0]})") for v in got],
                sum(mean) / len(mean) if len(mean) == len(tasks) else None)

    verdicts = []
    for col in ("full", *[round(k, 6) for k in keeps]):
        methods = sorted({k[0] for k in stats if k[2] == length and k[3] == col}, key=_method_rank)
        means = {}
        for m in methods:
            row, mean = cells(m, col)
            means[m] = mean
            label = m if col == "full" else f"{m} @{col:g}"
            lines.append(f"| {label} | " + " | ".join(row) + f" | {'' if mean is None else f'{mean:.2f}'} |")
        if col == "full":
            continue
        press = {m: v for m, v in means.items() if m.startswith("kvpress:") and v is not None}
        ours = {m: v for m, v in means.items() if not m.startswith("kvpress:") and v is not None}
        if press and ours:
            bp, bo = max(press, key=press.get), max(ours, key=ours.get)
            word = "ahead of" if ours[bo] > press[bp] + 1e-9 else "level with" if abs(ours[bo] - press[bp]) <= 1e-9 else "behind"
            verdicts.append(f"- keep {col:g}: kvtrim's best, `{bo}` ({ours[bo]:.3f}), is {word} the best press, "
                            f"`{bp}` ({press[bp]:.3f}), on the mean over the {len(tasks)} tasks.")
    return "\n".join(lines) + ("\n\n" + "\n".join(verdicts) if verdicts else "")


def summarise(rows: list[dict]) -> list[dict]:
    """Per (method, keep, task, length): n, mean score, mean kv_bytes, mean kv_bytes_full."""
    acc = defaultdict(list)
    for d in rows:
        acc[(d["method"], d.get("keep"), d["task"], int(d["length"]))].append(d)
    out = []
    for (m, keep, task, length), ds in sorted(acc.items(), key=lambda kv: (kv[0][2], kv[0][3], _method_rank(kv[0][0]), kv[0][1] or 1.0)):
        out.append({
            "method": m, "keep": keep, "task": task, "length": length, "n": len(ds),
            "mean_score": sum(d["score"] for d in ds) / len(ds),
            "mean_kv_bytes": sum(d["kv_bytes"] for d in ds) / len(ds),
            "mean_kv_bytes_full": sum(d["kv_bytes_full"] for d in ds) / len(ds),
            "mean_prefill_seconds": sum(d["prefill_seconds"] for d in ds) / len(ds),
            "mean_decode_seconds_per_step": (sum(d["decode_seconds"] for d in ds) / max(1, sum(d["decode_steps"] for d in ds))),
        })
    return out


# ----------------------------------------------------------------------------- setup (main venv)


def venv_python() -> Path:
    return VENV / "bin" / "python"


def setup_env() -> Path:
    """Create/complete the kvpress venv; idempotent. Returns its python."""
    py = venv_python()
    probe = "import kvpress, importlib.metadata as m, torch, transformers; print(m.version('kvpress'), torch.__version__, transformers.__version__)"
    if py.exists():
        r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.split()[0] == KVPRESS_VERSION:
            if "+cpu" not in r.stdout.split()[1]:
                log(f"WARNING: torch in {VENV} is {r.stdout.split()[1]}, not a +cpu build")
            log(f"setup: {VENV} ready (kvpress, torch, transformers = {r.stdout.strip()})")
            return py
    else:
        log(f"setup: creating venv {VENV}")
        import venv as _venv

        _venv.EnvBuilder(with_pip=True).create(VENV)
    cmd = [str(py), "-m", "pip", "install", *REQUIREMENTS]
    log("setup: " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, check=True)
    log(f"setup: done (kvpress, torch, transformers = {r.stdout.strip()})")
    return py


# ----------------------------------------------------------------------------- orchestration (main venv)


def replay_check_path(out_dir: Path) -> Path:
    return WORK / f"replay_check-{out_dir.name}.json"


def summary_path(out_dir: Path) -> Path:
    """The summary beside the lines folder: ``DIR_summary.json``."""
    return out_dir.with_name(out_dir.name + "_summary.json")


def done_keys(out_dir: Path) -> set:
    """Keys of finished lines decoded with the current ``MAX_NEW_TOKENS`` of their task."""
    return {line_key(d) for d in load_lines(sorted(out_dir.glob("*.jsonl")))
            if d.get("max_new_tokens") == MAX_NEW_TOKENS.get(d["task"])}


def run(args) -> None:
    import torch

    from kvtrim.eval.metrics import METRICS, rouge_l, score
    from kvtrim.eval.plan import ALL_TASKS
    from kvtrim.eval.programs import turn_tail
    from kvtrim.eval.tasks import even_depths, sample_seed
    from kvtrim.models import build_prompt_ids, load_model

    py = setup_env()
    torch.set_num_threads(1)
    lm = load_model(args.model)
    model_dir = lm.model.name_or_path  # the converted plain transformers directory under ~/.cache/kvtrim
    tok = lm.tokenizer
    del lm
    log(f"model directory (plain transformers copy): {model_dir}")
    if not (Path(model_dir) / "config.json").exists():
        raise SystemExit(f"{model_dir} is not a plain transformers directory")

    tasks = args.tasks.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    presses = args.presses.split(",")
    unknown = [x for x in presses if x not in KNOWN_PRESSES]
    if unknown:
        raise SystemExit(f"unknown press(es) {unknown}; known: {', '.join(KNOWN_PRESSES)}")
    cfgs = [(None, None)] + [(x, r) for x in presses for r in RATIOS]
    from kvtrim import harness

    out_dir = Path(args.out)
    done = done_keys(out_dir)
    order = sample_order(args.pool, args.samples)
    jobs, samples = [], {}
    pool_cache = {}
    for i in order:  # sample-major: a partial run covers every cell about equally
        for task in tasks:
            for length in lengths:
                todo = [c for c in cfgs if (task, length, i, method_name(c[0]), keep_of(c[1])) not in done]
                if not todo:
                    continue
                if (task, length) not in pool_cache:
                    log(f"generating samples {task} {length} (pool {args.pool}, seed {args.seed})")
                    # kvtrim eval's samples (kvtrim.eval.plan.build_sample), the long-text tasks included
                    pool_cache[(task, length)] = [
                        ALL_TASKS[task](tok, length, depth=d, seed=sample_seed(args.seed, k))
                        for k, d in enumerate(even_depths(args.pool))]
                s = pool_cache[(task, length)][i]
                samples[(task, length, i)] = s
                if task == "labelfree" and todo[0][0] is not None and (task, length, i, "kvpress:none", None) in done:
                    todo = [(None, None)] + todo  # scored against the full cache's answer: rerun it first
                jobs.append({
                    "task": task, "length": length, "sample": i, "seed": s.seed, "depth": s.depth,
                    "ids": build_prompt_ids(tok, s.prompt), "max_new_tokens": MAX_NEW_TOKENS[task],
                    "configs": [[p, r] for p, r in todo],
                    # later turns: the ids that close the reply and ask the next question (kvtrim's runner's)
                    "turn_tails": [turn_tail(tok, t.question) for t in s.turns[1:]] if s.turns else [],
                    "turn_answers": [list(t.answers) for t in s.turns] if s.turns else [],
                })
    n_lines = sum(len(j["configs"]) for j in jobs)
    log(f"{len(done)} lines already done; {n_lines} to run over {len(jobs)} prompts")
    if not jobs:
        write_summary(out_dir)
        return
    WORK.mkdir(exist_ok=True)
    jobs_path = WORK / f"jobs-{out_dir.name}.jsonl"
    jobs_path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # the kvpress venv must not see kvtrim's transformers
    cmd = [str(py), str(Path(__file__).resolve()), "--worker", str(jobs_path), "--model-dir", str(model_dir),
           "--replay-check", str(replay_check_path(out_dir))]
    log("worker: " + " ".join(cmd))
    t0 = time.time()
    written = 0
    reference: dict = {}  # labelfree: the full cache's (kvpress:none) answer per sample
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        for raw in proc.stdout:
            if raw.startswith("SKIPPED "):
                d = json.loads(raw[len("SKIPPED "):])
                d.pop("machine", None)
                with open(out_dir / "skipped.log", "a") as f:  # not *.jsonl: never read as result lines
                    f.write(json.dumps(d) + "\n")
                n_lines -= 1
                continue
            if not raw.startswith("RESULT "):
                continue
            d = json.loads(raw[len("RESULT "):])
            key = (d["task"], d["length"], d["sample"])
            s = samples[key]
            if s.turns:  # each turn scored alone, the line's score is their mean (kvtrim's runner)
                d["turn_scores"] = [METRICS[s.metric](a, t.answers) for a, t in zip(d["answers"], s.turns)]
                d["score"] = sum(d["turn_scores"]) / len(s.turns)
            elif s.task == "labelfree":
                if d["method"] == "kvpress:none":
                    reference[key] = d["answer"]
                    d["score"] = 1.0
                else:
                    ref = reference[key]
                    d["score"] = rouge_l(d["answer"], ref) if ref else float(d["answer"] == ref)
            else:
                d["score"] = score(s, d["answer"])
            d["correct"] = d["score"] == 1.0 if s.metric != "rouge" else None
            if s.task == "labelfree" and d["method"] == "kvpress:none" and line_key(d) in done:
                continue  # rerun only to give the reference; its line is already there
            harness.append_jsonl(out_dir / f"{d['task']}-{d['length']}.jsonl", d)
            written += 1
            if written % 16 == 0 or written == n_lines:
                el = time.time() - t0
                log(f"{written}/{n_lines} lines, {el / 60:.1f} min, ~{el / written * (n_lines - written) / 60:.0f} min left")
    if proc.returncode != 0:
        raise SystemExit(f"worker failed with exit code {proc.returncode}")
    write_summary(out_dir)


def write_summary(out_dir: Path) -> None:
    from kvtrim import harness

    rows = load_lines(sorted(out_dir.glob("*.jsonl")))
    if not rows:
        log("no result lines yet")
        return
    machines = [d["machine"] for d in rows if d.get("machine")]
    rc = replay_check_path(out_dir)
    path = summary_path(out_dir)
    prev = json.loads(path.read_text()) if path.exists() else {}
    summary = {
        "what": "kvpress 0.5.5 presses on kvtrim's generated samples (question inside the compressed context)",
        "model": next((d["model"] for d in rows if d.get("model")), prev.get("model")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_at_summary": list(os.getloadavg()),
        "machine_shared": "2 cores shared with other jobs (the lead's sweep); 1 torch thread, nice 10",
        "worker_machine": machines[-1] if machines else None,
        "versions": {k: machines[-1].get(k) for k in ("kvpress", "transformers", "torch", "python")} if machines else None,
        "loadavg_worker_starts": sorted({tuple(m["loadavg_start"]) for m in machines}),
        "replay_check": json.loads(rc.read_text()) if rc.exists() else prev.get("replay_check"),
        "lines": len(rows),
        "skipped": sorted({(d["method"], d["task"], d["keep"], d["error"].split(":")[0])
                           for d in load_lines([out_dir / "skipped.log"])}) if (out_dir / "skipped.log").exists() else [],
        "cells": summarise(rows),
    }
    harness.write_json(path, summary)
    log(f"summary: {path} ({len(rows)} lines)")


def table(args) -> None:
    tasks, lengths = set(args.tasks.split(",")), {int(x) for x in args.lengths.split(",")}
    anchor = [d for d in load_lines(sorted(Path(args.table).glob("*.jsonl"))) if d["task"] in tasks and int(d["length"]) in lengths]
    kvtrim: list[dict] = []
    for i, kvt_dir in enumerate(Path(x) for x in args.kvtrim_dir.split(",")):
        # several sweeps of the same samples: the full cache's lines of the first only
        kvtrim += [d for d in load_lines(sorted(kvt_dir.glob("*.jsonl")))
                   if d.get("task") in tasks and int(d.get("length", 0)) in lengths
                   and d.get("prefill", "dense") == "dense" and d.get("score") is not None
                   and not (i and d.get("method") == "full")]
    if args.no_join or not kvtrim:
        if not kvtrim:
            print(f"(no kvtrim sweep lines under {args.kvtrim_dir}: kvpress side alone)\n")
        print(markdown_table(cell_stats(anchor, None)))
        return
    keys, mismatched = joined_keys(anchor, kvtrim)
    print(f"Joined on (task, length, sample, keep): {len(keys)} (task, length, sample) on both sides"
          + (f"; {mismatched} left out because seed/depth differ" if mismatched else "") + ". Cells: mean score (n).\n")
    n, same_score, same_text = full_agreement(anchor, kvtrim, keys)
    print(f"Full cache, kvpress side vs kvtrim side: {same_score}/{n} samples with the same score, "
          f"{same_text}/{n} with the same answer text (kvtrim stops early once the answer is complete).\n")
    stats = cell_stats(anchor + kvtrim, keys)
    if args.by_keep:
        for n in sorted(lengths):
            print(keep_table(stats, n) + "\n")
    else:
        print(markdown_table(stats))


# ----------------------------------------------------------------------------- worker (kvpress venv)


def _kv_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def worker(args) -> None:
    import copy
    import importlib.metadata as md

    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(1)
    machine = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "kvpress": md.version("kvpress"),
        "loadavg_start": list(os.getloadavg()), "shared": True, "dtype": "float32",
    }
    log(f"worker: {machine}")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model_name = Path(args.model_dir).name

    def make_press(name, ratio):
        if name.startswith("AdaKV-"):
            return kvpress.AdaKVPress(getattr(kvpress, f"{name[6:]}Press")(compression_ratio=ratio))
        return getattr(kvpress, f"{name}Press")(compression_ratio=ratio)

    class _KVzipKeep(kvpress.KVzipPress):
        """KVzip whose reconstruction scores are kept: they do not depend on the ratio, so one
        reconstruction pass per sample serves every ratio (kvpress would redo it per ratio)."""

        def compress_post(self, model):
            self.kept_scores = self.score_val.clone()
            super().compress_post(model)

    def kvzip_scores(ids, cache):
        """KVzip's reconstruction scores over the dense prompt (on a copy of its cache), timed."""
        press = _KVzipKeep(compression_ratio=0.5)
        c = copy.deepcopy(cache)
        t = time.perf_counter()
        with torch.no_grad(), press(model):
            press._context_ids, press._cache = ids, c  # what the press's wrapped forward would record
        clear_masks()
        return press.kept_scores, time.perf_counter() - t

    def kvzip_apply(scores, ratio):
        """KVzip's own selection (``compress_post``) for ``ratio``: masks on the attention modules."""
        press = kvpress.KVzipPress(compression_ratio=ratio)
        press.score_val = scores.clone()
        t = time.perf_counter()
        press.compress_post(model)
        return time.perf_counter() - t

    def clear_masks():
        for m in attn_layers:
            m.masked_key_indices = None

    def masked_count():
        """(key, head) pairs masked by a per-head press: resident in memory but never attended."""
        n = 0
        for m in attn_layers:
            idx = getattr(m, "masked_key_indices", None)
            if idx is not None:
                n += int(idx[0].numel())
        return n

    attn_layers = [layer.self_attn for layer in model.model.layers]

    def dense_prefill(ids):
        """Full-cache prefill of the whole prompt; records each attention layer's forward call."""
        calls = {}

        def rec(module, inp, kwargs, output):
            calls[module.layer_idx] = (inp, dict(kwargs), (None, output[1]))

        hooks = [m.register_forward_hook(rec, with_kwargs=True) for m in attn_layers]
        cache = DynamicCache()
        try:
            t = time.perf_counter()
            with torch.no_grad():
                out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
            secs = time.perf_counter() - t
        finally:
            for h in hooks:
                h.remove()
        return cache, calls, int(out.logits[0, -1].argmax()), secs

    def replay(press, cache, calls):
        """Apply ``press`` to a copy of the dense cache through the press's own forward hook."""
        c = copy.deepcopy(cache)
        t = time.perf_counter()
        with torch.no_grad(), press(model):
            for m in attn_layers:
                inp, kw, out = calls[m.layer_idx]
                kw = dict(kw, past_key_values=c)
                press.forward_hook(m, inp, kw, out)
        return c, time.perf_counter() - t

    def complete(gen, answers):
        """kvtrim's early stop for a turn (kvtrim.eval.programs.answer_complete with the
        ``contains`` metric): every answer found, not glued to letters or digits, and the text ends
        in a character that is not a letter or digit."""
        text = tok.decode([t for t in gen if t not in eos], skip_special_tokens=True)
        if not text or text[-1].isalnum():
            return False
        return any(re.search(r"(?<![0-9A-Za-z])" + re.escape(a.strip()) + r"(?![0-9A-Za-z])", text, flags=re.I)
                   for a in answers)

    def decode(cache, first, n_prompt, max_new, answers=None):
        """Greedy decoding as kvpress's pipeline does it: true positions, stop at EOS (and, for a
        multi-turn sample's turns, where kvtrim's runner stops). The next free position is
        ``n_prompt + len(gen) - 1``: the last token is generated, not fed."""
        gen = [first]
        steps = 0
        t = time.perf_counter()
        with torch.no_grad():
            while len(gen) < max_new and gen[-1] not in eos and not (answers and complete(gen, answers)):
                pos = torch.tensor([[n_prompt + len(gen) - 1]])
                out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=cache, position_ids=pos)
                gen.append(int(out.logits[0, -1].argmax()))
                steps += 1
        return gen, steps, time.perf_counter() - t

    def converse(cache, first, n_prompt, j):
        """A multi-turn sample through one cache: each later question fed after the previous answer
        (its last token unless EOS, then ``turn_tail``), as kvtrim's runner does."""
        answers, steps, secs = [], 0, 0.0
        pos, gen = n_prompt, [first]
        for ti in range(len(j["turn_answers"])):
            if ti:
                feed = ([] if gen[-1] in eos else [gen[-1]]) + j["turn_tails"][ti - 1]
                t = time.perf_counter()
                with torch.no_grad():
                    out = model(input_ids=torch.tensor([feed]), past_key_values=cache,
                                position_ids=torch.arange(pos, pos + len(feed))[None])
                secs += time.perf_counter() - t
                steps += 1
                pos += len(feed)
                first = int(out.logits[0, -1].argmax())
            gen, s, d = decode(cache, first, pos, j["max_new_tokens"], j["turn_answers"][ti])
            pos += len(gen) - 1
            steps += s
            secs += d
            answers.append(tok.decode([t for t in gen if t not in eos], skip_special_tokens=True).strip())
        return answers, steps, secs

    jobs = [json.loads(x) for x in Path(args.worker).read_text().splitlines() if x.strip()]

    rc_path = Path(args.replay_check) if args.replay_check else None
    if rc_path is not None and not rc_path.exists() and jobs:
        # The replay must give the cache that running the prefill under the press gives.
        j = min(jobs, key=lambda x: len(x["ids"]))
        ids = torch.tensor([j["ids"]])
        cache, calls, _, _ = dense_prefill(ids)
        check = {"task": j["task"], "length": j["length"], "sample": j["sample"], "ratio": 0.5, "max_abs_diff": {}}
        for name in [x for x in KNOWN_PRESSES if x != "KVzip"]:  # KVzip runs its own pass (kvzip_scores)
            try:
                press = make_press(name, 0.5)
                real = DynamicCache()
                with torch.no_grad(), press(model):
                    model(input_ids=ids, past_key_values=real, logits_to_keep=1)
                rep, _ = replay(make_press(name, 0.5), cache, calls)
                diff = 0.0
                for a, b in zip(real.layers, rep.layers):
                    if a.keys.shape != b.keys.shape:
                        diff = float("inf")
                        break
                    diff = max(diff, (a.keys - b.keys).abs().max().item(), (a.values - b.values).abs().max().item())
                check["max_abs_diff"][name] = diff
                if name.startswith("AdaKV-"):  # same keys; the per-head choice is in the masks
                    check["max_abs_diff"][name] = diff if masked_count() else "no masks set"
                clear_masks()
            except Exception as e:  # noqa: BLE001 - report, do not hide
                check["max_abs_diff"][name] = f"error: {type(e).__name__}: {e}"
            log(f"replay check {name}: {check['max_abs_diff'][name]}")
        rc_path.write_text(json.dumps(check, indent=1) + "\n")
        del cache, calls

    for j in jobs:
        ids = torch.tensor([j["ids"]])
        n = ids.shape[1]
        cache, calls, first, pre_s = dense_prefill(ids)
        full_bytes = _kv_bytes(cache)
        zip_scores, zip_s = None, 0.0
        for name, ratio in j["configs"]:
            base = {k: j[k] for k in ("task", "length", "sample", "seed", "depth")}
            base.update(method=method_name(name), keep=keep_of(ratio), prefill="dense", prompt_tokens=n,
                        kv_bytes_full=full_bytes, max_new_tokens=j["max_new_tokens"], machine=machine,
                        model=model_name)
            try:
                clear_masks()
                if name is None:
                    c, comp_s = copy.deepcopy(cache), 0.0
                elif name == "KVzip":
                    if zip_scores is None:
                        zip_scores, zip_s = kvzip_scores(ids, cache)
                    c = copy.deepcopy(cache)
                    comp_s = zip_s + kvzip_apply(zip_scores, ratio)
                else:
                    c, comp_s = replay(make_press(name, ratio), cache, calls)
                kvb = _kv_bytes(c)
                masked = masked_count()
                # bytes the press would hold if its masked (key, head) pairs were freed: per pair, one
                # key and one value row of head_dim elements
                per_pair = 2 * c.layers[0].keys.shape[-1] * c.layers[0].keys.element_size()
                if j["turn_answers"]:
                    answers, steps, dec_s = converse(c, first, n, j)
                    base.update(answer=answers[0], answers=answers)
                    new_tokens = None
                else:
                    gen, steps, dec_s = decode(c, first, n, j["max_new_tokens"])
                    base.update(answer=tok.decode(gen, skip_special_tokens=True))
                    new_tokens = len(gen)
                base.update(new_tokens=new_tokens, kv_bytes=kvb, kv_bytes_unmasked=kvb - masked * per_pair,
                            masked_pairs=masked, prefill_seconds=pre_s + comp_s, compress_seconds=comp_s,
                            decode_seconds=dec_s, decode_steps=steps)
            except RuntimeError as e:
                # kvpress itself fails here (PyramidKV's uneven layers under a multi-token turn on
                # transformers 5.2: the mask is sized from layer 0): recorded, not scored, not hidden
                log(f"SKIPPED {base['method']} {ratio} {j['task']} {j['length']} #{j['sample']}: {type(e).__name__}: {e}")
                print("SKIPPED " + json.dumps(base | {"error": f"{type(e).__name__}: {e}"}), flush=True)
                continue
            finally:
                clear_masks()
            print("RESULT " + json.dumps(base), flush=True)
            del c
        del cache, calls


# ----------------------------------------------------------------------------- CLI


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="kvtrim model name or path (default: the embedded model), e.g. qwen2.5-0.5b")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--pool", type=int, default=20, help="n of make_samples (sample i's depth is i/(pool-1)); default 20")
    ap.add_argument("--samples", type=int, default=10, help="how many of the pool to run (even indices first); default 10")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", metavar="DIR", help="folder of the result lines (an existing one is continued); the summary "
                                                 "goes beside it as DIR_summary.json. Required unless --table/--setup-only")
    ap.add_argument("--setup-only", action="store_true", help="only create/check the kvpress venv")
    ap.add_argument("--summary-only", action="store_true", help="only rewrite the summary JSON from the result lines in --out")
    ap.add_argument("--table", metavar="DIR", help="print the markdown table (kvpress vs kvtrim sweep) of the lines in DIR "
                                                   "for --tasks/--lengths, e.g. the committed benchmarks/results/anchor_kvpress")
    ap.add_argument("--kvtrim-dir", default=str(KVTRIM_DIR),
                    help="kvtrim sweep lines ({task}-{length}.jsonl); several sweeps of the same samples comma-separated")
    ap.add_argument("--no-join", action="store_true", help="--table: kvpress side alone, no join")
    ap.add_argument("--by-keep", action="store_true", help="--table: one row per method and keep, a column per task "
                    "and their mean, and per keep kvtrim's best method against the best press")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--replay-check", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
    elif args.table:
        table(args)
    elif args.setup_only:
        setup_env()
    else:
        from kvtrim import harness
        from kvtrim.errors import KVTrimError

        if not args.out:
            ap.error("--out DIR is required (the folder of result lines; --table DIR renders an existing one)")
        try:
            harness.check_out(args.out, directory=True)
        except KVTrimError as e:
            ap.error(str(e))
        if args.summary_only:
            write_summary(Path(args.out))
            return
        if args.samples > args.pool:
            ap.error("--samples must be <= --pool")
        run(args)


if __name__ == "__main__":
    main()
