"""Every text method inside vLLM against the same method on transformers, on needle prompts.

    benchmarks/.venv-vllm/bin/python benchmarks/vllm_methods.py --model smollm2 --lengths 2048,8192 \
        --samples 6 --keep 0.25 --prefill dense,minference --tp 1 --out benchmarks/results/vllm/methods_smollm2.json
    python benchmarks/vllm_methods.py --table benchmarks/results/vllm/methods_smollm2.json

Runs in vLLM's venv (``scripts/setup_vllm.sh``; it has transformers too); ``--table`` reads the JSON
only (any venv). Float32, greedy, ``--new`` tokens per prompt, no EOS stop. Prompts: ``--samples``
``niah_single`` samples (kvtrim's RULER-style single needle) per length, in the model's chat template.

For each prefill mode, method and tensor-parallel size, a fresh process runs vLLM with kvtrim's plugin
(``additional_config={"kvtrim": {"method": M, "keep": K, "prefill": ...}}``, kvtrim's scheduler,
prefix caching off), its engine core in the same process so that its scheduler's record of every
request's steps and freed blocks can be read; at tensor parallel 1 its worker runs there too, and the
tokens each layer and KV head keeps are read from the plugin's storage after every step. One request
at a time, each prompt in one prefill step (``max_num_batched_tokens`` above the longest prompt).

The reference is kvtrim on transformers with the same policy, its evictions rounded to vLLM's block
size (``KVTrimCache(block_size=...)``: the cache then keeps what the plugin's plan keeps), the prompt
recorded once per prefill mode and replayed for each method (``kvtrim.eval.replay``), then decoded
greedily. Reported per (method, prefill, tensor parallel): prompts whose tokens equal the reference's,
the mean share of equal tokens up to the first difference and the earliest first difference, the
share of (layer, KV head) kept sets equal to the reference's (tensor parallel 1), KV blocks freed per
request, needles answered by each engine, and vLLM's decode step time (median engine step after the
prefill; what a method's per-step hook costs inside vLLM, against the ``full`` row, on a machine
shared with whatever else ran: the load is in the first line). vLLM's own dense run (plugin not configured) is
compared with transformers' full cache the same way, to show how far the two engines' arithmetic
alone takes them apart.

``--kv-cache-dtype auto,fp8`` runs every configuration at each of vLLM's own KV cache kinds (its
``kv_cache_dtype``; the CPU build offers ``fp8``, ``fp8_e4m3`` and ``fp8_e5m2`` besides ``auto``). The
reference stays kvtrim on transformers in float32 (it has no fp8 cache of vLLM's kind); each row is also
compared with vLLM alone at the same kind (the ``full`` row, plugin not configured), and reports vLLM's KV
bytes per token (from its KV cache spec) and the KV a request holds at its end (blocks held after the ones
kvtrim's scheduler freed, times the bytes of a block).

Each finished engine run and the reference are kept in a folder beside ``--out``
(``NAME.work-<settings hash>/``): rerunning the same command after an interruption resumes there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvtrim import harness

SCHEDULER = "kvtrim.integrations.vllm.scheduler.KVTrimScheduler"


# ------------------------------------------------------------------------ one configuration (vLLM venv)
def child(spec: dict) -> dict:
    """One vLLM engine run: every prompt, one after another; per request its tokens, steps, freed
    blocks and (tensor parallel 1) the kept stream indices per layer and KV head at its end."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and at tp 1 the worker) in this process
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(spec["threads"])
    engine = {"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False, "seed": 0,
              "max_model_len": spec["max_len"], "max_num_batched_tokens": spec["max_len"], "max_num_seqs": 1,
              "tensor_parallel_size": spec["tp"]}
    if spec.get("kv_cache_dtype", "auto") != "auto":
        engine["kv_cache_dtype"] = spec["kv_cache_dtype"]
    kv = spec["kvtrim"]
    if kv and kv.get("method"):
        engine["scheduler_cls"] = SCHEDULER
    llm = LLM(model=spec["model_dir"], additional_config={"kvtrim": kv} if kv else {}, **engine)
    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    sched = core.scheduler
    bs = eng.vllm_config.cache_config.block_size
    # bytes of one block over every layer (this rank's KV heads), from vLLM's own KV cache spec
    block_bytes = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in sched.kv_cache_config.kv_cache_groups)
    worker_state = None
    if spec["tp"] == 1 and kv and kv.get("method"):
        from kvtrim.integrations.vllm.backend import PROCESS

        worker_state = PROCESS
    sp = SamplingParams(max_tokens=spec["new"], temperature=0.0, ignore_eos=True)
    out: dict[str, dict] = {}
    for i, ids in enumerate(spec["prompts"]):
        rid = f"r{i}"
        eng.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
        rec: dict = {"tokens": [], "steps": [], "kept": None}
        internal, first_block = None, None
        step_seconds = []
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = eng.step()
            step_seconds.append(time.perf_counter() - t0)
            for o in outs:
                rec["tokens"] = list(o.outputs[0].token_ids)
            rec["step_seconds"] = step_seconds  # the first step prefills, the others decode one token each
            if internal is None:  # vLLM appends a suffix of its own to a request id
                internal = next((r for r in sched.requests if r == rid or r.startswith(rid + "-")), None)
            mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
            if internal is not None and worker_state is not None and first_block is None and mgr.req_to_blocks.get(internal):
                first_block = mgr.req_to_blocks[internal][0].block_id  # once it holds blocks
            steps = getattr(sched, "kvtrim_steps", {}).get(internal) if internal else None
            if steps is not None:  # kept until the scheduler's next step, also for a finished request
                rec["steps"] = [list(s) for s in steps]
            if worker_state is not None and first_block is not None:
                st = worker_state.requests.get(first_block)
                if st is not None:
                    kept = {}
                    for li, layer in st.layers.items():
                        pos = layer.positions
                        if layer.pending is not None:
                            pos = torch.gather(pos, 2, layer.pending.idx)
                        kept[str(li)] = pos[0].tolist()
                    rec["kept"] = kept
        out[rid] = rec
    return {"block_size": bs, "block_bytes": block_bytes, "num_blocks": eng.vllm_config.cache_config.num_gpu_blocks,
            "requests": [out[f"r{i}"] for i in range(len(spec["prompts"]))]}


# --------------------------------------------------------------------------------- the reference
def reference(model_dir: str, prompts: list[list[int]], configs: list[dict], new: int, block_size: int) -> dict:
    """kvtrim on transformers: per prefill mode, each prompt recorded once and replayed per method."""
    import torch

    from kvtrim import decoding, load_model
    from kvtrim.eval.replay import make_policy, record_prefill, replay
    from kvtrim.integrations.hf import attach
    from kvtrim.integrations.prefill import make_prefill

    lm = load_model(model_dir, dtype="float32")
    model = lm.model
    out: dict[str, list] = {}
    for prefill in sorted({c["prefill"] for c in configs}):
        hook = None if prefill == "dense" else make_prefill(model, prefill)
        for pi, ids in enumerate(prompts):
            rec = record_prefill(model, ids, prefill=hook)
            for c in [c for c in configs if c["prefill"] == prefill]:
                key = f"{c['method']}|{prefill}"
                params = {} if c["method"] == "full" else {"keep": c["keep"]}
                policy = make_policy(c["method"], {"position": "true", **params})
                with torch.inference_mode(), attach(model):
                    cache = replay(model, policy, rec, block_size=block_size)
                    tokens, _ = decoding.run(model, decoding.decode(cache, rec.logits, new))
                kept = {str(layer.layer_idx): layer.positions[0].tolist() for layer in cache.compressed_layers}
                out.setdefault(key, []).append({"tokens": tokens, "kept": kept})
                print(f"reference {key} prompt {pi}: {len(ids)} tokens", file=sys.stderr, flush=True)
    return out


def compare(a: list[int], b: list[int]) -> tuple[float, int | None]:
    """Share of equal tokens up to the first difference, and its index (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i / max(len(a), 1), i
    return 1.0, None


def kept_equal(vllm: dict | None, ref: dict) -> float | None:
    """Share of (layer, KV head) kept sets the two engines hold alike."""
    if vllm is None:
        return None
    same = total = 0
    for li, heads in ref.items():
        got = vllm.get(str(li))
        for h, pos in enumerate(heads):
            total += 1
            same += got is not None and sorted(got[h]) == sorted(pos)
    return same / total if total else None


def kept_overlap(vllm: dict | None, ref: dict) -> float | None:
    """Mean share of a (layer, KV head) kept set that the reference keeps too (1.0: the same sets)."""
    if vllm is None:
        return None
    shares = []
    for li, heads in ref.items():
        got = vllm.get(str(li))
        for h, pos in enumerate(heads):
            mine = set(got[h]) if got is not None else set()
            shares.append(len(mine & set(pos)) / max(len(mine), 1))
    return statistics.mean(shares) if shares else None


# ----------------------------------------------------------------------------------------- table
def table(result: dict) -> str:
    rec = result["machine"]
    kinds = "kv_cache_dtypes" in result  # a result with vLLM's KV cache kinds (older ones ran float32 caches only)
    lines = [harness.machine_line(rec, result["threads"]),
             "",
             f"{result['model']}, float32, keep {result['keep']}, {result['new']} new tokens, prompts: "
             f"{result['samples']} niah_single per length at {', '.join(map(str, result['lengths']))} tokens; "
             f"vLLM block size {result['block_size']}",
             ""]
    head = ["method", "prefill", "TP"] + (["KV cache dtype"] if kinds else []) + [
        "prompts equal", "agreement (mean)", "first difference (earliest)", "kept sets equal"] + (
        ["kept overlap"] if kinds else []) + ["blocks freed / request"]
    head += ["same as vLLM alone", "KV bytes / token", "KV MiB / request at end"] if kinds else []
    head += ["needles vLLM", "needles transformers", "vLLM decode ms/step"]
    lines += ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in result["rows"]:
        first = "-" if r["first_difference"] is None else str(r["first_difference"])
        kept = "-" if r["kept_equal"] is None else f"{100 * r['kept_equal']:.1f}%"
        cells = [r["method"], r["prefill"], str(r["tp"])] + ([r["kv_cache_dtype"]] if kinds else []) + [
            f"{r['equal']}/{r['n']}", f"{r['agreement']:.3f}", first, kept] + (
            ["-" if r["kept_overlap"] is None else f"{100 * r['kept_overlap']:.1f}%"] if kinds else []) + [
            f"{r['blocks_freed']:.1f}"]
        if kinds:
            alone = "-" if r["method"] == "full" else (
                f"{r['equal_alone']}/{r['n']}" + ("" if r["first_difference_alone"] is None
                                                  else f" (from token {r['first_difference_alone']})"))
            cells += [alone, f"{r['kv_bytes_per_token']:.0f}", f"{r['resident_kv_mib']:.2f}"]
        cells += [f"{r['needles_vllm']}/{r['n']}", f"{r['needles_ref']}/{r['n']}",
                  "-" if r.get("decode_ms") is None else format(r["decode_ms"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["",
              "Prompts equal: requests whose greedy tokens are the same in both engines; agreement: the share of "
              "tokens before the first difference. Kept sets equal: the share of (layer, KV head) pairs whose kept "
              "positions at the end are the same in both engines (`-`: nothing is evicted). Blocks freed: vLLM blocks "
              "the scheduler returned per request. A needle counts when the answer appears within the "
              f"{result['new']} new tokens, so it measures the budget of new tokens as much as the cache: a model that "
              "first restates the question has no room left for the answer. Decode ms/step: the median engine step "
              "after the first (`-`: the run predates its recording)."]
    if kinds:
        lines[-1] += (" The transformers reference is float32 at every KV cache dtype. Kept overlap: the mean share of a "
                      "kept set (layer, KV head) that the reference keeps too. Same as vLLM alone: requests "
                      "whose tokens equal vLLM's own run (plugin not configured) at the same KV cache dtype, with the "
                      "earliest first difference. KV bytes / token: vLLM's KV cache spec, all layers of the rank. "
                      "KV MiB / request at end: the blocks a request holds after its last step (those freed by kvtrim's "
                      "scheduler taken away) times the bytes of a block, mean over requests.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2", help="a reference model's short name or a model directory")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--methods", default="snapkv,streaming_llm,h2o,inf_mllm,elastic")
    ap.add_argument("--prefill", default="dense,minference")
    ap.add_argument("--tp", default="1")
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="vLLM's KV cache kinds to run, comma-separated (auto, fp8, fp8_e4m3, fp8_e5m2 on the CPU build)")
    args = ap.parse_args(argv)
    if args.child:
        harness.child_result(child(json.loads(Path(args.child).read_text())))
        return 0
    if harness.start(ap, args, table=table):
        return 0
    from transformers import AutoTokenizer

    from kvtrim.eval.programs import prompt_ids
    from kvtrim.eval.tasks import make_samples
    from kvtrim.models import resolve_model

    model_dir = str(resolve_model(args.model)[0])
    tok = AutoTokenizer.from_pretrained(model_dir)
    lengths = [int(x) for x in args.lengths.split(",")]
    samples = [s for n in lengths for s in make_samples("niah_single", tok, n, args.samples, seed=0)]
    prompts = [prompt_ids(tok, s) for s in samples]
    max_len = max(map(len, prompts)) + args.new + 16
    methods = args.methods.split(",")
    prefills = args.prefill.split(",")
    tps = [int(x) for x in args.tp.split(",")]
    kinds = args.kv_cache_dtype.split(",")

    def run_key(method: str, prefill: str, tp: int, kind: str) -> str:
        return f"{method}|{prefill}|{tp}" + ("" if kind == "auto" else f"|{kind}")  # earlier runs keep their names
    record = harness.machine_record()
    runs: dict[str, dict] = {}
    configs = [{"method": "full", "prefill": p, "keep": None} for p in prefills] + \
        [{"method": m, "prefill": p, "keep": args.keep} for p in prefills for m in methods]
    # every finished engine run and the reference are kept in a work folder beside --out, so an
    # interrupted run resumes where it stopped (with the same settings: they name the folder)
    settings = {"model_dir": model_dir, "prompts": prompts, "new": args.new, "keep": args.keep}
    tag = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    work = Path(args.out).with_name(Path(args.out).stem + f".work-{tag}")
    work.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for c in configs:
            for tp, kind in [(tp, kind) for kind in kinds for tp in tps]:
                key = run_key(c["method"], c["prefill"], tp, kind)
                done = work / (key.replace("|", "_") + ".json")
                if done.exists():
                    runs[key] = json.loads(done.read_text())
                    continue
                kv: dict = {} if c["method"] == "full" else {"method": c["method"], "keep": c["keep"]}
                if c["prefill"] != "dense":
                    kv["prefill"] = c["prefill"]
                spec = {"model_dir": model_dir, "prompts": prompts, "new": args.new, "max_len": max_len, "tp": tp,
                        "threads": max(1, args.threads // tp), "kvtrim": kv or None, "kv_cache_dtype": kind}
                path = Path(tmp) / "spec.json"
                path.write_text(json.dumps(spec))
                print(f"vLLM {key}", file=sys.stderr, flush=True)
                runs[key] = harness.isolated(__file__, ["--child", str(path)])
                harness.write_json(done, runs[key])
    block_size = next(iter(runs.values()))["block_size"]
    ref_file = work / "reference.json"
    ref = json.loads(ref_file.read_text()) if ref_file.exists() else None
    if ref is None or any(f"{c['method']}|{c['prefill']}" not in ref for c in configs):
        ref = reference(model_dir, prompts, configs, args.new, block_size)
        harness.write_json(ref_file, ref)
    from kvtrim.eval.metrics import score

    rows = []
    for c in configs:
        for tp, kind in [(tp, kind) for kind in kinds for tp in tps]:
            this = runs[run_key(c["method"], c["prefill"], tp, kind)]
            got = this["requests"]
            want = ref[f"{c['method']}|{c['prefill']}"]
            cmp = [compare(g["tokens"], w["tokens"]) for g, w in zip(got, want)]
            firsts = [f for _, f in cmp if f is not None]
            kept = [kept_equal(g["kept"], w["kept"]) for g, w in zip(got, want)]
            kept_known = [k for k in kept if k is not None]
            alone = runs[run_key("full", c["prefill"], tp, kind)]["requests"]  # vLLM alone at the same kind
            cmp_alone = [compare(g["tokens"], a["tokens"]) for g, a in zip(got, alone)]
            firsts_alone = [f for _, f in cmp_alone if f is not None]
            held = [-(-(len(ids) + args.new - 1) // block_size) - sum(st[2] for st in g["steps"])
                    for ids, g in zip(prompts, got)]  # blocks held after the last step (its last token is not cached)
            overlaps = [kept_overlap(g["kept"], w["kept"]) for g, w in zip(got, want)]
            overlaps_known = [o for o in overlaps if o is not None]
            kind_fields = {} if "block_bytes" not in this else {
                "kv_cache_dtype": kind, "equal_alone": sum(f is None for _, f in cmp_alone),
                "kept_overlap": statistics.mean(overlaps_known) if overlaps_known else None,
                "first_difference_alone": min(firsts_alone) if firsts_alone else None,
                "kv_bytes_per_token": this["block_bytes"] / block_size, "num_blocks": this["num_blocks"],
                "resident_kv_mib": statistics.mean(held) * this["block_bytes"] / 2 ** 20}
            rows.append({
                "method": c["method"], "prefill": c["prefill"], "tp": tp, "n": len(got), **kind_fields,
                "equal": sum(f is None for _, f in cmp), "agreement": statistics.mean(a for a, _ in cmp),
                "first_difference": min(firsts) if firsts else None,
                "kept_equal": statistics.mean(kept_known) if kept_known else None,
                "blocks_freed": statistics.mean(sum(s[2] for s in g["steps"]) for g in got),
                "decode_ms": (1000 * statistics.median(statistics.median(g["step_seconds"][1:]) for g in got)
                              if all(len(g.get("step_seconds", [])) > 1 for g in got) else None),
                "needles_vllm": sum(score(s, tok.decode(g["tokens"], skip_special_tokens=True)) >= 1.0
                                    for s, g in zip(samples, got)),
                "needles_ref": sum(score(s, tok.decode(w["tokens"], skip_special_tokens=True)) >= 1.0
                                   for s, w in zip(samples, want)),
                "per_prompt": [{"tokens_vllm": g["tokens"], "tokens_ref": w["tokens"], "first_difference": f,
                                "kept_equal": k, "steps": g["steps"]} for g, w, (_, f), k in zip(got, want, cmp, kept)],
            })
    result = {"model": Path(model_dir).name, "keep": args.keep, "new": args.new, "samples": args.samples,
              "lengths": lengths, "block_size": block_size, "threads": args.threads,
              "prompt_tokens": [len(p) for p in prompts], "rows": rows}
    if kinds != ["auto"]:
        result["kv_cache_dtypes"] = kinds
    harness.publish(args.out, result, record, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
