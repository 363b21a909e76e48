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

#: what ``--model`` accepts, in every command's help
MODEL_HELP = ("a reference model's short name (smollm2, qwen2.5-0.5b: `kvtrim models`), a Hugging Face model directory, "
              "a .gguf file (converted once into kvtrim's cache), or a model id already in the local Hugging Face cache "
              "[default: the embedded SmolLM2-135M-Instruct]")


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
                and not any(action.default is x for x in (None, False, argparse.SUPPRESS))):  # `is`: 0 == False
            text += " [default: %(default)s]"
        return text


def _checked(kind: str, convert, check, allowed: str):
    """An argparse ``type``: ``convert`` the text, then ``check`` it (a :mod:`kvtrim.validate` check
    with an empty name); a failure is argparse's error ``argument --x: must be ...``, which
    :class:`kvtrim.cli.Parser` prints as one line ``--x must be ..., got ...``. ``allowed`` is the range
    for the help, ``{}`` standing for the option's metavar."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        try:
            return check(value)
        except KVTrimError as e:
            raise argparse.ArgumentTypeError(str(e).strip()) from None

    parse.allowed = allowed  # type: ignore[attr-defined]  # read by HelpFormatter
    parse.__name__ = kind
    return parse


#: the largest count an option takes (tokens, samples, rows, repetitions, threads): a signed 32-bit
#: integer, what torch's kernels and kvtrim's index tensors count in; a larger value is refused as
#: the command line is parsed, never found out inside torch
MAX_COUNT = 2**31 - 1
#: the largest seed: ``torch.Generator.manual_seed`` takes an unsigned 64-bit integer
MAX_SEED = 2**64 - 1
_POWERS = {MAX_COUNT: "2^31", MAX_SEED: "2^64"}
#: the most torch threads an option sets: more than any machine kvtrim runs on has cores (torch
#: itself takes up to a C int, and would try to start every one of them)
MAX_THREADS = 4096


def int_arg(minimum: int | None = None, maximum: int | None = MAX_COUNT, *, unit: str | None = None):
    """An integer option in ``[minimum, maximum]`` (``unit`` names what it counts in the message),
    checked when the command line is parsed. Every integer option has an upper bound: by default
    :data:`MAX_COUNT`."""
    upper = None if maximum is None else f"< {_POWERS[maximum]}" if maximum in _POWERS else f"<= {maximum}"
    allowed = (f"{minimum} <= {{}} {upper}" if minimum is not None and upper is not None
               else f"{{}} >= {minimum}" if minimum is not None else f"{{}} {upper}")
    if maximum not in _POWERS:
        return _checked("an integer", int, lambda v: integer(v, "", minimum=minimum, maximum=maximum, unit=unit),
                        allowed)

    def check(v: int) -> int:
        integer(v, "", minimum=minimum, unit=unit)  # "must be a positive number of tokens, got 0"
        if v > maximum:  # "must be below 2^31 (a signed 32-bit integer), got ..."
            bits = "a signed 32-bit" if maximum == MAX_COUNT else "an unsigned 64-bit"
            raise KVTrimError(f"must be below {_POWERS[maximum]} ({bits} integer), got {v}")
        return v

    return _checked("an integer", int, check, allowed)


def seed_arg():
    """A seed: an integer in ``[0, 2^64)`` (:data:`MAX_SEED`), checked when the command line is parsed."""
    return int_arg(0, MAX_SEED)


def shard_arg(text: str) -> tuple[int, int]:
    """``--shard I/N``: ``(I, N)`` with ``0 <= I < N <= MAX_COUNT``, checked when the command line is parsed."""
    i, sep, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be I/N (e.g. 0/2), got {text!r}") from None
    if not sep or not 0 <= shard[0] < shard[1] <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be I/N with 0 <= I < N < 2^31, got {text!r}")
    return shard


shard_arg.allowed = "0 <= I < N < 2^31"  # type: ignore[attr-defined]  # read by HelpFormatter


def size_arg(text: str) -> str:
    """``--prefill-size KEY=VALUE``: the text, once VALUE is an integer in ``[1, 2^31)``; checked when the
    command line is parsed (which KEY a pattern takes is checked with the mode, before the model loads)."""
    key, sep, val = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE (e.g. k_b=32), got {text!r}")
    try:
        v = int(val)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE with an integer VALUE, got {text!r}") from None
    if not 1 <= v <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE with 1 <= VALUE < 2^31, got {text!r}")
    return text


size_arg.allowed = "KEY=VALUE, 1 <= VALUE < 2^31"  # type: ignore[attr-defined]  # read by HelpFormatter


def float_arg(minimum: float, *, min_open: bool = False):
    """A finite number above ``minimum`` (or at it, unless ``min_open``)."""
    return _checked("a number", float, lambda v: number(v, "", minimum=minimum, min_open=min_open),
                    f"{{}} {'>' if min_open else '>='} {minimum:g}")


def fraction_arg(*, allow_zero: bool = False):
    """A fraction in (0, 1] (``[0, 1]`` with ``allow_zero``)."""
    return _checked("a number", float, lambda v: fraction(v, "", allow_zero=allow_zero),
                    f"0 {'<=' if allow_zero else '<'} {{}} <= 1")


def list_arg(kind: type, minimum: float, maximum: float | None = None, *, open_ends: bool = False, hint: str = ""):
    """A comma-separated list of numbers (``int`` or ``float``), each in ``[minimum, maximum]``
    (``(minimum, maximum)`` with ``open_ends``); the option keeps its text, which the command parses
    as before. ``hint`` is added to the message (what to do instead)."""
    lo, hi = ("(", ")") if open_ends else ("[", "]")
    kinds = "integers" if kind is int else "numbers"
    if kind is int and maximum is None:  # every integer option has an upper bound (MAX_COUNT)
        maximum = MAX_COUNT
        what = f"comma-separated {kinds} {'>' if open_ends else '>='} {minimum:g} and < 2^31"
        allowed = f"each {'>' if open_ends else '>='} {minimum:g}, < 2^31"
    elif maximum is None:
        what = f"comma-separated {kinds} {'>' if open_ends else '>='} {minimum:g}"
        allowed = f"each {'>' if open_ends else '>='} {minimum:g}"
    else:
        what = f"comma-separated {kinds} in {lo}{minimum:g}, {maximum:g}{hi}"
        allowed = f"each in {lo}{minimum:g}, {maximum:g}{hi}"

    def check(text: str) -> str:
        try:
            items = [kind(x.strip()) for x in text.split(",")]
        except ValueError:
            items = []
        ok = bool(items) and all(
            (minimum < x if open_ends else minimum <= x) and (maximum is None or (x < maximum if open_ends else x <= maximum))
            for x in items)  # NaN fails every comparison
        if not ok:
            raise KVTrimError(f"must be {what}, got {text!r}{f' ({hint})' if hint else ''}")
        return text

    return _checked(what, str, check, allowed)


# ----------------------------------------------------------------------------- the model
def model_options(sp, *, threads: bool = True, rope: bool = True):
    """The options group ``model`` of a command that loads one: ``--model``, ``--dtype``, ``--device``,
    (with ``rope``) ``--rope-scaling`` and (with ``threads``) ``--threads``, read by
    :func:`check_model_options` and :func:`load_from_args`.
    Returns the group, for a command's own model options."""
    from kvtrim.models import DTYPE_CHOICES

    g = sp.add_argument_group("model")
    g.add_argument("--model", help=MODEL_HELP)
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32",
                   help="weight and KV-cache dtype (bfloat16 halves the KV bytes and runs the matrix work in bf16 where "
                        "the CPU has it; auto: bfloat16 weights and KV, computed per phase in what measures fastest "
                        "here, float32 prefill on a CPU without bf16 arithmetic; kvtrim's scores stay float32)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    if rope:
        g.add_argument("--rope-scaling", type=rope_scaling_arg, metavar="KIND:FACTOR",
                       help="stretch the model's RoPE to FACTOR x its trained context: yarn:4 is what Qwen2.5 "
                            "documents for 128k tokens (yarn or linear; kvtrim.models.extend_context) [default: none]")
    if threads:
        g.add_argument("--threads", type=int_arg(1, MAX_THREADS), metavar="N",
                       help="torch threads for the model's work [default: torch's, one per core]")
    return g


def kv_bits_option(g, *, default: int | None = 16, extra: str = "") -> None:
    """``--kv-bits``: the bits each stored key and value element takes (``KVTrimCache(kv_bits=)``),
    checked when the command line is parsed."""
    from kvtrim.cache import KV_BITS, check_kv_bits

    allowed = ", ".join(map(str, KV_BITS))
    g.add_argument("--kv-bits", type=_checked("an integer", int, check_kv_bits, f"{{}} in {allowed}"), default=default,
                   metavar="BITS", help="bits per stored key and value element: 16 keeps the model's dtype; 8, 4 or 2 "
                                        "quantize them (keys per channel, values per token; docs/quantization.md)" + extra)


def sampling_options(g, *, temperature: float) -> None:
    """``--sample``, ``--temperature``, ``--top-p``, ``--top-k`` and ``--seed`` (:class:`kvtrim.decoding.Sampler`)."""
    g.add_argument("--sample", action="store_true", help="sample the next token instead of taking the most likely one")
    g.add_argument("--temperature", type=float_arg(0, min_open=True), default=temperature, metavar="T",
                   help="with --sample: divides the logits (lower: surer, higher: more varied)")
    g.add_argument("--top-p", type=fraction_arg(), default=1.0, metavar="P",
                   help="with --sample: draw from the smallest set of likeliest tokens whose probability reaches P (1: all)")
    g.add_argument("--top-k", type=int_arg(0), default=0, metavar="K",
                   help="with --sample: draw from the K likeliest tokens only (0: all)")
    g.add_argument("--seed", type=seed_arg(), default=0, metavar="S", help="random seed of the sampling")


def check_model_options(args) -> None:
    """Refuse a bad --dtype/--device before anything slow runs, and keep them resolved on ``args``
    (a ``torch.dtype`` or ``"auto"``, and a ``torch.device``), so the rest of the command does not parse them again;
    apply ``--threads`` (``torch.set_num_threads``)."""
    from kvtrim.models import check_dtype, resolve_device

    if hasattr(args, "dtype"):
        args.dtype = check_dtype(args.dtype)  # a torch.dtype, or "auto" (resolved per phase when the model loads)
    if hasattr(args, "device"):
        args.device = resolve_device(args.device)
    if getattr(args, "threads", None) is not None:
        import torch

        try:
            torch.set_num_threads(args.threads)
        except (ValueError, RuntimeError, OverflowError) as e:  # past a C int: "Overflow when unpacking long"
            raise KVTrimError(f"--threads {args.threads} is more than torch can set ({str(e).strip()})") from None


def rope_scaling_arg(text: str) -> tuple[str, float]:
    """``--rope-scaling KIND:FACTOR`` as ``(kind, factor)``, checked when the command line is parsed
    (an argparse ``type``; benchmark scripts take the option through it too)."""
    from kvtrim.models import ROPE_SCALINGS

    kind, sep, factor = text.partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = float("nan")
    if not sep or kind not in ROPE_SCALINGS or not 1.0 <= value <= 64.0:
        raise argparse.ArgumentTypeError(f"must be KIND:FACTOR with KIND one of {', '.join(ROPE_SCALINGS)} and "
                                         f"1 <= FACTOR <= 64 (e.g. yarn:4); got {text!r}")
    return kind, value


def load_from_args(args):
    """``kvtrim.models.load_model`` with the command's --model, --dtype and --device, and its
    --rope-scaling applied (:func:`kvtrim.models.extend_context`)."""
    from kvtrim.models import extend_context, load_model

    lm = load_model(args.model, dtype=getattr(args, "dtype", None), device=getattr(args, "device", None))
    scaling = getattr(args, "rope_scaling", None)
    if scaling is not None:
        kind, factor = scaling
        n = extend_context(lm.model, factor, kind)
        print(f"kvtrim: {kind} RoPE scaling x{factor:g}: context {n} tokens", file=sys.stderr)
    return lm


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
    bits = "" if choice.kv_bits == 16 else f", {choice.kv_bits}-bit KV"
    print(f"kvtrim: --quality {args.quality:g}: {method} {'full cache' if choice.whole else f'keep {choice.keep:g}'}{bits} "
          f"({choice.reason})", file=sys.stderr)
    return choice


def quality_bits(args, choice) -> int:
    """The cache's ``kv_bits`` under --quality: the calibration's pick where it holds bit widths for the
    method (``BudgetChoice.bit_widths``), else --kv-bits as given. A --kv-bits other than 16 that
    differs from the pick is refused: the calibration picks the width with the keep."""
    given = getattr(args, "kv_bits", None)
    if choice.bit_widths == (16,):
        return 16 if given is None else given
    if given not in (None, 16) and given != choice.kv_bits:
        raise KVTrimError(f"--kv-bits {given} and --quality: the calibration picks the bit width with the budget "
                          f"({choice.method} keep {choice.keep:g} at {choice.kv_bits} bits for agreement >= "
                          f"{choice.quality:g}); drop --kv-bits, or give --keep instead of --quality")
    return choice.kv_bits


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
