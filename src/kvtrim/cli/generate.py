"""``kvtrim generate``: answer a question or continue a prompt with a compressed cache.

One prompt (``--question`` / ``--prompt``, optionally ``--image`` for a vision-language model) is
handled here; several (``--prompts-file``) go to :mod:`kvtrim.cli.batch`. Every option is checked
before the model loads; the policy is built once: from ``--keep``/``--max-tokens`` before the
load, or with ``--quality`` once the prompt's length, which picks the budget, is known.
"""

from __future__ import annotations

import json
import sys

from kvtrim.cli.common import (
    check_model_options,
    check_quality_args,
    fraction_arg,
    int_arg,
    kv_bits_option,
    load_from_args,
    model_options,
    prefill_from_args,
    quality_bits,
    quality_choice,
    read_context,
    sampling_options,
    size_arg,
)
from kvtrim.errors import KVTrimError
from kvtrim.validate import integer, number


def _policy_from_args(args):
    """The policy of --method with --keep/--max-tokens and --position (not with --quality: its budget
    needs the prompt)."""
    from kvtrim.registry import create_policy

    kw = {}
    if args.keep is not None:
        kw["keep"] = args.keep
    if args.max_tokens is not None:
        kw["max_tokens"] = args.max_tokens
    if getattr(args, "position", None):
        kw["position"] = args.position
    return create_policy(args.method, **kw)


def cmd_generate(args) -> int:
    from kvtrim.decoding import check_prefill_chunk
    from kvtrim.generation import generate_ids
    from kvtrim.models import build_prompt_ids
    from kvtrim.registry import check_text_prompt, create_policy, get_policy_class

    if args.prompts_file is not None:  # several prompts together (batch > 1)
        from kvtrim.cli.batch import cmd_generate_batch

        return cmd_generate_batch(args)
    image = bool(getattr(args, "image", None))
    # everything is checked before the slow model load
    if args.quality is None:
        policy = _policy_from_args(args)
    else:  # the policy is built once the prompt's length has picked its budget
        check_quality_args(args, args.method)
        policy = None
    check_model_options(args)
    prefill_from_args(args)
    integer(args.max_new_tokens, "--max-new-tokens", minimum=0, unit="tokens")
    if args.sample:
        number(args.temperature, "--temperature", minimum=0, min_open=True)
    if args.plain_prompt and (args.prompt is not None or image):
        raise KVTrimError("--plain-prompt formats a --question for a text model; --prompt is raw text and --image "
                          "uses the model's processor")
    if image and args.quality is not None:
        raise KVTrimError("--quality is calibrated on text prompts; with --image give a budget (--keep/--max-tokens)")
    if not image:
        if policy is not None:
            check_text_prompt(policy)  # a method that needs image spans would run as full
    elif args.prefill_chunk is not None:
        raise KVTrimError("--prefill-chunk feeds a text prompt in pieces; image inputs need the prompt in one prefill")
    chunk = check_prefill_chunk(get_policy_class(args.method) if policy is None else policy, args.prefill_chunk)
    context = read_context(args.context_file)
    if image:
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
    prefill = prefill_from_args(args, lm.model)
    ids = build_prompt_ids(lm.tokenizer, text, chat=chat, plain=args.plain_prompt)
    choice = None
    if policy is None:  # --quality: the budget calibrated for this prompt's length
        choice = quality_choice(args, args.method, lm, len(ids))
        args.kv_bits = quality_bits(args, choice)  # the calibration's bit width where it picks one
        kw = {"position": args.position} if args.position else {}
        policy = create_policy("full") if choice.whole else create_policy(args.method, keep=choice.keep, **kw)
    res = generate_ids(
        lm.model,
        lm.tokenizer,
        ids,
        policy,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        prefill=prefill,
        prefill_chunk=chunk,
        kv_bits=args.kv_bits,
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


def method_help(default: str) -> str:
    """``--method``'s help: every registered method by name, and the default."""
    from kvtrim.registry import method_names

    return f"KV method: {', '.join(method_names())} (`kvtrim methods` says what each keeps) [default: {default}]"


def budget_args(g, *, fastv: bool = True) -> None:
    """``--keep`` / ``--max-tokens`` / ``--quality`` (one of them) and ``--calibration``, in the group ``g``."""
    from kvtrim.policies.base import DEFAULT_MAX_TOKENS

    b = g.add_mutually_exclusive_group()
    b.add_argument("--keep", type=fraction_arg(), metavar="R",
                   help="fraction of the tokens seen to keep" + (" (fastv: of the image tokens)" if fastv else ""))
    b.add_argument("--max-tokens", type=int_arg(1), metavar="N",
                   help=f"tokens to keep per layer and KV head [default: {DEFAULT_MAX_TOKENS} for a compressing method "
                        "given no budget; hae: none]")
    b.add_argument("--quality", type=fraction_arg(), metavar="Q",
                   help="target agreement with the full cache: the smallest budget calibrated to reach it for this "
                        "method, model and prompt length (docs/autobudget.md)")
    g.add_argument("--calibration", metavar="FILE", help="calibration JSON for --quality, made by kvtrim calibrate "
                                                         "[default: the one shipped for the model]")


def prefill_options(sp):
    """The group ``prefill`` of ``generate``: sparse prefill (MInference) and chunked prefill."""
    from kvtrim.decoding import MIN_PREFILL_CHUNK
    from kvtrim.integrations.prefill import DEFAULT_MIN_LENGTH, PREFILL_MODES

    g = sp.add_argument_group("prefill", "how the prompt is read: sparse attention (MInference), in chunks")
    g.add_argument("--prefill", default="dense", metavar="MODE",
                   help=f"prefill attention: {', '.join(PREFILL_MODES)} (minference: per-head patterns from a config; "
                        "the others: one pattern for every head; docs/minference.md)")
    g.add_argument("--pattern-config", metavar="FILE",
                   help="per-head pattern config for --prefill minference [default: the one shipped for the model]")
    g.add_argument("--prefill-size", action="append", type=size_arg, metavar="KEY=VALUE",
                   help="pattern size for a single-pattern mode, e.g. k_b=32 (repeatable)")
    g.add_argument("--prefill-min-length", type=int_arg(1, unit="tokens"), default=DEFAULT_MIN_LENGTH, metavar="N",
                   help="prompts shorter than this prefill densely (docs/minference.md says why at this length)")
    g.add_argument("--prefill-chunk", type=int_arg(MIN_PREFILL_CHUNK, unit="tokens"), metavar="N",
                   help="feed the prompt in chunks of N tokens, compressing after each (the cache holds at most the "
                        "budget + one chunk; docs/memory.md) [default: one forward]")
    return g


def add_generate_command(sub) -> None:
    """Add the ``generate`` sub-command to kvtrim's parser."""
    from kvtrim.policies.base import POSITION_POLICIES

    g = sub.add_parser("generate", help="answer a question or continue a prompt with a compressed cache",
                       description="Answer a question (or continue a prompt, or run a file of prompts) with a "
                                   "compressed KV cache; the answer goes to stdout, the measurements to stderr.")
    model_options(g)
    i = g.add_argument_group("prompt")
    q = i.add_mutually_exclusive_group(required=True)
    q.add_argument("--question", help="a question (the chat template applied, or the plain format for a model without one)")
    q.add_argument("--prompt", help="raw prompt text to continue (no chat template)")
    q.add_argument("--prompts-file", metavar="FILE",
                   help="several prompts generated together as the rows of one batch, each with its own cache: a "
                        ".jsonl file (one object per line: question or prompt, optional method/keep/max_tokens/"
                        "position/max_new_tokens/id) or a text file of one question per line; prints one JSON "
                        "line per prompt, in order (docs/batch.md)")
    i.add_argument("--context-file", metavar="FILE", help="a UTF-8 text file put before the question or prompt")
    i.add_argument("--image", action="append", metavar="FILE", help="an image for a vision-language --model (repeatable)")
    i.add_argument("--plain-prompt", action="store_true",
                   help="format --question in kvtrim's plain prompt format (User: ... / Assistant:) even if the model "
                        "has a chat template (used anyway for a model without one)")
    m = g.add_argument_group("method and budget")
    m.add_argument("--method", default="full", metavar="NAME", help=method_help("full, no compression"))
    budget_args(m)
    m.add_argument("--position", metavar="POLICY",
                   help=f"positions of the kept tokens: {', '.join(POSITION_POLICIES)} [default: the method's]")
    kv_bits_option(m)
    prefill_options(g)
    d = g.add_argument_group("generation")
    d.add_argument("--max-new-tokens", type=int_arg(0, unit="tokens"), default=64, metavar="N", help="tokens to generate at most")
    sampling_options(d, temperature=1.0)
    d.add_argument("--max-rows", type=int_arg(1), default=64, metavar="N",
                   help="with --prompts-file: most rows decoded in one forward")
    o = g.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object (with --prompts-file: every field on each line)")
    o.add_argument("--no-progress", action="store_true", help="with --prompts-file: no progress bar")
    g.set_defaults(func=cmd_generate)
