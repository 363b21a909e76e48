"""Prefill time of one long prompt in vLLM: kvtrim's MInference backend vs vLLM's own ``CPU_ATTN``.

    benchmarks/.venv-vllm/bin/python benchmarks/vllm_prefill.py --lengths 8192 16384 --reps 3 \
        --out benchmarks/results/vllm/prefill.json
    python benchmarks/vllm_prefill.py --table benchmarks/results/vllm/prefill.json

Runs in vLLM's venv (``scripts/setup_vllm.sh``: kvtrim installed from this checkout); ``--table``
reads the JSON only (any venv with kvtrim; several files make one table). The command line, the
``--out`` check (before anything runs; an existing file is refused unless ``--force``), the round
order, the machine record and the JSON output are ``kvtrim.harness``'s.
Two engines, each a long-lived process of its own with the same settings (float32,
``enforce_eager``, prefix caching off, one thread, ``VLLM_CPU_OMP_THREADS_BIND=nobind``,
``max_num_batched_tokens`` = ``max_model_len`` so the prompt is prefilled in one step, one request
at a time), differing only in ``additional_config``: none (vLLM's ``CPU_ATTN``; the plugin is
installed but not configured) or ``{"kvtrim": {"prefill": "minference"}}`` (the per-head pattern
config kvtrim ships for the model, sliced per rank; dense below 4096 tokens). The model
defaults to SmolLM2-135M (kvtrim's converted directory; its 8k context is stretched to 16k with
``VLLM_ALLOW_LONG_MAX_MODEL_LEN``, which matters for quality, not for time); ``--model qwen2.5-0.5b``
runs the reference model.

Prompts: ``kvtrim.eval.make_samples("passkey", tok, L, n=reps+1, seed=0)`` through
``build_prompt_ids`` (round ``r`` uses sample ``r``; both engines get the same ids). One warm-up
round, then ``--reps`` rounds; within a round the engines run one after the other, the order
alternating between rounds. Timed on the front end: ``add_request`` -> the first token
(``max_tokens=1``), which is the prefill step plus one sampling. Medians; ``os.getloadavg()``
around every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtrim import harness

TAG = "@@PREFILL "


# ----------------------------------------------------------------------------- engine process (vLLM venv)
def _emit(obj) -> None:
    sys.__stdout__.write(TAG + json.dumps(obj) + "\n")
    sys.__stdout__.flush()


def worker(spec: dict) -> None:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype="float32", enforce_eager=True, enable_prefix_caching=False, seed=0,
              max_model_len=spec["max_len"], max_num_batched_tokens=spec["max_len"], max_num_seqs=1,
              additional_config=spec["additional_config"])
    eng = llm.llm_engine
    _emit({"ready": {"load_seconds": time.perf_counter() - t0,
                     "num_blocks": eng.vllm_config.cache_config.num_gpu_blocks}})
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for n, line in enumerate(sys.stdin):
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        load0 = os.getloadavg()
        cpu0 = time.process_time()
        w0 = time.perf_counter()
        eng.add_request(f"p{n}", TokensPrompt(prompt_token_ids=cmd["ids"]), sp)
        token = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.outputs[0].token_ids:
                    token = o.outputs[0].token_ids[0]
        _emit({"seconds": time.perf_counter() - w0, "front_end_cpu_seconds": time.process_time() - cpu0,
               "token": token, "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg())})



# ------------------------------------------------------------------------------------------ driver
class Engine:
    def __init__(self, name: str, spec: dict, log: Path):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_gib", 2)))
        self.name = name
        self.log = log
        self.fh = log.open("w")
        self.p = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.fh, text=True, env=env)
        self.info = self._read()["ready"]

    def _read(self) -> dict:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
            self.fh.write(line)  # vLLM's workers log to stdout
        raise SystemExit(f"{self.name} died:\n{self.log.read_text()[-4000:]}")

    def prefill(self, ids: list[int]) -> dict:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"ids": ids}) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> str:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.p.stdin.flush()
        try:
            rest, _ = self.p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rest, _ = self.p.communicate()
        self.fh.write(rest or "")
        self.fh.close()
        return self.log.read_text()


def measure(args) -> dict:
    import torch
    import vllm
    from transformers import AutoTokenizer

    from kvtrim.eval import make_samples
    from kvtrim.models import build_prompt_ids, embedded_model_dir, resolve_model

    if args.model:
        model_dir, label = resolve_model(args.model)
    else:
        model_dir = embedded_model_dir()
        label = "SmolLM2-135M-Instruct"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = {L: [build_prompt_ids(tok, s.prompt) for s in make_samples("passkey", tok, L, n=args.reps + 1, seed=0)]
               for L in args.lengths}
    max_len = max(len(p) for ps in prompts.values() for p in ps) + 16
    logs = Path(tempfile.mkdtemp(prefix="vllm_prefill_"))
    configs = {"vLLM CPU_ATTN": {}, "kvtrim minference": {"kvtrim": {"prefill": "minference"}}}
    engines = {}
    for name, ac in configs.items():
        spec = {"model_dir": str(model_dir), "max_len": max_len, "additional_config": ac,
                "kv_gib": max(1, -(-max_len * args.kv_bytes_per_token // (1 << 30)))}
        engines[name] = Engine(name, spec, logs / (name.replace(" ", "_") + ".log"))
        print(f"{name}: loaded in {engines[name].info['load_seconds']:.0f} s", flush=True)
    records = []
    names = list(configs)
    for L in args.lengths:
        for r in range(args.reps + 1):
            for name in harness.order(names, r):  # alternating between rounds
                m = engines[name].prefill(prompts[L][r])
                rec = {"length": L, "prompt_tokens": len(prompts[L][r]), "round": r, "warmup": r == 0,
                       "engine": name, **m}
                records.append(rec)
                print(f"L={L} round {r} {name}: {m['seconds']:.2f} s (load {m['loadavg_before'][0]:.1f})", flush=True)
    engine_logs = {name: e.close() for name, e in engines.items()}
    sparse_used = "kvtrim: sparse prefill (minference) in use" in engine_logs["kvtrim minference"]
    summary = []
    for L in args.lengths:
        row = {"length": L}
        for name in names:
            xs = [x["seconds"] for x in records if x["length"] == L and x["engine"] == name and not x["warmup"]]
            row[name] = {"median_seconds": statistics.median(xs), "seconds": xs}
        row["speedup"] = row["vLLM CPU_ATTN"]["median_seconds"] / row["kvtrim minference"]["median_seconds"]
        row["same_first_token"] = [
            a["token"] == b["token"] for a, b in zip(
                [x for x in records if x["length"] == L and x["engine"] == names[0]],
                [x for x in records if x["length"] == L and x["engine"] == names[1]])]
        loads = [x["loadavg_before"][0] for x in records if x["length"] == L]
        row["loadavg_1min"] = [min(loads), statistics.median(loads), max(loads)]
        summary.append(row)
    return {
        "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__}, "model": label, "threads": 1,
        "reps": args.reps, "order": "one warm-up round, then rounds with the two engines one after the other, order alternating",
        "sparse_prefill_logged": sparse_used,
        "kvtrim_log_lines": {n: sorted({x.split("] ", 1)[-1] for x in t.splitlines() if "kvtrim:" in x})
                             for n, t in engine_logs.items()}, "engines": {n: e.info for n, e in engines.items()},
        "summary": summary, "records": records,
    }


def table(d: dict) -> str:
    out = ["| model | prompt tokens | vLLM CPU_ATTN s | kvtrim MInference s | speedup | same first token | load average (1 min) |",
           "|---|---|---|---|---|---|---|"]
    for dd in d if isinstance(d, list) else [d]:
        for row in dd["summary"]:
            toks = [x["prompt_tokens"] for x in dd["records"] if x["length"] == row["length"]]
            la = row["loadavg_1min"]
            out.append(f"| {dd['model']} | {min(toks)}-{max(toks)} | {row['vLLM CPU_ATTN']['median_seconds']:.1f} | "
                       f"{row['kvtrim minference']['median_seconds']:.1f} | {row['speedup']:.2f}x | "
                       f"{sum(row['same_first_token'])}/{len(row['same_first_token'])} | {la[0]:.1f}-{la[2]:.1f} |")
    ds = d if isinstance(d, list) else [d]
    out.append("")
    reps = ", ".join(f"{dd['model']}: {dd['reps']}" for dd in ds)
    out.append(f"Medians of interleaved repetitions ({reps}) after a warm-up (add_request to the first token), "
               f"float32, vLLM {ds[0]['versions']['vllm']} CPU build, one thread per engine process, the two engines "
               "alive side by side and used one at a time. Timed on the shared 2-core machine while other single-thread "
               "jobs ran (the load column): absolute seconds are inflated, the ratio less so. Same first token: "
               "rounds (warm-up included) whose greedy first token agreed between the engines.")
    if not all(dd["sparse_prefill_logged"] for dd in ds):
        missed = ", ".join(dd["model"] for dd in ds if not dd["sparse_prefill_logged"])
        out[-1] += (f" The run of {missed} did not capture the engines' log lines (vLLM's workers log to stdout, which the script "
                    "then read for its results only; fixed since), so the plugin's log does not confirm that its sparse "
                    "prefill ran.")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=3, warmup=None, several_tables=True)])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="a model kvtrim resolves (default: SmolLM2-135M)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--kv-bytes-per-token", type=int, default=2 * 30 * 3 * 64 * 4, help="sizes the KV pool (SmolLM2 float32)")
    args = ap.parse_args(argv)
    if args.worker:  # one engine, in a process of its own
        worker(json.loads(args.worker))
        return 0
    if harness.start(ap, args, table=table):
        return 0
    machine = harness.machine_record()
    result = measure(args)
    harness.publish(args.out, result, machine, lambda r: table([r]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
