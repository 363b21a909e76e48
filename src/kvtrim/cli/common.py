"""What the command modules of ``kvtrim`` share: the model options and loading, ``--quality``,
the sparse-prefill options, reading a context file, and the one-line error.

Every command refuses bad input before anything slow runs (the model load above all): the
``check_*`` helpers here are called first, the builders after. An error in user input is a
``KVTrimError``; ``kvtrim.cli.main`` prints it as one line ``kvtrim: error: ...`` and exits 2.
"""

from __future__ import annotations

import sys

from kvtrim.errors import KVTrimError
from kvtrim.validate import integer


def print_error(message: str) -> None:
    """The CLI's one error line on stderr: ``kvtrim: error: <message>``."""
    print(f"kvtrim: error: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------- the model
def model_options(sp) -> None:
    """``--dtype`` and ``--device`` for a command that loads a model (read by :func:`load_from_args`)."""
    from kvtrim.models import DTYPES

    sp.add_argument("--dtype", choices=list(DTYPES), default="float32",
                    help="weight and KV-cache dtype (default float32; bfloat16 halves the KV bytes and runs the matrix "
                         "work in bf16 where the CPU has it; kvtrim's scores stay float32)")
    sp.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")


def check_model_options(args) -> None:
    """Refuse a bad --dtype/--device before anything slow runs, and keep them resolved on ``args``
    (a ``torch.dtype`` and a ``torch.device``), so the rest of the command does not parse them again."""
    from kvtrim.models import resolve_device, resolve_dtype

    if hasattr(args, "dtype"):
        args.dtype = resolve_dtype(args.dtype)
    if hasattr(args, "device"):
        args.device = resolve_device(args.device)


def load_from_args(args):
    """``kvtrim.models.load_model`` with the command's --model, --dtype and --device."""
    from kvtrim.models import load_model

    return load_model(args.model, dtype=getattr(args, "dtype", None), device=getattr(args, "device", None))


# ----------------------------------------------------------------------------- --quality
def check_quality_args(args, method: str) -> None:
    """Check --quality/--calibration for ``method`` before the model loads (the budget itself is
    picked once the prompt's length is known: :func:`quality_choice`)."""
    from kvtrim.budget import Calibration, check_quality
    from kvtrim.registry import get_policy_class

    check_quality(args.quality)
    if not get_policy_class(method).takes_budget:
        raise KVTrimError(f"--quality picks a budget; method {method!r} takes none (choose a compressing --method)")
    if getattr(args, "calibration", None):
        Calibration.load(args.calibration).points(method)


def quality_choice(args, method: str, model, prompt_tokens: int | None):
    """The budget --quality picks for ``method`` (``kvtrim.budget.keep_for_quality``), said on stderr."""
    from kvtrim.budget import keep_for_quality

    choice = keep_for_quality(method, model, args.quality, prompt_tokens, calibration=getattr(args, "calibration", None))
    print(f"kvtrim: --quality {args.quality:g}: {method} {'full cache' if choice.full else f'keep {choice.keep:g}'} "
          f"({choice.reason})", file=sys.stderr)
    return choice


# ----------------------------------------------------------------------------- sparse prefill
def _parse_sizes(items: list[str] | None) -> dict:
    sizes = {}
    for item in items or []:
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise KVTrimError(f"--prefill-size takes KEY=VALUE (e.g. k_b=32); got {item!r}")
        try:
            sizes[key.strip()] = int(val)
        except ValueError:
            raise KVTrimError(f"--prefill-size {key.strip()} must be an integer; got {val!r}") from None
    return sizes


def prefill_from_args(args, model=None):
    """The sparse-prefill options of ``generate``: without ``model``, validate them (before the model
    loads; returns None); with it, build the hook (None for dense attention)."""
    from kvtrim.integrations.prefill import PREFILL_MODES, PatternConfig, SparsePrefill, make_prefill

    mode = args.prefill
    if mode not in PREFILL_MODES:
        raise KVTrimError(f"unknown --prefill {mode!r}; choose one of: {', '.join(PREFILL_MODES)}")
    sizes = _parse_sizes(args.prefill_size)
    cfg = PatternConfig.load(args.pattern_config) if args.pattern_config else None
    if model is None:  # validation pass: build what can be built without the model
        if mode != "minference":
            SparsePrefill(mode, config=cfg, sizes=sizes, min_length=args.prefill_min_length)
        elif sizes:
            raise KVTrimError("--prefill-size is for the single-pattern modes; minference takes sizes from --pattern-config")
        else:
            integer(args.prefill_min_length, "--prefill-min-length", minimum=1, unit="tokens")
        return None
    if mode == "dense" and not sizes and cfg is None:
        return None
    return make_prefill(model, mode, cfg, sizes=sizes, min_length=args.prefill_min_length)


# ----------------------------------------------------------------------------- input files
def read_context(path: str | None) -> str:
    """The --context-file's text ("" without one); a file that is not UTF-8 text is refused."""
    from kvtrim.textio import read_text_file

    return "" if path is None else read_text_file(path, "context file")
