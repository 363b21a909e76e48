"""What the command modules of ``kvtrim`` share: the model options and loading, ``--quality``,
the sparse-prefill options, reading a context file, and the one-line error.

Every command refuses bad input before anything slow runs (the model load above all): the
``check_*`` helpers here are called first, the builders after. An error in user input is a
``KVTrimError``; ``kvtrim.cli.main`` prints it as one line ``kvtrim: error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import sys

from kvtrim.errors import KVTrimError
from kvtrim.validate import fraction, integer, number


def print_error(message: str) -> None:
    """The CLI's one error line on stderr: ``kvtrim: error: <message>``."""
    print(f"kvtrim: error: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------- help and parse-time checks
class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with each option's allowed values and default after its text, in brackets:
    ``[N >= 1] [default: 64]``. The allowed values come from the option's ``type`` (the checkers
    below carry them as ``allowed``, written with the option's metavar); a choice option lists its
    values in its metavar already. The default is left out when the text says it in words, and for
    switches and options without a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        allowed = getattr(action.type, "allowed", None)
        if allowed:  # before a default the text gives in words, after the rest of the text
            name = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
            head, sep, tail = text.rpartition(" [default:")
            text = f"{head} [{allowed.format(name)}]{sep}{tail}" if sep else f"{text} [{allowed.format(name)}]"
        if ("default" not in (action.help or "") and action.option_strings and action.nargs != 0
                and action.default not in (None, False, argparse.SUPPRESS)):
            text += " [default: %(default)s]"
        return text


def _checked(kind: str, convert, check, allowed: str):
    """An argparse ``type``: ``convert`` the text, then ``check`` it (a :mod:`kvtrim.validate` check);
    a failure is argparse's one-line error ``argument --x: must be ..., got ...``. ``allowed`` says the
    range for the help, ``{}`` standing for the option's metavar."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        try:
            return check(value)
        except KVTrimError as e:
            raise argparse.ArgumentTypeError(str(e).strip()) from None

    parse.allowed = allowed  # type: ignore[attr-defined]  # read by HelpFormatter
    parse.__name__ = kind
    return parse


def int_arg(minimum: int | None = None, maximum: int | None = None):
    """An integer option in ``[minimum, maximum]``, checked when the command line is parsed."""
    allowed = (f"{minimum} <= {{}} <= {maximum}" if minimum is not None and maximum is not None
               else f"{{}} >= {minimum}" if minimum is not None else f"{{}} <= {maximum}")
    return _checked("an integer", int, lambda v: integer(v, "", minimum=minimum, maximum=maximum), allowed)


def float_arg(minimum: float, *, min_open: bool = False):
    """A finite number above ``minimum`` (or at it, unless ``min_open``)."""
    return _checked("a number", float, lambda v: number(v, "", minimum=minimum, min_open=min_open),
                    f"{{}} {'>' if min_open else '>='} {minimum:g}")


def fraction_arg(*, allow_zero: bool = False):
    """A fraction in (0, 1] (``[0, 1]`` with ``allow_zero``)."""
    return _checked("a number", float, lambda v: fraction(v, "", allow_zero=allow_zero),
                    f"0 {'<=' if allow_zero else '<'} {{}} <= 1")


def list_arg(kind: type, minimum: float, maximum: float | None = None, *, open_ends: bool = False):
    """A comma-separated list of numbers (``int`` or ``float``) in ``[minimum, maximum]`` (``(minimum,
    maximum)`` with ``open_ends``); the option keeps its text, which the command parses as before."""
    lt = "<" if open_ends else "<="
    allowed = (f"each {minimum:g} {lt} {{}} {lt} {maximum:g}" if maximum is not None
               else f"each {{}} {'>' if open_ends else '>='} {minimum:g}")
    name = "comma-separated integers" if kind is int else "comma-separated numbers"

    def check(text: str) -> str:
        for item in text.split(","):
            try:
                v = kind(item.strip())
            except ValueError:
                raise KVTrimError(f"expected {name}, got {text!r}") from None
            if kind is float:
                number(v, "", minimum=minimum, maximum=maximum, min_open=open_ends, max_open=open_ends)
            else:
                integer(v, "", minimum=int(minimum), maximum=None if maximum is None else int(maximum))
        return text

    return _checked(name, str, check, allowed)


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
