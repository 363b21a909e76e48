"""The ``kvtrim`` command line: ``methods``, ``generate``, ``search-patterns``, ``demo``, ``chat``, ``stream``,
``eval``, ``report``, ``bench``.

Errors in user input print one line ``kvtrim: error: ...`` naming the problem and what is
allowed, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from kvtrim.errors import KVTrimError
from kvtrim.validate import integer, number

logger = logging.getLogger("kvtrim")


def _policy_from_args(args):
    from kvtrim.registry import create_policy

    if getattr(args, "quality", None) is not None:  # the budget is picked once the prompt's length is known
        return create_policy(args.method, keep=check_quality_args(args, args.method))
    kw = {}
    if args.keep is not None:
        kw["keep"] = args.keep
    if args.max_tokens is not None:
        kw["max_tokens"] = args.max_tokens
    if getattr(args, "position", None):
        kw["position"] = args.position
    return create_policy(args.method, **kw)


def check_quality_args(args, method: str) -> float:
    """Check --quality/--calibration before the model loads; returns a stand-in keep for the other checks
    (the real one is picked with the prompt, :func:`quality_choice`)."""
    from kvtrim.budget import Calibration, check_quality
    from kvtrim.registry import get_policy_class

    check_quality(args.quality)
    if not get_policy_class(method).takes_budget:
        raise KVTrimError(f"--quality picks a budget; method {method!r} takes none (choose a compressing --method)")
    if getattr(args, "calibration", None):
        Calibration.load(args.calibration).points(method)
    return 0.5


def quality_choice(args, method: str, model, prompt_tokens: int | None):
    """The budget --quality picks for ``method`` (``kvtrim.budget.keep_for_quality``), said on stderr."""
    from kvtrim.budget import keep_for_quality

    choice = keep_for_quality(method, model, args.quality, prompt_tokens, calibration=getattr(args, "calibration", None))
    print(f"kvtrim: --quality {args.quality:g}: {method} {'full cache' if choice.full else f'keep {choice.keep:g}'} "
          f"({choice.reason})", file=sys.stderr)
    return choice


def model_options(sp) -> None:
    """``--dtype`` and ``--device`` for a command that loads a model (read by :func:`load_from_args`)."""
    from kvtrim.models import DTYPES

    sp.add_argument("--dtype", choices=list(DTYPES), default="float32",
                    help="weight and KV-cache dtype (default float32; bfloat16 halves the KV bytes and runs the matrix "
                         "work in bf16 where the CPU has it; kvtrim's scores stay float32)")
    sp.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")


def check_model_options(args) -> None:
    """Refuse a bad --dtype/--device before anything slow runs."""
    from kvtrim.models import resolve_device, resolve_dtype

    resolve_dtype(getattr(args, "dtype", None))
    resolve_device(getattr(args, "device", None))


def load_from_args(args):
    """``kvtrim.models.load_model`` with the command's --model, --dtype and --device."""
    from kvtrim.models import load_model

    return load_model(args.model, dtype=getattr(args, "dtype", None), device=getattr(args, "device", None))


def cmd_methods(args) -> int:
    from kvtrim.registry import methods

    rows = [{"name": m.name, "description": m.description} for m in methods()]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        width = max(len(r["name"]) for r in rows)
        for r in rows:
            print(f"{r['name']:<{width}}  {r['description']}")
    return 0


def _read_context(path: str | None) -> str:
    from kvtrim.textio import read_text_file

    return "" if path is None else read_text_file(path, "context file")


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


def _prefill_from_args(args, model=None):
    """Validate the sparse-prefill options (before the model loads), then build the hook (after)."""
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


def cmd_generate(args) -> int:
    from kvtrim.decoding import check_prefill_chunk
    from kvtrim.generation import generate_ids
    from kvtrim.models import build_prompt_ids
    from kvtrim.registry import check_text_prompt

    if args.prompts_file is not None:  # several prompts together (batch > 1)
        from kvtrim.cli_batch import cmd_generate_batch

        return cmd_generate_batch(args, _prefill_from_args)
    policy = _policy_from_args(args)  # validate before the slow model load
    check_model_options(args)
    _prefill_from_args(args)
    integer(args.max_new_tokens, "--max-new-tokens", minimum=0, unit="tokens")
    if args.sample:
        number(args.temperature, "--temperature", minimum=0, min_open=True)
    if args.plain_prompt and (args.prompt is not None or getattr(args, "image", None)):
        raise KVTrimError("--plain-prompt formats a --question for a text model; --prompt is raw text and --image "
                          "uses the model's processor")
    if getattr(args, "image", None) and args.quality is not None:
        raise KVTrimError("--quality is calibrated on text prompts; with --image give a budget (--keep/--max-tokens)")
    if not getattr(args, "image", None):
        check_text_prompt(policy)  # a method that needs image spans would run as full
    elif args.prefill_chunk is not None:
        raise KVTrimError("--prefill-chunk feeds a text prompt in pieces; image inputs need the prompt in one prefill")
    check_prefill_chunk(policy, args.prefill_chunk)
    context = _read_context(args.context_file)
    if getattr(args, "image", None):
        from kvtrim.vlm import generate_with_images

        if args.question is not None and not args.question.strip():
            raise KVTrimError("the question is empty; pass a non-empty --question")
        d = generate_with_images(args, policy, context)
        print(json.dumps(d) if args.json else d["answer"])
        return 0
    if args.question is not None:
        if not args.question.strip():
            raise KVTrimError("the question is empty; pass a non-empty --question")
        text, chat = (f"{context}\n\n{args.question}" if context else args.question), True
    else:
        if not args.prompt.strip():
            raise KVTrimError("the prompt is empty; pass a non-empty --prompt")
        text, chat = (f"{context}\n\n{args.prompt}" if context else args.prompt), False
    lm = load_from_args(args)
    prefill = _prefill_from_args(args, lm.model)
    ids = build_prompt_ids(lm.tokenizer, text, chat=chat, plain=args.plain_prompt)
    choice = None
    if args.quality is not None:
        from kvtrim.registry import create_policy

        choice = quality_choice(args, args.method, lm, len(ids))
        kw = {"position": args.position} if args.position else {}
        policy = create_policy("full") if choice.full else create_policy(args.method, keep=choice.keep, **kw)
    res = generate_ids(
        lm.model,
        lm.tokenizer,
        ids,
        policy,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=args.temperature,
        seed=args.seed,
        prefill=prefill,
        prefill_chunk=args.prefill_chunk,
    )
    stats = res.prefill or {"prefill": "dense", "density": 1.0, "fallback": None}
    if args.json:
        d = res.to_dict()
        d.pop("token_ids")
        d["model"] = lm.source
        d["prefill"] = {k: v for k, v in stats.items() if k != "prefill"} | {"mode": stats["prefill"]}
        d["attention_density"] = stats["density"]
        if choice is not None:
            d["budget_choice"] = choice.to_dict()
        print(json.dumps(d))
    else:
        print(res.answer)
        print(
            f"[{res.method}] prompt {res.prompt_tokens} tok, {res.new_tokens} new; KV {res.kv_bytes / 2**20:.1f} MiB "
            f"(full {res.kv_bytes_full / 2**20:.1f} MiB); prefill {res.prefill_seconds:.2f}s, "
            f"decode {res.decode_tokens_per_s:.1f} tok/s; prefill attention {stats['prefill']} "
            f"(density {stats['density']:.2f}{', fell back to dense: ' + stats['fallback'] if stats['fallback'] and stats['prefill'] != 'dense' else ''})"
            f"{'' if res.compressed else '; not compressed: ' + str(res.reason)}",
            file=sys.stderr,
        )
    return 0


def cmd_demo(args) -> int:
    from tqdm import tqdm

    from kvtrim.eval.common import check_depth, check_length
    from kvtrim.eval.tasks import passkey
    from kvtrim.generation import generate_ids
    from kvtrim.models import build_prompt_ids
    from kvtrim.registry import check_text_prompt, create_policy, get_policy_class, method_names

    # the demo's prompt is text: by default, the methods that act on text (needs_spans ones are for images)
    names = args.methods.split(",") if args.methods else [n for n in method_names() if not get_policy_class(n).needs_spans]
    if args.quality is not None and not args.methods:  # by default, the methods the calibration holds
        from kvtrim.budget import calibration_for

        held = calibration_for(args.model, args.calibration).methods
        names = [n for n in names if n in held or not get_policy_class(n).takes_budget]
    policies = []
    for n in names:
        kw = {"keep": args.keep} if get_policy_class(n).takes_budget else {}
        if args.quality is not None and get_policy_class(n).takes_budget:  # picked at the demo's length
            choice = quality_choice(args, n, args.model, args.length)
            kw = {} if choice.full else {"keep": choice.keep}
            n = n if kw else "full"
        policies.append(check_text_prompt(create_policy(n, **kw)))
    if not args.methods:
        skipped = [n for n in method_names() if get_policy_class(n).needs_spans]
        print(f"kvtrim demo: {', '.join(skipped)} act on image tokens, not in this text demo "
              "(see kvtrim generate --image)", file=sys.stderr)
    check_length("passkey", args.length)  # before the model loads
    check_depth("passkey", args.depth)
    check_model_options(args)
    print(f"kvtrim demo: loading {args.model or 'the embedded model (SmolLM2-135M-Instruct)'} ...", file=sys.stderr)
    lm = load_from_args(args)
    sample = passkey(lm.tokenizer, args.length, depth=args.depth, seed=args.seed)
    key = sample.answers[0]
    ids = build_prompt_ids(lm.tokenizer, sample.prompt, plain=args.plain_prompt)
    print(
        f"context: {len(ids)} tokens of essays with a 5-digit pass key at depth {args.depth:.0%}; "
        f"budget keep={args.keep} for every compressing method" if args.quality is None else
        f"budgets picked for agreement >= {args.quality:g} with the full cache",
        file=sys.stderr,
    )
    rows = []
    for pol in tqdm(policies, desc="methods", unit="method", file=sys.stderr):
        r = generate_ids(lm.model, lm.tokenizer, ids, pol, max_new_tokens=16)
        rows.append((pol.name, key in r.answer, r))
    print()
    print(f"{'method':<15}{'correct':<9}{'KV MiB':>8}{'of full':>9}{'prefill s':>11}{'decode tok/s':>14}  answer")
    for name, ok, r in rows:
        print(
            f"{name:<15}{'yes' if ok else 'no':<9}{r.kv_bytes / 2**20:>8.1f}{r.kv_bytes / r.kv_bytes_full:>9.0%}"
            f"{r.prefill_seconds:>11.2f}{r.decode_tokens_per_s:>14.1f}  {r.answer[:40]!r}"
        )
    print(f"\npass key: {key}; KV MiB = resident key/value buffers at the end (1 MiB = 2^20 bytes); of full = that "
          "over what transformers' DynamicCache holds for the same tokens (kvtrim's buffers keep room for tokens to come)")
    return 0


def cmd_search_patterns(args) -> int:
    from kvtrim.tools.search_patterns import search_patterns

    try:
        levels = sorted(float(x) for x in args.density.split(","))
    except ValueError:
        raise KVTrimError(f"--density takes comma-separated fractions, e.g. 0.1,0.2,0.35,0.5,0.65,0.8; got {args.density!r}") from None
    if not all(0.0 < d < 1.0 for d in levels):
        raise KVTrimError(f"--density must be in (0, 1); got {args.density}")
    if args.max_error is not None and not args.max_error > 0:
        raise KVTrimError(f"--max-error must be > 0; got {args.max_error}")
    if args.length < 256:
        raise KVTrimError(f"--length must be >= 256 tokens; got {args.length}")
    out = Path(args.out)
    if out.exists() and out.is_dir():
        raise KVTrimError(f"--out {args.out!r} is a directory; give a file name")
    if not out.parent.is_dir():
        raise KVTrimError(f"--out: directory {str(out.parent)!r} does not exist")
    if not os.access(out if out.exists() else out.parent, os.W_OK):
        raise KVTrimError(f"--out {args.out!r} is not writable")
    check_model_options(args)
    lm = load_from_args(args)
    tags = [args.tag] if args.tag else []
    cfg = search_patterns(lm.model, lm.tokenizer, length=args.length, target_density=levels, seed=args.seed, model_tags=tags,
                          max_error=args.max_error)
    cfg.save(out)
    counts = cfg.counts()
    errs = [e["error"] for row in cfg.layers for e in row]
    print(
        f"wrote {out}: {sum(counts.values())} heads ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}); "
        f"mean output error {sum(errs) / len(errs):.4f}; {cfg.search['seconds']} s",
        file=sys.stderr,
    )
    return 0


def version() -> str:
    """The installed distribution's version, else the source tree's ``kvtrim.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvtrim")
    except PackageNotFoundError:
        from kvtrim import __version__

        return __version__


class Parser(argparse.ArgumentParser):
    """argparse with kvtrim's error contract: one line ``kvtrim: error: ...`` and exit status 2
    (argparse's own prints the usage first; sub-command parsers inherit this class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvtrim: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvtrim", description="KV-cache compression for long-context inference.")
    p.add_argument("--version", action="version", version=f"kvtrim {version()}")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("methods", help="list the registered KV methods")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_methods)

    def budget_args(sp):
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--keep", type=float, help="fraction of tokens to keep, in (0, 1] (fastv: of the image tokens)")
        g.add_argument("--max-tokens", type=int, help="fixed number of tokens to keep per layer (a compressing method given "
                                                      "neither keeps 1024: kvtrim.policies.base.DEFAULT_MAX_TOKENS; hae: none)")
        g.add_argument("--quality", type=float, help="target agreement with the full cache in (0, 1]: the smallest budget "
                                                     "calibrated to reach it for this method, model and prompt length "
                                                     "(docs/autobudget.md)")
        sp.add_argument("--calibration", help="calibration JSON for --quality, made by kvtrim calibrate (default: the one "
                                              "shipped for the model)")

    g = sub.add_parser("generate", help="answer a question or continue a prompt with a compressed cache")
    g.add_argument("--model", help="Hugging Face model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--method", default="full", help="KV method (see `kvtrim methods`)")
    budget_args(g)
    g.add_argument("--position", help="position policy: true, reassigned or compressed (default: the method's)")
    g.add_argument("--context-file", help="a text file prepended to the question/prompt")
    g.add_argument("--image", action="append", metavar="FILE", help="an image for a vision-language --model (repeatable)")
    q = g.add_mutually_exclusive_group(required=True)
    q.add_argument("--question", help="a question (the chat template applied, or the plain format for a model without one)")
    q.add_argument("--prompt", help="raw prompt text to continue (no chat template)")
    q.add_argument("--prompts-file", metavar="FILE",
                   help="several prompts generated together as the rows of one batch, each with its own cache: a "
                        ".jsonl file (one object per line: question or prompt, optional method/keep/max_tokens/"
                        "position/max_new_tokens/id) or a text file of one question per line; prints one JSON "
                        "line per prompt, in order (docs/batch.md)")
    g.add_argument("--plain-prompt", action="store_true",
                   help="format --question in kvtrim's plain prompt format (User: ... / Assistant:) even if the model "
                        "has a chat template (used anyway for a model without one)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="feed the prompt in chunks of N tokens, compressing after each (bounded prefill memory: the "
                        "cache holds at most the budget + one chunk; docs/memory.md). Default: one forward")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="print one JSON object (with --prompts-file: every field on each line)")
    g.add_argument("--max-rows", type=int, default=64, help="with --prompts-file: most rows decoded in one forward (default 64)")
    g.add_argument("--no-progress", action="store_true", help="with --prompts-file: no progress bar")
    model_options(g)
    sp = g.add_argument_group("sparse prefill (MInference)")
    sp.add_argument("--prefill", default="dense", help="dense (default), minference (per-head config), a_shape, vertical_slash, block_sparse")
    sp.add_argument("--pattern-config", help="per-head pattern config for --prefill minference (default: the one shipped for the model)")
    sp.add_argument("--prefill-size", action="append", metavar="KEY=VALUE", help="pattern size for a single-pattern mode, e.g. k_b=32 (repeatable)")
    sp.add_argument("--prefill-min-length", type=int, default=4096, help="prompts shorter than this prefill densely (default 4096: twice the break-even measured on a 2-core CPU)")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("search-patterns", help="offline per-head MInference pattern search; writes a pattern config")
    s.add_argument("--model", help="Hugging Face model directory or .gguf file (default: the embedded model)")
    s.add_argument("--length", type=int, default=8192, help="calibration prompt length in tokens (default 8192; sizes are absolute, so a config is sparser at longer prompts and denser at shorter ones)")
    s.add_argument("--density", default="0.1,0.2,0.35,0.5,0.65,0.8", help="cost levels: executed cost of the candidates as fractions of dense attention at --length, tried cheapest first (default 0.1,0.2,0.35,0.5,0.65,0.8)")
    s.add_argument("--max-error", type=float, default=0.05, help="a head takes the cheapest level whose best pattern's relative output error is <= this, else stays dense (default 0.05)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tag", help="model name substring the shipped config matches (packaging only)")
    s.add_argument("--out", required=True, help="output JSON file")
    model_options(s)
    s.set_defaults(func=cmd_search_patterns)

    d = sub.add_parser("demo", help="pass-key retrieval on a long context with every method")
    d.add_argument("--model")
    d.add_argument("--keep", type=float, default=0.2, help="budget for the compressing methods (default 0.2)")
    d.add_argument("--quality", type=float, help="instead of --keep: per method, the smallest budget calibrated to keep "
                                                 "agreement with the full cache >= this, in (0, 1] (docs/autobudget.md)")
    d.add_argument("--calibration", help="calibration JSON for --quality (default: the one shipped for the model)")
    d.add_argument("--length", type=int, default=3000, help="context length in tokens (default 3000)")
    d.add_argument("--depth", type=float, default=0.5)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--methods", help="comma-separated methods (default: all registered that act on text)")
    d.add_argument("--plain-prompt", action="store_true",
                   help="kvtrim's plain prompt format (User: ... / Assistant:) even if the model has a chat template")
    model_options(d)
    d.set_defaults(func=cmd_demo)

    from kvtrim.cli_session import add_session_commands

    add_session_commands(sub)  # chat, stream
    from kvtrim.cli_eval import add_eval_commands
    from kvtrim.cli_models import add_model_commands

    add_eval_commands(sub)  # eval, report, bench
    add_model_commands(sub)  # models
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.verbose:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    try:
        return args.func(args)
    except KVTrimError as e:
        print(f"kvtrim: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtrim: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
