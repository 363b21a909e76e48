"""``kvtrim methods`` (the registered KV methods) and ``kvtrim demo`` (pass-key retrieval on a long
context with each of them)."""

from __future__ import annotations

import json
import sys

from kvtrim.cli.common import (
    check_model_options,
    fraction_arg,
    int_arg,
    kv_bits_option,
    load_from_args,
    model_options,
    quality_bits,
    quality_choice,
    seed_arg,
)


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
    policies = []  # (policy, kv_bits)
    for n in names:
        kw = {"keep": args.keep} if get_policy_class(n).takes_budget else {}
        bits = args.kv_bits
        if args.quality is not None and get_policy_class(n).takes_budget:  # picked at the demo's length
            choice = quality_choice(args, n, args.model, args.length)
            bits = quality_bits(args, choice)
            kw = {} if choice.whole else {"keep": choice.keep}
            n = n if kw else "full"
        policies.append((check_text_prompt(create_policy(n, **kw)), bits))
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
    for pol, bits in tqdm(policies, desc="methods", unit="method", file=sys.stderr):
        r = generate_ids(lm.model, lm.tokenizer, ids, pol, max_new_tokens=16, kv_bits=bits)
        # a bit width --quality picked (not the one --kv-bits gave every method) is named with the method
        rows.append((pol.name if bits == args.kv_bits else f"{pol.name}@{bits}bit", key in r.answer, r))
    print()
    w = max(15, *(len(name) + 2 for name, _, _ in rows))  # a long method name keeps its column apart
    print(f"{'method':<{w}}{'correct':<9}{'KV MiB':>8}{'of full':>9}{'prefill s':>11}{'decode tok/s':>14}  answer")
    for name, ok, r in rows:
        print(
            f"{name:<{w}}{'yes' if ok else 'no':<9}{r.kv_bytes / 2**20:>8.1f}{r.kv_bytes / r.kv_bytes_full:>9.0%}"
            f"{r.prefill_seconds:>11.2f}{r.decode_tokens_per_s:>14.1f}  {r.answer[:40]!r}"
        )
    print(f"\npass key: {key}; KV MiB = resident key/value buffers at the end (1 MiB = 2^20 bytes); of full = that "
          "over what transformers' DynamicCache holds for the same tokens (kvtrim's buffers keep room for tokens to come)")
    return 0


def add_methods_command(sub) -> None:
    """Add the ``methods`` sub-command to kvtrim's parser."""
    m = sub.add_parser("methods", help="list the registered KV methods")
    m.add_argument("--json", action="store_true", help="print the list as JSON (name, description)")
    m.set_defaults(func=cmd_methods)


def add_demo_command(sub) -> None:
    """Add the ``demo`` sub-command to kvtrim's parser."""
    from kvtrim.eval.common import MIN_LENGTH

    d = sub.add_parser("demo", help="pass-key retrieval on a long context with every method",
                       description="Hide a 5-digit pass key in a long context and ask for it with each method: "
                                   "whether it was found, the resident KV memory, prefill time and decode speed.")
    model_options(d)
    m = d.add_argument_group("methods and budget")
    m.add_argument("--methods", metavar="A,B", help="comma-separated methods [default: all registered that act on text]")
    m.add_argument("--keep", type=fraction_arg(), default=0.2, metavar="R", help="budget of the compressing methods")
    m.add_argument("--quality", type=fraction_arg(), metavar="Q",
                   help="instead of --keep: per method, the smallest budget calibrated to keep agreement with the full "
                        "cache at or above Q (docs/autobudget.md)")
    m.add_argument("--calibration", metavar="FILE", help="calibration JSON for --quality [default: the one shipped for the model]")
    kv_bits_option(m)
    t = d.add_argument_group("task")
    t.add_argument("--length", type=int_arg(MIN_LENGTH, unit="tokens"), default=3000, metavar="N", help="context length in tokens")
    t.add_argument("--depth", type=fraction_arg(allow_zero=True), default=0.5, metavar="D",
                   help="where the pass key sits (0: start, 1: end)")
    t.add_argument("--seed", type=seed_arg(), default=0, metavar="S", help="seed of the context and the pass key")
    t.add_argument("--plain-prompt", action="store_true",
                   help="kvtrim's plain prompt format (User: ... / Assistant:) even if the model has a chat template")
    d.set_defaults(func=cmd_demo)
