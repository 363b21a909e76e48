"""Admission in a small vLLM KV pool: N concurrent long prompts, kvtrim's plugin off vs on.

    benchmarks/.venv-vllm/bin/python benchmarks/vllm_admission.py \
        --n 10 --length 2000 --new 64 --pool-blocks 48 --out benchmarks/results/vllm/admission.json
    python benchmarks/vllm_admission.py --table benchmarks/results/vllm/admission.json

Runs in vLLM's venv (``scripts/setup_vllm.sh``: kvtrim installed from this checkout); ``--table``
reads the JSON only (any venv with kvtrim). The command line, the ``--out`` check (before anything
runs; an existing file is refused unless ``--force``), the machine record and the JSON output are
``kvtrim.harness``'s.
SmolLM2-135M (kvtrim's converted directory), float32, one thread per process, a KV pool of
``--pool-blocks`` blocks set through vLLM's ``kv_cache_memory_bytes`` (blocks x the model's bytes
per block; ``VLLM_CPU_KVCACHE_SPACE``, which would override it, is unset). ``--n`` prompts of
``--length`` token ids (distinct, deterministic) are added at once and driven with
``LLMEngine.step()``, greedy, ``--new`` tokens each, no EOS stop; chunked prefill with
``max_num_batched_tokens`` = ``--length``, ``max_num_seqs`` = ``--n`` (the pool, not a request
cap, limits admission).

Configurations, each in a fresh process, one after another: vLLM as is (plugin not configured),
the plugin with each method of ``--methods`` (default: every text method) at ``--keep`` (kvtrim's
scheduler, prefix caching off in all). After every engine step the script reads vLLM's own gauges
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``) and
its preemption counter (``vllm:num_preemptions``), and timestamps each request's first and last
token. Reported: the most requests running at once, their mean over the steps (and over time),
preemptions, wall seconds from the first ``add_request`` to the last token, generated tokens per
second, and time to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvtrim import harness

SCHEDULER = "kvtrim.integrations.vllm.scheduler.KVTrimScheduler"
TAG = "@@ADMISSION "


def prompts(n: int, length: int) -> list[list[int]]:
    return [[1000 + (i * 7919 + j * 104729) % 30000 for j in range(length)] for i in range(n)]



# ------------------------------------------------------------------------ one configuration (vLLM venv)
def one(spec: dict) -> dict:
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    import torch
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(1)
    hf = AutoConfig.from_pretrained(spec["model_dir"])
    kv_heads = getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    block_bytes = 2 * hf.num_hidden_layers * kv_heads * head_dim * 128 * 4  # float32, 128-token blocks
    engine = {"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False, "seed": 0,
              "disable_log_stats": False, "max_model_len": spec["length"] + spec["new"] + 128,
              "max_num_batched_tokens": spec["length"], "max_num_seqs": spec["n"],
              "kv_cache_memory_bytes": spec["pool_blocks"] * block_bytes}
    if spec["kvtrim"] is not None:
        engine["scheduler_cls"] = SCHEDULER
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], additional_config={"kvtrim": spec["kvtrim"]} if spec["kvtrim"] else {}, **engine)
    load_s = time.perf_counter() - t0
    eng = llm.llm_engine
    cc = eng.vllm_config.cache_config
    sp = SamplingParams(max_tokens=spec["new"], temperature=0.0, ignore_eos=True)
    ps = prompts(spec["n"], spec["length"])
    load0 = os.getloadavg()
    w0 = time.perf_counter()
    for i, ids in enumerate(ps):
        eng.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids), sp)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    n_out: dict[str, int] = {}
    steps = []
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter() - w0
        for o in outs:
            k = len(o.outputs[0].token_ids)
            if k and o.request_id not in first:
                first[o.request_id] = now
            if k:
                last[o.request_id] = now
            n_out[o.request_id] = k
        g = {}
        for m in llm.get_metrics():
            if m.name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                          "vllm:num_preemptions"):
                g[m.name.split(":")[1]] = getattr(m, "value", None)
        steps.append({"t": round(now, 3), **g})
    wall = time.perf_counter() - w0
    load1 = os.getloadavg()
    running = [s.get("num_requests_running") or 0 for s in steps]
    # time-weighted mean of the running count (each step's count holds until the next step ends)
    tw = sum(r * (b["t"] - a["t"]) for r, a, b in zip(running[1:], steps, steps[1:])) / max(1e-9, steps[-1]["t"] - steps[0]["t"])
    gen = sum(n_out.values())
    return {
        "kvtrim": spec["kvtrim"], "load_seconds": round(load_s, 1), "num_blocks": cc.num_gpu_blocks,
        "block_size": cc.block_size, "block_bytes": block_bytes, "kv_cache_memory_bytes": cc.kv_cache_memory_bytes,
        "wall_seconds": round(wall, 2), "generated_tokens": gen, "generated_tokens_per_s": round(gen / wall, 2),
        "total_tokens_per_s": round((gen + spec["n"] * spec["length"]) / wall, 2),
        "max_running": max(running), "mean_running_per_step": round(statistics.mean(running), 2),
        "mean_running_over_time": round(tw, 2), "preemptions": int(steps[-1].get("num_preemptions") or 0),
        "max_kv_usage": max((s.get("kv_cache_usage_perc") or 0) for s in steps), "steps": len(steps),
        "ttft_seconds": {"median": round(statistics.median(first.values()), 2), "max": round(max(first.values()), 2)},
        "finish_seconds": {"median": round(statistics.median(last.values()), 2)},
        "loadavg_before": list(load0), "loadavg_after": list(load1), "trace": steps,
    }


# ------------------------------------------------------------------------------------------ driver
def measure(args) -> dict:
    import vllm

    from kvtrim.models import embedded_model_dir

    model_dir = args.model_dir or str(embedded_model_dir())
    configs = [("vLLM (plugin off)", None), *((f"plugin {m} keep={args.keep}", {"method": m, "keep": args.keep})
                                               for m in args.methods.split(","))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = []
    load0 = os.getloadavg()
    for name, kv in configs:
        spec = {"model_dir": model_dir, "n": args.n, "length": args.length, "new": args.new,
                "pool_blocks": args.pool_blocks, "kvtrim": kv}
        p = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True, env=env)
        line = next((x for x in p.stdout.splitlines() if x.startswith(TAG)), None)
        if line is None:
            raise SystemExit(f"{name} failed:\n{(p.stdout + p.stderr)[-4000:]}")
        r = json.loads(line[len(TAG):])
        runs.append({"config": name, **r})
        print(f"{name}: max running {r['max_running']}, preemptions {r['preemptions']}, wall {r['wall_seconds']} s", flush=True)
    return {
        "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "vllm": vllm.__version__, "model": Path(model_dir).name, "threads": 1, "n": args.n, "length": args.length,
        "new_tokens": args.new, "pool_blocks": args.pool_blocks, "keep": args.keep,
        "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg()), "runs": runs,
    }


def table(d: dict) -> str:
    out = ["| configuration | KV pool (blocks) | most running at once | mean running (over time) | preemptions | "
           "wall s | generated tok/s | TTFT median / max s |",
           "|---|---|---|---|---|---|---|---|"]
    base = d["runs"][0]
    for r in d["runs"]:
        ratio = "" if r is base else f" ({r['max_running'] / base['max_running']:.1f}x)"
        out.append(f"| {r['config']} | {r['num_blocks']} | {r['max_running']:.0f}{ratio} | {r['mean_running_over_time']:.1f} | "
                   f"{r['preemptions']} | {r['wall_seconds']:.0f} | {r['generated_tokens_per_s']:.1f} | "
                   f"{r['ttft_seconds']['median']:.0f} / {r['ttft_seconds']['max']:.0f} |")
    la = [x for r in d["runs"] for x in (r["loadavg_before"][0], r["loadavg_after"][0])]
    per_req = -(-(d["length"] + d["new_tokens"]) // base["block_size"])
    out.append("")
    out.append(f"{d['model']} float32, vLLM {d['vllm']} CPU build, one thread per process; {d['n']} requests of "
               f"{d['length']} prompt tokens + {d['new_tokens']} generated, all added at once; KV pool "
               f"{d['pool_blocks']} blocks of {base['block_size']} tokens (one uncompressed request needs {per_req}); "
               f"counts from vLLM's own gauges after every engine step. Timed on the shared 2-core machine "
               f"(load average {min(la):.1f}-{max(la):.1f}): the seconds are under load.")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--pool-blocks", type=int, default=48)
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--methods", default="snapkv,streaming_llm,h2o,inf_mllm,elastic",
                    help="the plugin's methods to run, comma-separated (default: every text method)")
    args = ap.parse_args(argv)
    if args.one:  # one configuration, in a process of its own
        r = one(json.loads(args.one))
        sys.stdout.write(TAG + json.dumps(r) + "\n")
        sys.stdout.flush()
        return 0
    if harness.start(ap, args, table=table):
        return 0
    machine = harness.machine_record()
    result = measure(args)
    harness.publish(args.out, result, machine, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
