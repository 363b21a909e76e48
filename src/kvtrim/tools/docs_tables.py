"""Regenerate every generated block of README.md and docs/*.md from the committed result files.

The results live in ``docs/results.md``; the README keeps a short generated summary (``headline``).

A generated block sits between two HTML comments that name the command producing it::

    <!-- generated: benchmarks/bench_memory_decode.py --table benchmarks/results/memory_decode.json -->
    ...the command's output, verbatim...
    <!-- end generated -->

The command is a benchmark script with its ``--table`` arguments (run in this process: the
script's ``main(argv)`` with stdout captured), or ``kvtrim.tools.docs_tables NAME`` for a block
this module computes itself (``guide``, ``vllm``, ``headline``: numbers quoted in prose, from the
committed JSON). The evaluation sweep's block in ``docs/results.md`` (``<!-- kvtrim-report:start -->``),
``docs/eval/`` (the embedded model's sweep) and ``docs/eval_qwen/`` (the reference model's) are
``kvtrim report``'s output and are regenerated too.

    .venv/bin/python -m kvtrim.tools.docs_tables --check    # exit 1 and name every stale block
    .venv/bin/python -m kvtrim.tools.docs_tables --write    # rewrite the blocks (and docs/eval/) in place

Run from the repository root (``--root`` otherwise). ``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import math
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from kvtrim.errors import KVTrimError
from kvtrim.files import read_json, read_text, write_atomic

BLOCK = re.compile(r"<!-- generated: (?P<cmd>.+?) -->\n(?P<body>.*?)<!-- end generated -->", re.S)
SELF = "kvtrim.tools.docs_tables"
EVAL_DIR = "benchmarks/results/eval_baseline"  # the embedded model's sweep: the report block of RESULTS, docs/eval/
RESULTS = "docs/results.md"  # the page that holds the results, with the `kvtrim report` block
RESULTS_IMAGES = "eval"  # the report block's PNG links, relative to RESULTS (docs/eval/)
# the reference model's sweeps (4k in float32, 16k in bfloat16): docs/eval_qwen/, the eval_qwen block
EVAL_QWEN_DIRS = ("benchmarks/results/eval_qwen", "benchmarks/results/eval_qwen16k")


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _sibling_imports(script: Path) -> list[str]:
    """The modules ``script`` imports (anywhere in it, functions included) that are scripts in its own folder."""
    import ast

    names = []
    for node in ast.walk(ast.parse(read_text(script, "benchmark script"), str(script))):
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module.split(".")[0])
    return [n for n in dict.fromkeys(names) if (script.parent / f"{n}.py").is_file() and n != script.stem]


def load_script(script: str | Path, name: str | None = None):
    """A benchmark script as a module (``name``: its module name, default the file's stem), not run as ``__main__``.

    Run as a script, a benchmark imports the scripts beside it by name (``import anchor_vllm``:
    Python puts a script's folder first on ``sys.path``). Loaded here, those sibling scripts are
    loaded first, from the same folder, and registered in ``sys.modules`` under their names (once;
    an earlier load is reused), so the script's imports, also those inside its functions, find
    them; ``sys.path`` is not changed.
    """
    return _load_module(Path(script), name or Path(script).stem, register=False)


def _load_module(script: Path, name: str, register: bool):
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    if register:  # before it runs, as the import system does, so two scripts may import each other
        sys.modules[name] = mod
    try:
        for sibling in _sibling_imports(script):
            if sibling not in sys.modules:
                _load_module(script.parent / f"{sibling}.py", sibling, register=True)
        spec.loader.exec_module(mod)
    except BaseException:
        if register:
            sys.modules.pop(name, None)
        raise
    return mod


def run_script(root: Path, argv: list[str]) -> str:
    """The stdout of ``python <script> <args>`` for a benchmark script, run in this process (:func:`load_script`)."""
    script = root / argv[0]
    if not script.is_file():
        raise KVTrimError(f"generated block names {argv[0]!r}, which does not exist")
    mod = load_script(script, "_docs_" + script.stem)
    old_argv = sys.argv
    buf = io.StringIO()
    try:
        sys.argv = [str(script), *argv[1:]]
        with contextlib.redirect_stdout(buf):
            try:
                try:
                    rc = mod.main(argv[1:])
                except TypeError:
                    rc = mod.main()  # a main() that reads sys.argv
            except SystemExit as e:
                rc = e.code
    finally:
        sys.argv = old_argv
    if rc not in (None, 0):
        raise KVTrimError(f"{' '.join(argv)} exited with status {rc}")
    return buf.getvalue()


def produce(root: Path, cmd: str) -> str:
    argv = shlex.split(cmd)
    if argv[0] == SELF:
        if len(argv) != 2 or argv[1] not in GENERATORS:
            raise KVTrimError(f"unknown generated block {cmd!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[argv[1]](root)
    return run_script(root, argv)


def regenerate(root: Path, text: str) -> str:
    def repl(m: re.Match) -> str:
        body = produce(root, m.group("cmd")).rstrip("\n") + "\n"
        return f"<!-- generated: {m.group('cmd')} -->\n{body}<!-- end generated -->"

    return BLOCK.sub(repl, text)


# ----------------------------------------------------------------------------- computed blocks
def _load(root: Path, rel: str):
    return read_json(root / rel, "result file", kind="results")


def _eval_cells(root: Path, rel: str = EVAL_DIR) -> list[dict]:
    from kvtrim.eval.report import load_dirs, summarize

    return summarize(load_dirs([str(root / rel)]))["cells"]


def _cell(cells, task, length, method, keep):
    for c in cells:
        if (c["task"], c["length"], c["method"], c["keep"], c["prefill"]) == (task, length, method, keep, "dense"):
            return c
    raise KVTrimError(f"no eval cell {task} {length} {method} {keep}")


def guide(root: Path) -> str:
    """"Which method for which job": each pick with the measured reason, from the committed results (the
    document and chat rows from the reference model's sweep, the others from the embedded model's benchmarks)."""
    from kvtrim.integrations.prefill import DEFAULT_MIN_LENGTH

    q = _eval_cells(root, EVAL_QWEN_DIRS[0])
    q16 = _eval_cells(root, EVAL_QWEN_DIRS[1])
    n = 4096
    keeps = (0.1, 0.25, 0.5)
    doc_methods = ("snapkv", "inf_mllm", "h2o", "streaming_llm", "elastic")

    def row(task, m, cells=q, length=n):
        return " / ".join(f"{_cell(cells, task, length, m, k)['score']:.2f}" for k in keeps)

    qt = _eval_cells(root, TOVA_DIRS[1])
    qz = _eval_cells(root, KVZIP_QWEN_DIRS[2])
    kzr = _load(root, KVZIP_COST)
    kz = kzr["median"]
    tova16 = _cell(_eval_cells(root, TOVA16K_DIRS[1]), "multiturn", 16384, "tova", 0.25)["score"]
    fixed = {}  # multiturn at chat's fixed budgets, the reference model at 4k (chat_default)
    for c in _eval_cells(root, CHAT_DEFAULT_DIRS[2][0]):
        m, b = _fixed_budget(c["method"])
        if c["task"] == "multiturn" and b is not None:
            fixed[(m, b)] = c["score"]
    full_ns = _cell(q, "niah_single", n, "full", None)["score"]
    full_mt = _cell(q, "multiturn", n, "full", None)["score"]
    full_ns16 = _cell(q16, "niah_single", 16384, "full", None)["score"]
    full_mt16 = _cell(q16, "multiturn", 16384, "full", None)["score"]
    sc = _load(root, "benchmarks/results/stream_compare.json")
    from statistics import median

    def ppl(m):
        ch = sc["methods"][m]["chunks"][2:]
        return math.exp(sum(c["nll_sum"] for c in ch) / sum(c["scored"] for c in ch))

    pp = [ppl(m) for m in ("inf_mllm", "streaming_llm", "h2o")]

    def tps(m):
        return median(c["tokens_per_s"] for c in sc["methods"][m]["chunks"][2:])

    sl = _load(root, "benchmarks/results/stream_long.json")
    hae = _load(root, "benchmarks/results/hae_prefill.json")
    big = [r for r in hae["rows"] if r["visual_tokens"] == max(x["visual_tokens"] for x in hae["rows"])]
    spd = {r["config"]: r["speedup_vs_full"] for r in big}
    mp = _load(root, "benchmarks/results/minference_prefill.json")
    sp = {int(n): v for n, v in mp["summary"]["minference"]["speedup_wall"].items()}
    crossover = mp["summary"]["minference"]["crossover_length"]
    f = "{:.2f}".format
    lines = [
        "| job | pick | why (measured) |",
        "|---|---|---|",
        "| one-shot question over a long document | `snapkv`, keep 0.25-0.5 | Qwen2.5-Coder-0.5B-Instruct sweep, 4k tokens, single needle "
        f"at keep 0.1 / 0.25 / 0.5 (full cache {full_ns:.2f}): "
        + ", ".join(f"`{m}` {row('niah_single', m)}" for m in doc_methods)
        + f"; at 16k tokens (full cache {full_ns16:.2f}): "
        + ", ".join(f"`{m}` {row('niah_single', m, q16, 16384)}" for m in doc_methods) + " |",
        "| long chat (many turns) | `tova` (`kvtrim chat`'s default), with a keep or a fixed budget | "
        "Qwen2.5-Coder-0.5B-Instruct sweep, 4k tokens, multi-turn questions through one cache at keep 0.1 / 0.25 / 0.5 "
        f"(full cache {full_mt:.2f}): `tova` {row('multiturn', 'tova', qt)}, "
        + ", ".join(f"`{m}` {row('multiturn', m)}" for m in doc_methods)
        + f"; at 16k tokens (full cache {full_mt16:.2f}): `tova` - / {tova16:.2f} / - (keep 0.25 only), "
        + ", ".join(f"`{m}` {row('multiturn', m, q16, 16384)}" for m in doc_methods)
        + "; at a fixed budget of 512 / 1024 tokens (4k): " + ", ".join(
            f"`{m}` {fixed[(m, 512)]:.2f} / {fixed[(m, 1024)]:.2f}" for m in ("tova", "inf_mllm", "streaming_llm", "h2o"))
        + " |",
        "| a document asked several questions | `kvzip`, keep 0.1-0.25 (`generate`, `chat`'s first message) | "
        "the same 4k multi-turn questions at keep 0.1 / 0.25 / 0.5: "
        f"`kvzip` {row('multiturn', 'kvzip', qz)}, `tova` {row('multiturn', 'tova', qt)}; multi-key needles: `kvzip` "
        f"{row('niah_multikey', 'kvzip', qz)}, `tova` {row('niah_multikey', 'tova', qt)}, `snapkv` {row('niah_multikey', 'snapkv')}; "
        f"its prefill took {kz['kvzip']['prefill_seconds'] / kz['full']['prefill_seconds']:.1f}x the full cache's "
        f"({kzr['prompt_tokens']:,} tokens; a second forward reconstructs the prompt) |",
        f"| unbounded stream | `streaming_llm` or `inf_mllm` with `--max-tokens` | stream results (embedded model): 1,000,000 tokens with "
        f"`inf_mllm` at {sl['max_tokens']} tokens, KV flat, RSS +{_rss_growth(sl):.2%} after 100k; at the same budget "
        f"`streaming_llm` streams {tps('streaming_llm'):.0f} tok/s, `inf_mllm` {tps('inf_mllm'):.0f}, `h2o` {tps('h2o'):.0f} "
        f"(pooled perplexity once the budget is full: {pp[1]:.1f}, {pp[0]:.1f}, {pp[2]:.1f}) |",
        f"| images or video | `hae` (prune mode) or `fastv` | HAE prefill benchmark (embedded model), {big[0]['visual_tokens']:,} visual "
        f"tokens: prefill {f(spd['hae_prune(matched)'])}x faster with DAP pruning, {f(spd['fastv_prune'])}x with FastV; "
        "both act on image/video tokens only (refused on text), and on text with a document span both lose a pass key "
        "that `snapkv` keeps (DAP proxy) |",
        "| faster prefill of a long prompt | `--prefill minference` (with any KV method) | MInference prefill benchmark (embedded model): "
        + ", ".join(f"{sp[n]:.2f}x at {n}" for n in sorted(sp)) + f" tokens (break-even at {crossover}; "
        f"`--prefill-min-length`, default {DEFAULT_MIN_LENGTH}, keeps shorter prompts dense) |",
    ]
    return "\n".join(lines) + "\n"


def eval_summary(root: Path) -> str:
    """The bullets of docs/results.md on the evaluation sweep, from its committed result lines."""
    from kvtrim.eval.report import MIN_FULL_SCORE, eligible_tasks, row_summary

    cells = _eval_cells(root)
    methods = ["streaming_llm", "snapkv", "h2o", "inf_mllm", "elastic"]
    keeps = (0.1, 0.25, 0.5)

    def sc(task, n, m, k=None):
        return _cell(cells, task, n, m, k)["score"]

    f = "{:.2f}".format
    pk = {n: " / ".join(f(sc("passkey", n, "snapkv", k)) for k in keeps) for n in (2048, 4096)}
    out = [
        "- Every compressing method loses most needle retrieval at keep 0.1. `snapkv` keeps the pass key best: "
        f"{pk[2048]} at keep 0.1 / 0.25 / 0.5 at 2k tokens (full cache {f(sc('passkey', 2048, 'full'))}), {pk[4096]} "
        f"at 4k (full cache {f(sc('passkey', 4096, 'full'))}).",
        f"- Mean score over the tasks the full cache solves (score at least {MIN_FULL_SCORE:g}: "
        + "; ".join(f"{n // 1024}k: {', '.join(eligible_tasks(cells, n))}" for n in (2048, 4096))
        + "), and in brackets its ratio to the full cache's on the same samples:",
        "",
        "  | length | keep | full | " + " | ".join(f"`{m}`" for m in methods) + " |",
        "  |---|---:|---:|" + "---:|" * len(methods),
    ]
    for n in (2048, 4096):
        full_mean, _ = row_summary(cells, n, "full", None)
        for k in (0.5, 0.25):
            vals = []
            for m in methods:
                mean, rel = row_summary(cells, n, m, k)
                vals.append("—" if mean is None else f"{mean:.2f} ({rel:.0%})")
            out.append(f"  | {n // 1024}k | {k:g} | {f(full_mean)} | " + " | ".join(vals) + " |")
    ppl = {k: [sc("ppl", 2048, m, k) for m in methods if m != "elastic"] for k in (0.5, 0.25)}
    out += [
        "",
        f"- Perplexity moves least. At 2k it goes from {sc('ppl', 2048, 'full'):.1f} (full) to "
        f"{min(ppl[0.5]):.1f}-{max(ppl[0.5]):.1f} at keep 0.5 and {min(ppl[0.25]):.1f}-{max(ppl[0.25]):.1f} at keep 0.25. "
        f"`elastic` is the exception: {sc('ppl', 2048, 'elastic', 0.5):.1f} and {sc('ppl', 2048, 'elastic', 0.25):.1f}.",
    ]
    mt = [sc("multiturn", 2048, m, 0.5) for m in methods if m != "elastic"]
    out.append(f"- Multi-turn questions (full cache {f(sc('multiturn', 2048, 'full'))} at 2k) drop to "
               f"{f(min(mt))}-{f(max(mt))} at keep 0.5, and to {f(sc('multiturn', 2048, 'elastic', 0.5))} for `elastic`.")
    return "\n".join(out) + "\n"


def _rss_growth(sl: dict) -> float:
    chunks = sl["methods"]["inf_mllm"]["chunks"]
    at = next(c for c in chunks if c["seen"] >= 100_000)
    return max(c["rss_bytes"] for c in chunks if c["seen"] > at["seen"]) / at["rss_bytes"] - 1


def vllm(root: Path) -> str:
    """The vLLM comparison, both ways, from anchor_vllm.json."""
    mod = load_script(root / "benchmarks" / "anchor_vllm.py", "_docs_anchor_vllm")
    return mod.comparison(_load(root, "benchmarks/results/anchor_vllm.json"))


def bench_cli(root: Path) -> str:
    """`kvtrim bench`'s table of its committed run (benchmarks/results/bench_cli.json)."""
    from kvtrim.eval.bench import table

    return table(_load(root, "benchmarks/results/bench_cli.json")) + "\n"


def eval_qwen(root: Path) -> str:
    """The reference model's sweeps: one score table per length (absolute scores, and relative to the full
    cache only over the tasks the full cache solves), from their committed result lines."""
    from kvtrim.eval.report import score_table

    parts = []
    for rel in _qwen_dirs(root):
        dtype = read_json(root / rel / "config.json", "eval config").get("dtype", "float32")
        cells = _eval_cells(root, rel)
        for n in sorted({c["length"] for c in cells if c["prefill"] == "dense"}):
            parts.append(f"#### Qwen2.5-Coder-0.5B-Instruct, {n} tokens, {dtype} (`{rel}`)\n\n" + score_table(cells, n))
    return "\n\n".join(parts) + "\n"


# the bfloat16 runs against vLLM's CPU engine that docs/results.md lists (its beat_vllm.py --verdict block)
BEAT_VLLM_RUNS = ("idle_amx", "idle_amx_qwen8k", "idle_smollm2_noamx", "idle_qwen8k_noamx", "idle_qwen32k_noamx",
                  "idle_qwen8k_noamx_decattn", "idle_smollm2_8k_epyc_decattn", "idle_qwen32k_noamx_decattn",
                  "idle_qwen8k_noamx_packed", "idle_smollm2_epyc_packed", "idle_qwen32k_noamx_packed",
                  "idle_qwen_amx_flat", "idle_qwen_amx_fused", "idle_qwen8k_amx_fused", "idle_qwen8k_amx_grouped")
BEST_CONFIG = "snapkv@0.25+minference"  # kvtrim's configuration in those runs


def _share(cells, n: int, m: str, k: float) -> float:
    """The mean of each solved task's score relative to the full cache's (the tables' "rel. to full")."""
    from kvtrim.eval.report import row_summary

    rel = row_summary(cells, n, m, k)[1]
    if rel is None:
        raise KVTrimError(f"no score relative to the full cache for {m} @{k} at {n} tokens")
    return rel


def _later_methods(root: Path, n: int, snapkv: dict[float, float]) -> str:
    """The headline's clause on the methods measured after the sweep on its samples (``tova``, ``kvzip``;
    :data:`KVZIP_QWEN_DIRS` joined): their share at ``n`` tokens, and where they pass ``snapkv``'s."""
    from kvtrim.eval.report import summarize

    cells = summarize(_joined_sweeps(root, KVZIP_QWEN_DIRS)[0])["cells"]
    later = {m: {k: _share(cells, n, m, k) for k in (0.1, 0.25, 0.5)} for m in ("kvzip", "tova")}
    ahead = [k for k in (0.1, 0.25, 0.5) if max(r[k] for r in later.values()) > snapkv[k]]
    first = {k: max(later, key=lambda m: later[m][k]) for k in (0.1, 0.25, 0.5)}
    text = ", ".join(f"`{m}` {r[0.1]:.0%} / {r[0.25]:.0%} / {r[0.5]:.0%}" for m, r in later.items())
    best = "; ".join(f"`{first[k]}` first at keep {k:g}" for k in (0.1, 0.25, 0.5))
    return (f" of that sweep's methods. Measured later on the same {n}-token samples, at keep 0.1 / 0.25 / 0.5: {text} "
            f"(`snapkv` {snapkv[0.1]:.0%} / {snapkv[0.25]:.0%} / {snapkv[0.5]:.0%}); "
            + (f"they are ahead of `snapkv` at keep {', '.join(f'{k:g}' for k in ahead)}: {best}" if ahead else
               "`snapkv` stays first"))


def headline(root: Path) -> str:
    """The README's short summary of the results: a few numbers from the committed results, each claim
    checked here against them (a claim that no longer holds raises instead of printing)."""
    from kvtrim.eval.report import MIN_FULL_SCORE
    from kvtrim.integrations.prefill import DEFAULT_MIN_LENGTH

    out = []
    rels: dict[tuple[int, str], dict[str, dict[float, float]]] = {}
    for rel_dir in EVAL_QWEN_DIRS:
        dtype = read_json(root / rel_dir / "config.json", "eval config").get("dtype", "float32")
        cells = _eval_cells(root, rel_dir)
        n = max(c["length"] for c in cells if c["prefill"] == "dense")
        methods = sorted({c["method"] for c in cells if c["method"] != "full"})
        rels[(n, dtype)] = {m: {k: _share(cells, n, m, k) for k in (0.1, 0.25, 0.5)} for m in methods}
    (n4, d4), (n16, d16) = rels
    order = sorted(rels[(n4, d4)], key=lambda m: -rels[(n4, d4)][m][0.5])
    for key, rel in rels.items():
        for k in (0.1, 0.25, 0.5):
            if rel["snapkv"][k] < max(r[k] for r in rel.values()) or rel["elastic"][k] > min(r[k] for r in rel.values()):
                raise KVTrimError(f"the headline says snapkv is first and elastic last at every budget; not so at {key}, keep {k}")

    def shares(rel):
        return ", ".join(f"`{m}` {rel[m][0.25]:.0%} / {rel[m][0.5]:.0%}" for m in order)

    out.append(
        f"- **Documents and chats** on the reference model Qwen2.5-Coder-0.5B-Instruct: the share of the full cache's score each method "
        f"keeps (over the tasks the full cache solves, score at least {MIN_FULL_SCORE:g}) at keep 0.25 / 0.5. At {n4} tokens "
        f"({d4}): {shares(rels[(n4, d4)])}; at {n16} tokens ({d16}): {shares(rels[(n16, d16)])}. `snapkv` is first and "
        "`elastic` last at every budget (0.1, 0.25, 0.5)" + _later_methods(root, n4, rels[(n4, d4)]["snapkv"]) + ".")
    sl = _load(root, "benchmarks/results/stream_long.json")
    chunks = sl["methods"]["inf_mllm"]["chunks"]
    kv = {c["kv_bytes"] for c in chunks[1:]}
    if len(kv) != 1 or any(c["stored"] != sl["max_tokens"] for c in chunks[1:]):
        raise KVTrimError("the headline says the stream's KV stays flat once the budget is full; not so in stream_long.json")
    out.append(
        f"- **Long streams**: `inf_mllm` streamed {chunks[-1]['seen']:,} tokens through the embedded model at a "
        f"{sl['max_tokens']}-token budget; resident KV stayed at {kv.pop() / 2**20:.1f} MiB from the second chunk on, and "
        f"process memory never rose more than {_rss_growth(sl):.2%} above its size at 100k tokens.")
    mp = _load(root, "benchmarks/results/minference_prefill.json")
    sp = {int(k): v for k, v in mp["summary"]["minference"]["speedup_wall"].items()}
    out.append(
        f"- **Sparse prefill** (`--prefill minference`, embedded model): the prefill is {sp[max(sp)]:.2f}x faster at "
        f"{max(sp)} tokens; break-even at {mp['summary']['minference']['crossover_length']} tokens, and "
        f"`--prefill-min-length` keeps prompts under {DEFAULT_MIN_LENGTH} dense, where the gain was clear on every "
        "machine measured ([why](docs/minference.md)).")
    rows = [c for name in BEAT_VLLM_RUNS
            for c in _load(root, f"benchmarks/results/beat_vllm/{name}.json")["comparison"] if c["kvtrim"] == BEST_CONFIG]
    by_len = {n: [c for c in rows if c["length"] == n] for n in sorted({c["length"] for c in rows})}
    if not all(c["answers_kept"] for c in rows):
        raise KVTrimError("the headline says kvtrim answers every pass key vLLM answers; not so in the beat_vllm runs")
    kv_lo, kv_hi = (f"{f(c['kv_ratio'] for c in rows):.2f}" for f in (min, max))
    ahead = " and ".join(f"in {sum(c['e2e_seconds_vllm_over_kvtrim'] > 1 for c in cs)} of {len(cs)} comparisons at {n:,} tokens"
                         for n, cs in sorted(by_len.items(), reverse=True))
    out.append(
        f"- **Against vLLM's CPU engine** (both in bfloat16, {len(BEAT_VLLM_RUNS)} runs): kvtrim's `snapkv` at keep 0.25 with "
        f"sparse prefill was faster end to end {ahead}; it held {kv_lo if kv_lo == kv_hi else f'{kv_lo}-{kv_hi}'}x of "
        "vLLM's KV and answered every pass key vLLM answered.")
    return "\n".join(out) + "\n"


AGNOSTIC_DIR = "benchmarks/results/eval_agnostic"  # issue 47: query-agnostic scores and per-layer budgets


def agnostic(root: Path) -> str:
    """The sweep of ``expected_attention`` and per-layer budgets against snapkv and inf_mllm on the
    embedded model: the score and memory tables of ``kvtrim report``, and multiturn's score per turn
    (the first question is asked in the prompt the cache was compressed at; the later ones are not)."""
    return _sweep_tables(root, AGNOSTIC_DIR, [
        ("expected_attention", "snapkv"), ("expected_attention", "inf_mllm"), ("expected_attention:question=0.5", "snapkv"),
        ("snapkv:layers=adaptive", "snapkv"), ("snapkv:layers=pyramid", "snapkv")])


PERHEAD_DIR = "benchmarks/results/eval_perhead"  # issue 47: per-head budgets (AdaKV)


def perhead(root: Path) -> str:
    """snapkv with per-head budgets (``heads=adaptive``) against uniform heads on the embedded model: the
    tables of :func:`agnostic` for that sweep."""
    return _sweep_tables(root, PERHEAD_DIR, [("snapkv:heads=adaptive", "snapkv")])


#: issue 47's 16k multi-turn target: tova's parameters at keep 0.25 (pooling kernel, a window of rows, per-head sets)
TOVA16K_VARIANT_DIRS = ("benchmarks/results/eval_tova16k", "benchmarks/results/eval_tova16k_var",
                        "benchmarks/results/eval_tova16k_var2")


def tova_qwen16k_variants(root: Path) -> str:
    """tova's variants against its defaults on the 16k multi-turn chat (``kvtrim report``'s tables)."""
    return _sweep_tables(root, TOVA16K_VARIANT_DIRS, [(v, "tova") for v in (
        "tova:kernel=11", "tova:kernel=3", "tova:per_head=true", "tova:window=2", "tova:window=8")])


#: issue 47: per-head and per-layer budgets on the reference model's 4k sweep, joined with it (same samples)
BUDGETS_QWEN_DIRS = ("benchmarks/results/eval_qwen", "benchmarks/results/eval_budgets_qwen")


def budgets_qwen(root: Path) -> str:
    """snapkv with per-head (``heads=adaptive``) and per-layer (``layers=adaptive``) budgets against
    uniform snapkv on the reference model's 4k sweep (``kvtrim report``'s tables)."""
    return _sweep_tables(root, BUDGETS_QWEN_DIRS, [("snapkv:heads=adaptive", "snapkv"),
                                                   ("snapkv:layers=adaptive", "snapkv")])


#: issue 47: kvzip (query-agnostic reconstruction scores) on the reference model's 4k sweep, joined with
#: the sweep and tova's lines (the same samples)
KVZIP_COST = "benchmarks/results/kvzip_cost.json"  # bench_kvzip_cost.py: its prefill and decode cost
KVZIP_QWEN_DIRS = ("benchmarks/results/eval_qwen", "benchmarks/results/eval_tova", "benchmarks/results/eval_kvzip",
                   "benchmarks/results/eval_kvzip_rest")


def kvzip_qwen(root: Path) -> str:
    """kvzip (one threshold over every layer and head, and per-head uniform) against tova and snapkv on
    the reference model's 4k sweep (``kvtrim report``'s tables)."""
    return _sweep_tables(root, KVZIP_QWEN_DIRS, [("kvzip", "tova"), ("kvzip", "snapkv"),
                                                 ("kvzip:scope=uniform", "kvzip")])


def _joined_sweeps(root: Path, rels: tuple[str, ...]) -> tuple[list[dict], str]:
    """The result lines of several sweeps of one model on the same samples (each with its own full-cache
    lines), as one sweep: the full cache's lines of the first directory only, and a sentence on whether
    the others' full-cache answers are the same (they are recomputed by each sweep)."""
    from kvtrim.eval.report import load_dirs

    first = load_dirs([str(root / rels[0])])
    ref = {(r["task"], r["length"], r["sample"]): r for r in first if r["method"] == "full"}
    lines, same, both = list(first), 0, 0
    for rel in rels[1:]:
        for r in load_dirs([str(root / rel)]):
            if r["method"] != "full":
                lines.append(r)
            elif (k := (r["task"], r["length"], r["sample"])) in ref:
                both += 1
                a, b = float(r["score"]), float(ref[k]["score"])  # a perplexity differs in its last digits (summation order)
                same += r.get("answer") == ref[k].get("answer") and abs(a - b) <= 1e-6 * max(abs(a), abs(b))
    note = (f"Joined sweeps: {', '.join(f'`{r}`' for r in rels)} (the same samples); the full cache's answer and score "
            f"(within a millionth) are the same in {same} of the {both} samples both ran. The sweeps ran at different times on a shared machine: "
            "compare their scores and memory, not their seconds.") if len(rels) > 1 else ""
    return lines, note


def _sweep_tables(root: Path, rel: str | tuple[str, ...], pairs: list[tuple[str, str]]) -> str:
    """``kvtrim report``'s score and memory tables of the sweep in ``rel`` (or several sweeps of one model on
    the same samples, :func:`_joined_sweeps`), multiturn's score per turn, and for each ``(a, b)`` of
    ``pairs`` in how many cells (task x budget) ``a`` scored higher, equal, lower."""
    from kvtrim.eval.report import render, summarize

    lines, note = _joined_sweeps(root, (rel,) if isinstance(rel, str) else rel)
    out = render(summarize(lines), None).rstrip("\n") + (f"\n\n{note}" if note else "")
    turns: dict[tuple, list[list[float]]] = {}
    for r in lines:
        if r["task"] == "multiturn" and r.get("turn_scores"):
            turns.setdefault((r["length"], r["method"], r["keep"]), []).append(r["turn_scores"])
    for n in sorted({k[0] for k in turns}):
        rows = [(m, k, v) for (length, m, k), v in turns.items() if length == n]
        rows.sort(key=lambda x: (x[0] != "full", x[1] or 1.0, x[0]))
        width = max(len(t) for _, _, v in rows for t in v)
        head = " | ".join(f"turn {i + 1}" for i in range(width))
        table = [f"#### multiturn score per turn, {n} tokens", "",
                 f"| method @ keep | samples | {head} |", "|---|---:|" + "---:|" * width]
        for m, k, v in rows:
            means = [sum(t[i] for t in v) / len(v) for i in range(width)]
            table.append(f"| {m}{'' if k is None else f' @{k:g}'} | {len(v)} | " + " | ".join(f"{x:.2f}" for x in means) + " |")
        out += "\n\n" + "\n".join(table)
    cells = summarize(lines)["cells"]
    mean = {(c["task"], c["length"], c["method"], c["keep"]): c["score"] for c in cells if c["prefill"] == "dense"}
    verdict = []
    for a, b in pairs:
        # a perplexity is better lower: compared negated, so "higher" always means "better"
        cmp = [(sign * mean[(t, n, a, k)], sign * mean[(t, n, b, k)]) for (t, n, m, k) in mean
               if m == a and (t, n, b, k) in mean for sign in [(-1 if t == "ppl" else 1)]]
        if cmp:
            won, lost = sum(x > y for x, y in cmp), sum(x < y for x, y in cmp)
            verdict.append(f"- `{a}` against `{b}`, over the {len(cmp)} cells (task x budget) both ran: better in "
                           f"{won}, equal in {len(cmp) - won - lost}, worse in {lost} (perplexity: lower is better).")
    return out + ("\n\n" + "\n".join(verdict) if verdict else "") + "\n"


#: issue 47: kvtrim chat's default at bounded memory. (directory, model, prompt length) of each sweep:
#: multiturn with every method at the same fixed budgets (``method:max_tokens=N``, docs/eval.md)
CHAT_DEFAULT_DIRS = (("benchmarks/results/chat_default/smollm2_2k", "SmolLM2", 2048),
                     ("benchmarks/results/chat_default/smollm2_4k", "SmolLM2", 4096),
                     ("benchmarks/results/chat_default/qwen_4k", "Qwen2.5-Coder", 4096))
CHAT_DEFAULT_BUDGETS = (512, 1024)
CHAT_DEFAULT_REFERENCE = "inf_mllm"  # the default it is judged against


def _fixed_budget(method: str) -> tuple[str, int | None]:
    """``"h2o:max_tokens=512:position=reassigned"`` -> ``("h2o", 512)``: the method as written without its
    fixed budget (``position=reassigned`` too: what ``kvtrim chat`` gives a streaming method), and the budget."""
    from kvtrim.registry import split_method

    name, params = split_method(method)
    budget = params.pop("max_tokens", None)
    if params.get("position") == "reassigned":
        params.pop("position")
    return ":".join([name, *(f"{k}={v}" for k, v in params.items())]), budget


def chat_default(root: Path) -> str:
    """multiturn at fixed budgets (the bounded memory of ``kvtrim chat``) on both models: score per method
    and budget, turn by turn, and which methods score at least as high as inf_mllm in every cell."""
    from kvtrim.eval.report import load_dirs

    cols: list[tuple[str, int, int | None]] = []
    scores: dict[tuple[str, tuple], list[float]] = {}
    turns: dict[tuple[str, tuple], list[list[float]]] = {}
    full: dict[tuple[str, int], list[float]] = {}
    counts: set[int] = set()
    for rel, model, n in CHAT_DEFAULT_DIRS:
        lines = [r for r in load_dirs([str(root / rel)]) if r["task"] == "multiturn" and r["length"] == n]
        for r in lines:
            m, b = _fixed_budget(r["method"])
            key = (model, n, b)
            scores.setdefault((m, key), []).append(r["score"])
            turns.setdefault((m, key), []).append(r["turn_scores"])
            if r["method"] == "full":
                full[(model, n)] = full.get((model, n), []) + [r["score"]]
        cols += [(model, n, b) for b in CHAT_DEFAULT_BUDGETS]
    methods = sorted({m for m, _ in scores if m != "full"}, key=lambda m: (m != CHAT_DEFAULT_REFERENCE, m))
    mean = {k: sum(v) / len(v) for k, v in scores.items()}
    out = ["| method | " + " | ".join(f"{model} {n} @{b}" for model, n, b in cols) + " |",
           "|---|" + "---:|" * len(cols)]
    for m in methods:
        cells = []
        for col in cols:
            v = scores.get((m, col), [])
            counts.add(len(v))
            cells.append(f"{mean[(m, col)]:.3f}" if v else "—")
        out.append(f"| `{m}` | " + " | ".join(cells) + " |")
    out.append("| full cache | " + " | ".join(f"{sum(full[col[:2]]) / len(full[col[:2]]):.3f}" for col in cols) + " |")
    out += ["", f"multiturn (4 facts, one question per turn through one cache compressed at each prompt), mean score; "
            f"samples per cell: {', '.join(map(str, sorted(counts)))}; every method at the same fixed budget "
            "(`method:max_tokens=N`, tokens per layer and KV head), `h2o` with reassigned positions as `kvtrim chat` "
            "runs it.", "", "Per turn (turn 1 is asked in the prompt the cache was compressed at; the later ones are "
            "not):", "", "| method | " + " | ".join(f"{model} {n} @{b}" for model, n, b in cols) + " |",
            "|---|" + "---|" * len(cols)]
    for m in methods:
        cells = []
        for col in cols:
            t = turns.get((m, col))
            cells.append(" / ".join(f"{sum(x[i] for x in t) / len(t):.1f}" for i in range(len(t[0]))) if t else "—")
        out.append(f"| `{m}` | " + " | ".join(cells) + " |")
    # the later turns alone: the questions not asked in the prompt the cache was compressed at
    later = {k: sum(sum(t[1:]) / (len(t) - 1) for t in v) / len(v) for k, v in turns.items()}
    out.append("")
    for what, score in (("score", mean), ("score on turns 2-4 alone", later)):
        ref = [score[(CHAT_DEFAULT_REFERENCE, col)] for col in cols]
        at_least = [m for m in methods if m != CHAT_DEFAULT_REFERENCE
                    and all(score.get((m, col), -1) >= r - 1e-9 for col, r in zip(cols, ref))]
        above = [m for m in at_least if any(score[(m, col)] > r + 1e-9 for col, r in zip(cols, ref))]
        out.append(f"- {what[0].upper() + what[1:]} at least as high as `{CHAT_DEFAULT_REFERENCE}`'s in all {len(cols)} "
                   "cells: " + (", ".join(f"`{m}`" for m in at_least) or "none") + "; of them higher in at least one: "
                   + (", ".join(f"`{m}`" for m in above) or "none") + ".")
    from kvtrim.registry import get_policy_class, split_method

    def ranked(pick) -> str:
        got = {m: [mean[(m, c)] for c in cols if pick(c) and (m, c) in mean] for m in methods}
        avg = {m: sum(v) / len(v) for m, v in got.items() if v and len(v) == sum(1 for c in cols if pick(c))}
        return ", ".join(f"`{m}` {v:.3f}{'' if get_policy_class(split_method(m)[0]).supports_streaming else ' (cannot stream)'}"
                         for m, v in sorted(avg.items(), key=lambda kv: -kv[1]))

    out.append(f"- Mean score over all {len(cols)} cells: {ranked(lambda c: True)}.")
    for model in dict.fromkeys(c[0] for c in cols):
        out.append(f"- Mean over {model}'s cells: {ranked(lambda c, m=model: c[0] == m)}.")
    return "\n".join(out) + "\n"


#: issue 47: snapkv's span-keeping variants on the sweep's tasks, embedded and reference model
SPANS_DIRS = {"spans_sweep": "benchmarks/results/spans/eval_smollm2_2048",
              "spans_sweep_qwen": "benchmarks/results/spans/eval_qwen_4096"}
SPANS_VARIANTS = ("snapkv:chunk=8", "snapkv:kernel=11", "snapkv:chunk=8:kernel=11")


def _spans(key: str) -> Callable[[Path], str]:
    def gen(root: Path) -> str:
        """snapkv's span variants against snapkv on the sweep's tasks (``kvtrim report``'s tables)."""
        return _sweep_tables(root, SPANS_DIRS[key], [(v, "snapkv") for v in SPANS_VARIANTS])
    return gen


#: issue 47: tova on the reference model's sweep at 4k, against the methods of that sweep (same samples)
TOVA_DIRS = ("benchmarks/results/eval_qwen", "benchmarks/results/eval_tova")


def tova_qwen(root: Path) -> str:
    """tova against snapkv, inf_mllm and h2o on the reference model's 4k sweep (``kvtrim report``'s tables)."""
    return _sweep_tables(root, TOVA_DIRS, [("tova", "snapkv"), ("tova", "inf_mllm"), ("tova", "h2o")])


#: issue 47's 16k targets: tova at keep 0.25 on multiturn and niah_single, joined with the 16k sweep
TOVA16K_DIRS = ("benchmarks/results/eval_qwen16k", "benchmarks/results/eval_tova16k")


def tova_qwen16k(root: Path) -> str:
    """The 16k sweep's tables joined with tova's cells (keep 0.25, multiturn and niah_single)."""
    return _sweep_tables(root, TOVA16K_DIRS, [("tova", "snapkv"), ("tova", "inf_mllm")])


#: issue 47's 16k multi-turn target with kvzip: the 16k sweep, tova's cells and kvzip's (keep 0.25, bfloat16, the
#: same samples; eval_kvzip16k's full-cache lines are eval_tova16k's, copied, since kvtrim eval runs the full cache once)
KVZIP16K_DIRS = ("benchmarks/results/eval_qwen16k", "benchmarks/results/eval_tova16k", "benchmarks/results/eval_kvzip16k")


def kvzip_qwen16k(root: Path) -> str:
    """The 16k sweep's tables joined with tova's and kvzip's cells (keep 0.25)."""
    return _sweep_tables(root, KVZIP16K_DIRS, [("kvzip", "tova"), ("kvzip", "snapkv")])


GENERATORS: dict[str, Callable[[Path], str]] = {"bench_cli": bench_cli, "guide": guide, "vllm": vllm, "eval_summary": eval_summary,
                                                "eval_qwen": eval_qwen, "headline": headline, "agnostic": agnostic,
                                                "perhead": perhead, "chat_default": chat_default, "tova_qwen": tova_qwen,
                                                "tova_qwen16k": tova_qwen16k, "budgets_qwen": budgets_qwen,
                                                "tova_qwen16k_variants": tova_qwen16k_variants, "kvzip_qwen": kvzip_qwen,
                                                "kvzip_qwen16k": kvzip_qwen16k,
                                                **{k: _spans(k) for k in SPANS_DIRS}}


# ----------------------------------------------------------------------------- the eval report
def eval_report_expected(root: Path) -> str:
    from kvtrim.eval.report import load_dirs, render, summarize

    return render(summarize(load_dirs([str(root / EVAL_DIR)])), RESULTS_IMAGES)


def _qwen_dirs(root: Path) -> list[str]:
    """The reference model's sweep directories present under ``root`` (relative, in EVAL_QWEN_DIRS order)."""
    return [rel for rel in EVAL_QWEN_DIRS if (root / rel).is_dir()]


def eval_qwen_report_expected(root: Path) -> str:
    from kvtrim.eval.report import load_dirs, render, summarize

    return render(summarize(load_dirs([str(root / rel) for rel in _qwen_dirs(root)])), ".")


def write_eval_report(root: Path) -> None:
    from kvtrim.eval.report import write_report

    write_report([str(root / EVAL_DIR)], out_dir=str(root / "docs" / "eval"), readme=str(root / RESULTS),
                 image_prefix=RESULTS_IMAGES, source_label=EVAL_DIR)
    if qwen := _qwen_dirs(root):
        write_report([str(root / rel) for rel in qwen], out_dir=str(root / "docs" / "eval_qwen"),
                     source_label=" and ".join(qwen))


def stale(root: Path) -> list[str]:
    """Each generated block (file: command) whose text differs from what its command prints now."""
    from kvtrim.eval.report import END, START

    out = []
    for p in doc_files(root):
        text = read_text(p, "doc")
        for m in BLOCK.finditer(text):
            if produce(root, m.group("cmd")).rstrip("\n") != m.group("body").rstrip("\n"):
                out.append(f"{p.relative_to(root)}: {m.group('cmd')}")
    results = root / RESULTS
    text = read_text(results, "doc") if results.is_file() else ""
    if START not in text or END not in text:
        out.append(f"{RESULTS}: no {START} ... {END} block (kvtrim report {EVAL_DIR})")
    elif text.split(START, 1)[1].split(END, 1)[0].strip() != eval_report_expected(root).strip():
        out.append(f"{RESULTS}: kvtrim report {EVAL_DIR}")
    qwen_report = root / "docs" / "eval_qwen" / "report.md"
    if _qwen_dirs(root) and (not qwen_report.is_file()
                             or read_text(qwen_report, "doc").split(".\n\n", 1)[-1] != eval_qwen_report_expected(root)):
        out.append(f"docs/eval_qwen/report.md: kvtrim report {' '.join(EVAL_QWEN_DIRS)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtrim.tools.docs_tables", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true", help="list stale blocks; exit 1 if any")
    g.add_argument("--write", action="store_true", help=f"rewrite every generated block, the eval block of {RESULTS} and docs/eval/")
    ap.add_argument("--root", default=".", help="the repository root (default: the current directory)")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    if not (root / "README.md").is_file() or not (root / "benchmarks").is_dir():
        ap.error(f"{root} is not the kvtrim repository root (no README.md and benchmarks/)")
    if args.check:
        bad = stale(root)
        for b in bad:
            print(f"stale: {b}")
        return 1 if bad else 0
    for p in doc_files(root):
        text = read_text(p, "doc")
        new = regenerate(root, text)
        if new != text:
            write_atomic(p, new)
            print(f"rewrote {p.relative_to(root)}")
    write_eval_report(root)
    print(f"rewrote the eval block of {RESULTS} and docs/eval/ (report.md, plots)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
