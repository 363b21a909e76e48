"""One prepared GPU check (issue 19 item 7): kvtrim's Triton sparse prefill and compressed decode on CUDA.

Sized to finish in under 8 minutes on one H200 with nothing but this repository (no network, no
weights: every tensor is random, every model is built from a config with random weights). Sections,
in order, each with its own time guard (a section that runs past its share skips its remaining
cases, recorded as ``"skipped"``; the JSON is rewritten after every case, so a killed run keeps what
it measured):

1. ``kernels`` -- per pattern (``a_shape`` 1024 sinks + 4096 local, ``vertical_slash`` k_v=1000
   k_s=6096, ``block_sparse`` k_b=100: the published defaults) at 32k/64k/128k tokens: the pattern's
   index estimation and kvtrim's Triton kernel vs PyTorch SDPA with the flash backend
   (``is_causal``), one layer of Qwen2.5-7B's shape (28 query heads, 4 KV heads, head_dim 128),
   bfloat16, batch 1; medians of ``--reps`` after one warm-up. First a correctness check at 2k
   tokens: each pattern's Triton output against the float64 oracle (``masked_attention`` over the
   layout's mask), passing when its error is at most twice that of PyTorch's bfloat16 masked attention
   (kvtrim's tolerance rule).
2. ``searched`` -- the searched per-head config shipped for SmolLM2-135M
   (``src/kvtrim/attention/configs/smollm2-135m-instruct.json``: a pattern and sizes per head) run
   through kvtrim's prefill hook (``SparsePrefill``, backend ``triton``: estimation, per-head kernels,
   dense heads by SDPA) for every one of its 30 layers on random q/k/v of its shape (9 query heads,
   3 KV heads, head_dim 64), against SDPA flash for the same layers, at 32k/64k/128k.
3. ``decode`` -- a causal LM with random weights built from Qwen2.5-Coder-0.5B-Instruct's config and from
   Qwen2.5-7B's (values in :data:`MODELS`; ``max_position_embeddings`` raised to 131,072 + margin so
   128k prompts fit), bfloat16: one prefill of 32k / 128k random tokens, then ``--steps`` greedy
   decode steps (after 4 warm-up steps) through kvtrim's stepper, for ``full``, ``snapkv`` keep 0.1,
   and transformers' own ``DynamicCache`` (no kvtrim) as the baseline; per-step median time,
   prefill time, resident KV bytes and peak GPU memory.
4. ``lowbit`` -- the quantized decode kernel (``kvtrim.attention.triton.lowbit``, issue 46): first a
   correctness check per bit width (8, 4, 2) at 2,080 stored tokens (2,048 quantized in groups of 32 +
   32 in the model's dtype), the Triton output against the float64 oracle
   (``kvtrim.attention.reference.lowbit_decode_reference``) under the tolerance rule; then one
   decode query of one layer of Qwen2.5-7B's shape over 32k / 128k stored tokens: the Triton kernel
   reading 8/4/2-bit codes against SDPA (flash) over the same number of bfloat16 keys and values,
   medians of ``--reps``, with the bytes each reads.

Output: one JSON (the ``kvtrim.harness`` machine record plus the GPU, CUDA, Triton and driver
versions). Without CUDA the script prints ``gpu_check: no CUDA: skipped`` and exits 0, writing
nothing. ``--tiny`` runs every code path on CPU at tiny sizes with ``TRITON_INTERPRET=1`` (Triton's
interpreter; the kernel sections in float16 there, as the interpreter gets bfloat16 wrong), so a
crash would show here before the GPU is lent (``tests/test_gpu_check.py``). kvtrim is imported as
an installed package; on a machine that has a copy of the repository and no installed kvtrim (the
GPU machine), ``PYTHONPATH=src`` provides it.

    PYTHONPATH=src python benchmarks/gpu_check.py --out benchmarks/results/gpu/gpu_check_h200.json  # on the GPU machine
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu_check_tiny.json               # anywhere, on CPU (~20 s idle)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import traceback

#: Model configs the decode section builds with random weights (values from the models' published
#: config.json files; ``max_position_embeddings`` is raised at build time so that 128k prompts fit).
MODELS = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, head_dim=64, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, head_dim=128, vocab_size=152064, rms_norm_eps=1e-6, rope_theta=1e6,
                       tie_word_embeddings=False, max_position_embeddings=131072),
}
#: --tiny: the same architecture at toy sizes
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=512, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                  max_position_embeddings=4096)

#: (query heads, KV heads, head_dim) of the kernel section: one layer of Qwen2.5-7B
KERNEL_SHAPE = (28, 4, 128)
SEARCHED_CONFIG = "smollm2-135m-instruct.json"

#: seconds each section may take before it skips its remaining cases: 390 s, plus set-up (~20 s) and at most one
#: case past each guard (a 7B prefill at 128k, ~20-30 s on an H200) stays under 8 minutes
BUDGET = {"kernels": 130.0, "searched": 60.0, "decode": 200.0, "lowbit": 40.0}


def parse(argv):
    from kvtrim import harness

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=5, warmup=1)])
    ap.add_argument("--tiny", "--dry-run", dest="tiny", action="store_true",
                    help="every code path on CPU at tiny sizes under TRITON_INTERPRET=1 (checks the script, measures nothing)")
    ap.add_argument("--lengths", help="kernel/searched lengths in tokens (default 32768,65536,131072)")
    ap.add_argument("--decode-lengths", help="decode context lengths (default 32768,131072)")
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-7b", help=f"decode models among {', '.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    ap.add_argument("--budget", type=float, default=1.0, help="scale every section's time guard (default 1.0)")
    return ap, ap.parse_args(argv)


class Guard:
    """A section's time guard: ``ok()`` is False once the section ran past its share."""

    def __init__(self, name: str, seconds: float):
        self.name, self.seconds, self.t0 = name, seconds, time.perf_counter()

    def ok(self) -> bool:
        return time.perf_counter() - self.t0 < self.seconds

    def skipped(self) -> dict:
        return {"skipped": f"time guard: section {self.name!r} passed its {self.seconds:.0f} s"}


def log(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def tiny_env(tiny: bool):
    """--tiny: Triton's interpreter (set before triton is first imported; transformers imports it) and
    kvtrim's pure PyTorch index estimation on CPU (what runs on the GPU), restored afterwards."""
    keys = {"TRITON_INTERPRET": "1", "KVTRIM_CPU_KERNEL": "torch"} if tiny else {}
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv=None) -> int:
    ap, args = parse(argv)
    with tiny_env(args.tiny):
        return run_all(ap, args, argv)


def run_all(ap, args, argv) -> int:
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("gpu_check: no CUDA: skipped (nothing measured, nothing written; --tiny checks the code paths on CPU)")
        return 0
    from kvtrim import harness

    if harness.start(ap, args):
        return 0
    t_start = time.perf_counter()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.bfloat16
    # Triton's interpreter computes bfloat16 wrongly (max error ~8e8 against ~5e-4 in float16 on the
    # same inputs, triton 3.9 on CPU), so --tiny runs the kernel sections in float16
    kdtype = torch.float16 if args.tiny else dtype
    lengths = [int(x) for x in (args.lengths or ("192" if args.tiny else "32768,65536,131072")).split(",")]
    dec_lengths = [int(x) for x in (args.decode_lengths or ("160" if args.tiny else "32768,131072")).split(",")]
    models = args.models.split(",")
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose among {', '.join(MODELS)}")
    reps = 1 if args.tiny else args.reps
    steps = 3 if args.tiny else args.steps
    result: dict = {
        "benchmark": "gpu_check",
        "command": "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": harness.machine_record() | gpu_record(torch),
        "tiny": bool(args.tiny),
        "dtype": "bfloat16",
        "kernel_dtype": str(kdtype).removeprefix("torch."),
        "kernel_shape": dict(zip(("q_heads", "kv_heads", "head_dim"), (2, 1, 16) if args.tiny else KERNEL_SHAPE)),
        "models": {m: (TINY_MODEL if args.tiny else MODELS[m]) for m in models},
        "sections": {},
    }

    def save() -> None:
        result["seconds"] = round(time.perf_counter() - t_start, 2)
        harness.write_json(args.out, result)

    sections = [("kernels", lambda g, out: kernels(torch, device, kdtype, lengths, reps, args, g, out, save)),
                ("searched", lambda g, out: searched(torch, device, kdtype, lengths, reps, args, g, out, save)),
                ("decode", lambda g, out: decode(torch, device, dtype, dec_lengths, models, steps, args, g, out, save)),
                ("lowbit", lambda g, out: lowbit(torch, device, kdtype, dec_lengths, reps, args, g, out, save))]
    for name, fn in sections:
        out = result["sections"].setdefault(name, {})
        guard = Guard(name, BUDGET[name] * args.budget * (100 if args.tiny else 1))
        log(f"section {name} (time guard {guard.seconds:.0f} s)")
        try:
            fn(guard, out)
        except Exception as e:  # noqa: BLE001 - a section that crashes still leaves the others and the JSON
            out["error"] = f"{type(e).__name__}: {e}"
            out["traceback"] = traceback.format_exc(limit=8)
            log(f"section {name} failed: {out['error']}")
        out["seconds"] = round(time.perf_counter() - guard.t0, 2)
        save()
    result["machine"] = harness.finish_record(result["machine"])
    save()
    failed = [n for n, s in result["sections"].items() if "error" in s or any(isinstance(c, dict) and "error" in c for c in s.get("cases", []))]
    log(f"wrote {args.out} in {result['seconds']:.1f} s" + (f"; errors in {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def gpu_record(torch) -> dict:
    d: dict = {"cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    try:
        import triton

        d["triton"] = triton.__version__
    except ImportError:
        d["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        d |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
              "gpu_count": torch.cuda.device_count()}
    return d


# ----------------------------------------------------------------------------- timing helpers


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(torch, device, fn, reps: int) -> dict:
    """Median/min of ``reps`` calls after one warm-up (synchronised on CUDA)."""
    fn()
    sync(torch, device)
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(torch, device)
        xs.append(time.perf_counter() - t0)
    xs.sort()
    return {"median_s": xs[len(xs) // 2], "min_s": xs[0], "n": len(xs)}


def sdpa_flash(torch, device):
    """SDPA restricted to the flash backend on CUDA (the baseline); the default choice on CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def make_sdpa(torch, device, q, k, v):
    """The SDPA baseline for GQA inputs: flash with ``enable_gqa``, else (a torch without GQA in
    flash) with the KV heads repeated to the query heads. Returns (function, how)."""
    f = torch.nn.functional.scaled_dot_product_attention
    g = q.shape[1] // k.shape[1]

    def gqa():
        with sdpa_flash(torch, device):
            return f(q, k, v, is_causal=True, enable_gqa=g > 1)

    try:
        gqa()
        return gqa, "flash, enable_gqa" if device.type == "cuda" else "default backend (CPU)"
    except RuntimeError:
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

        def repeated():
            with sdpa_flash(torch, device):
                return f(q, kr, vr, is_causal=True)

        return repeated, "flash, KV heads repeated"


def free(torch, device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def case(torch, device, guard: Guard, cases: list, save, label: dict, fn) -> None:
    """Run one measured case unless the guard says stop; record its result, skip or error; save."""
    if not guard.ok():
        cases.append(label | guard.skipped())
        save()
        return
    t0 = time.perf_counter()
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        row = label | fn()
        if device.type == "cuda":
            row["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    except Exception as e:  # noqa: BLE001 - one failed case (out of memory, a kernel error) is recorded, the rest run
        row = label | {"error": f"{type(e).__name__}: {e}"}
    row["case_seconds"] = round(time.perf_counter() - t0, 2)
    cases.append(row)
    log(" ".join(f"{k}={v}" for k, v in row.items() if not isinstance(v, (dict, list))))
    free(torch, device)
    save()


# ----------------------------------------------------------------------------- 1. kernels


def patterns(tiny: bool) -> dict:
    from kvtrim.attention import AShape, BlockSparse, VerticalSlash

    if tiny:
        return {"a_shape": AShape(n_init=64, n_local=128), "vertical_slash": VerticalSlash(k_v=32, k_s=64),
                "block_sparse": BlockSparse(k_b=2)}
    return {"a_shape": AShape(), "vertical_slash": VerticalSlash(), "block_sparse": BlockSparse()}


def qkv(torch, device, dtype, t: int, hq: int, hkv: int, d: int, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(1, h, t, d, device=device, dtype=dtype, generator=g) for h in (hq, hkv, hkv))


def kernels(torch, device, dtype, lengths, reps, args, guard, out, save) -> None:
    from kvtrim.attention import layout_to_mask, masked_attention
    from kvtrim.attention.triton import sparse_attention_triton

    hq, hkv, d = (2, 1, 16) if args.tiny else KERNEL_SHAPE
    pats = patterns(args.tiny)
    # correctness at a short length: Triton vs the float64 oracle, against PyTorch's own bf16 error
    checks = out.setdefault("correctness", [])
    t_small = 192 if args.tiny else 2048
    for name, pat in pats.items():
        def check(name=name, pat=pat):
            q, k, v = qkv(torch, device, dtype, t_small, hq, hkv, d, seed=1)
            lay = pat.layout(q, k)
            mask = layout_to_mask(lay).to(device)
            ref = masked_attention(q.double(), k.double(), v.double(), mask)
            err_torch = (masked_attention(q, k, v, mask).double() - ref).abs().max().item()
            err_triton = (sparse_attention_triton(q, k, v, lay).double() - ref).abs().max().item()
            return {"err_triton": err_triton, "err_torch_bf16": err_torch, "ok": err_triton <= 2 * err_torch + 1e-6,
                    "density": round(float(lay.density()), 4)}

        case(torch, device, guard, checks, save, {"pattern": name, "tokens": t_small}, check)
    cases = out.setdefault("cases", [])
    for t in lengths:
        q, k, v = qkv(torch, device, dtype, t, hq, hkv, d)

        def dense(q=q, k=k, v=v):
            fn, how = make_sdpa(torch, device, q, k, v)
            r = timed(torch, device, fn, reps)
            return {"sdpa_s": r["median_s"], "sdpa": how}

        case(torch, device, guard, cases, save, {"pattern": "dense (SDPA)", "tokens": t}, dense)
        sdpa_s = cases[-1].get("sdpa_s")
        for name, pat in pats.items():
            def sparse(pat=pat, q=q, k=k, v=v, sdpa_s=sdpa_s):
                est = timed(torch, device, lambda: pat.layout(q, k), reps)
                lay = pat.layout(q, k)
                ker = timed(torch, device, lambda: sparse_attention_triton(q, k, v, lay), reps)
                total = est["median_s"] + ker["median_s"]
                row = {"estimate_s": est["median_s"], "kernel_s": ker["median_s"], "total_s": total,
                       "density": round(float(lay.density()), 5)}
                if sdpa_s:
                    row |= {"speedup_vs_sdpa": sdpa_s / total, "kernel_speedup_vs_sdpa": sdpa_s / ker["median_s"]}
                return row

            case(torch, device, guard, cases, save, {"pattern": name, "tokens": t}, sparse)
        del q, k, v
        free(torch, device)


# ----------------------------------------------------------------------------- 2. searched config


def searched(torch, device, dtype, lengths, reps, args, guard, out, save) -> None:
    from types import SimpleNamespace

    from kvtrim.integrations.prefill import PatternConfig, SparsePrefill

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "kvtrim", "attention", "configs", SEARCHED_CONFIG)
    cfg = PatternConfig.load(path)
    n_layers = 1 if args.tiny else cfg.model["num_hidden_layers"]
    hq, hkv, d = cfg.model["num_attention_heads"], cfg.model["num_key_value_heads"], cfg.model["head_dim"]
    out["config"] = {"file": f"src/kvtrim/attention/configs/{SEARCHED_CONFIG}", "counts": cfg.counts(), "layers_timed": n_layers,
                     "shape": {"q_heads": hq, "kv_heads": hkv, "head_dim": d}}
    backend = "triton"
    cases = out.setdefault("cases", [])
    for t in lengths:
        def run(t=t):
            q, k, v = qkv(torch, device, dtype, t, hq, hkv, d, seed=2)
            hook = SparsePrefill("minference", config=cfg, min_length=1, backend=backend)
            scale = d ** -0.5

            def all_layers():
                for li in range(n_layers):
                    res = hook(SimpleNamespace(layer_idx=li), q, k, v, None, scale)
                    if res is None:
                        raise RuntimeError(f"the hook fell back to dense: {hook.fallback}")

            all_layers()  # warm-up: compiles every kernel variant the config uses
            sync(torch, device)
            hook.reset_stats()
            t0 = time.perf_counter()
            all_layers()
            sync(torch, device)
            sparse_s = time.perf_counter() - t0
            st = hook.stats()
            fn, how = make_sdpa(torch, device, q, k, v)
            dense = timed(torch, device, fn, reps)
            return {"sparse_s": sparse_s, "sdpa_s": dense["median_s"] * n_layers, "sdpa": how,
                    "speedup_vs_sdpa": dense["median_s"] * n_layers / sparse_s, "density": round(st["density"], 4),
                    "estimate_s": st["estimate_seconds"], "sparse_layers": st["sparse_layers"], "kernel": st["kernel"]}

        case(torch, device, guard, cases, save, {"config": "smollm2-135m searched", "tokens": t}, run)


# ----------------------------------------------------------------------------- 3. decode


def build_model(torch, device, values: dict, max_len: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = dict(values)
    theta = kw.pop("rope_theta")
    kw["max_position_embeddings"] = max(kw["max_position_embeddings"], max_len + 1024)
    cfg = Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta}, use_sliding_window=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    model.set_attn_implementation("sdpa")
    return model


def decode(torch, device, dtype, lengths, models, steps, args, guard, out, save) -> None:
    from transformers import DynamicCache

    from kvtrim import decoding
    from kvtrim.cache import KVTrimCache, cache_keyword
    from kvtrim.integrations.hf import attach

    warm = 4
    cases = out.setdefault("cases", [])
    configs = ["full", "snapkv@0.1", "hf_dynamic"]
    for name in models:
        values = TINY_MODEL if args.tiny else MODELS[name]
        if not guard.ok():
            cases.extend({"model": name, "tokens": t, "config": c} | guard.skipped() for t in lengths for c in configs)
            save()
            continue
        log(f"building {name} with random weights")
        t0 = time.perf_counter()
        model = build_model(torch, device, values, max(lengths))
        out.setdefault("build_seconds", {})[name] = round(time.perf_counter() - t0, 2)
        vocab = values["vocab_size"]
        for t in lengths:
            ids = torch.randint(3, vocab, (t,), generator=torch.Generator().manual_seed(t)).tolist()
            for config in configs:
                def run(config=config, ids=ids, model=model):
                    serve = None
                    if config == "hf_dynamic":
                        cache = DynamicCache(config=model.config)

                        def serve(step, cache=cache, model=model):  # transformers' own cache, no kvtrim
                            x = torch.tensor([step.ids], device=device)
                            return model(input_ids=x, **{cache_keyword(): cache}, use_cache=True, logits_to_keep=1).logits[0, -1].float()
                    else:
                        method, _, keep = config.partition("@")
                        cache = KVTrimCache(model, method, **({"keep": float(keep)} if keep else {}))
                    stamps: list[float] = []
                    with torch.inference_mode(), (attach(model) if serve is None else contextlib.nullcontext()):
                        sync(torch, device)
                        t0 = time.perf_counter()
                        logits = decoding.run(model, decoding.prefill(cache, ids), serve=serve)
                        logits = logits.float().cpu()  # waits for the prefill
                        prefill_s = time.perf_counter() - t0
                        # each step's time = the gap between consecutive steps (the chosen token's
                        # int() waits for the previous forward), so the gaps are whole forwards
                        decoding.run(model, decoding.decode(cache, logits.to(device), warm + steps + 2), serve=serve,
                                     on_step=lambda step, s: stamps.append(time.perf_counter()))
                        sync(torch, device)
                    gaps = sorted(b - a for a, b in zip(stamps[warm:], stamps[warm + 1:]))
                    if isinstance(cache, KVTrimCache):
                        kv, stored = cache.kv_bytes(), max(cache.stored_tokens())
                    else:
                        kv = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
                        stored = cache.get_seq_length()
                    return {"prefill_s": prefill_s, "decode_ms_median": 1000 * gaps[len(gaps) // 2],
                            "decode_ms_min": 1000 * gaps[0], "steps": len(gaps), "kv_bytes": kv, "stored_tokens": stored}

                case(torch, device, guard, cases, save, {"model": name, "tokens": t, "config": config}, run)
        del model
        free(torch, device)
    for r in cases:  # decode speed-up of each configuration over transformers' DynamicCache
        base = next((b for b in cases if b.get("config") == "hf_dynamic" and b["model"] == r["model"] and b["tokens"] == r["tokens"]
                     and "decode_ms_median" in b), None)
        if base and "decode_ms_median" in r:
            r["decode_speedup_vs_hf_dynamic"] = base["decode_ms_median"] / r["decode_ms_median"]
            r["kv_fraction_of_hf_dynamic"] = r["kv_bytes"] / base["kv_bytes"] if base["kv_bytes"] else math.nan



# ----------------------------------------------------------------------------- 4. low-bit decode


def lowbit_case(torch, device, dtype, bits: int, hq: int, hkv: int, d: int, stored: int, seed: int = 0):
    """A random quantized layer: ``stored`` tokens, all but the last group quantized at ``bits`` (groups of
    the low-bit storage's size), the last group in ``dtype``; and one decode query."""
    from kvtrim.attention.lowbit import LowBitKV
    from kvtrim.lowbit_storage import GROUP

    g = torch.Generator(device=device).manual_seed(seed)
    lq = (stored // GROUP - 1) * GROUP
    kv = LowBitKV.empty(bits, 1, hkv, d, d, device)
    step = 8192  # quantize in slices: a 128k layer's float32 staging stays small
    for a in range(0, lq, step):
        n = min(step, lq - a)
        kv.append_groups(torch.randn(1, hkv, n, d, device=device, generator=g) * 2,
                         torch.randn(1, hkv, n, d, device=device, generator=g), GROUP)
    rk = (torch.randn(1, hkv, stored - lq, d, device=device, generator=g) * 2).to(dtype)
    rv = torch.randn(1, hkv, stored - lq, d, device=device, generator=g).to(dtype)
    q = torch.randn(1, hq, 1, d, device=device, generator=g).to(dtype)
    return kv, rk, rv, q


def lowbit(torch, device, dtype, lengths, reps, args, guard, out, save) -> None:
    from kvtrim.attention.lowbit import lowbit_decode_attention
    from kvtrim.attention.reference import lowbit_decode_reference

    hq, hkv, d = (2, 1, 16) if args.tiny else KERNEL_SHAPE
    scale = d ** -0.5
    checks = out.setdefault("correctness", [])
    for bits in (8, 4, 2):
        def check(bits=bits):
            kv, rk, rv, q = lowbit_case(torch, device, dtype, bits, hq, hkv, d, 2080 if not args.tiny else 96)
            o, _ = lowbit_decode_attention(q, kv, rk, rv, scale, backend="triton")
            ref64, _ = lowbit_decode_reference(q.double(), kv, rk.double(), rv.double(), scale)
            plain, _ = lowbit_decode_reference(q, kv, rk, rv, scale)
            err = (o.double() - ref64).abs().max().item()
            bound = 2 * (plain.double() - ref64).abs().max().item() + 1e-7
            return {"max_abs_err": err, "bound": bound, "ok": err <= bound}
        case(torch, device, guard, checks, save, {"bits": bits, "stored": 2080 if not args.tiny else 96}, check)
    cases = out.setdefault("cases", [])
    f = torch.nn.functional.scaled_dot_product_attention
    for n in lengths:
        def dense(n=n):
            g = torch.Generator(device=device).manual_seed(1)
            k = torch.randn(1, hkv, n, d, device=device, generator=g).to(dtype)
            v = torch.randn(1, hkv, n, d, device=device, generator=g).to(dtype)
            q = torch.randn(1, hq, 1, d, device=device, generator=g).to(dtype)

            def run():
                with sdpa_flash(torch, device):
                    return f(q, k, v, enable_gqa=hq > hkv)
            try:
                t = timed(torch, device, run, reps)
                how = "flash, enable_gqa" if device.type == "cuda" else "default backend (CPU)"
            except RuntimeError:  # a torch without GQA in flash: the KV heads repeated
                kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)

                def run():
                    with sdpa_flash(torch, device):
                        return f(q, kr, vr)
                t = timed(torch, device, run, reps)
                how = "flash, KV heads repeated"
            return {"sdpa_s": t["median_s"], "sdpa_min_s": t["min_s"], "sdpa": how,
                    "kv_bytes": 2 * k.numel() * k.element_size()}
        case(torch, device, guard, cases, save, {"stored": n, "bits": 16, "kernel": "SDPA"}, dense)
        for bits in (8, 4, 2):
            def low(n=n, bits=bits):
                kv, rk, rv, q = lowbit_case(torch, device, dtype, bits, hq, hkv, d, n)
                t = timed(torch, device, lambda: lowbit_decode_attention(q, kv, rk, rv, scale, backend="triton"), reps)
                return {"triton_s": t["median_s"], "triton_min_s": t["min_s"],
                        "kv_bytes": kv.nbytes() + 2 * rk.numel() * rk.element_size()}
            case(torch, device, guard, cases, save, {"stored": n, "bits": bits, "kernel": "triton lowbit"}, low)
    base = {c["stored"]: c["sdpa_s"] for c in cases if "sdpa_s" in c}
    for c in cases:
        if "triton_s" in c and c["stored"] in base:
            c["speedup_vs_sdpa"] = base[c["stored"]] / c["triton_s"]
    save()


if __name__ == "__main__":
    sys.exit(main())
