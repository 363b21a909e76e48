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
    load_from_args,
    model_options,
    prefill_from_args,
    quality_choice,
    read_context,
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
        prefill_chunk=chunk,
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


def budget_args(sp) -> None:
    """``--keep`` / ``--max-tokens`` / ``--quality`` (one of them) and ``--calibration``."""
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--keep", type=float, help="fraction of tokens to keep, in (0, 1] (fastv: of the image tokens)")
    g.add_argument("--max-tokens", type=int, help="fixed number of tokens to keep per layer (a compressing method given "
                                                  "neither keeps 1024: kvtrim.policies.base.DEFAULT_MAX_TOKENS; hae: none)")
    g.add_argument("--quality", type=float, help="target agreement with the full cache in (0, 1]: the smallest budget "
                                                 "calibrated to reach it for this method, model and prompt length "
                                                 "(docs/autobudget.md)")
    sp.add_argument("--calibration", help="calibration JSON for --quality, made by kvtrim calibrate (default: the one "
                                          "shipped for the model)")


def add_generate_command(sub) -> None:
    """Add the ``generate`` sub-command to kvtrim's parser."""
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
