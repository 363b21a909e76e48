"""``kvtrim chat`` and ``kvtrim stream``: sessions from the command line.

``chat`` reads user turns from standard input (one line per turn), streams each reply to standard
output as it is generated, and prints the KV memory in use to standard error after each reply.
Lines starting with ``/`` are commands: ``/save DIR``, ``/stats``, ``/quit``.

``stream`` feeds a text file through a session chunk by chunk and reports, per chunk, the chunk's
perplexity, resident KV bytes, process RSS and tokens/s (``--json``: one JSON object per line),
with a progress bar on standard error.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from kvtrim.cli.common import (
    check_model_options,
    check_quality_args,
    fraction_arg,
    int_arg,
    kv_bits_option,
    load_from_args,
    model_options,
    print_error,
    quality_bits,
    quality_choice,
    sampling_options,
)
from kvtrim.errors import KVTrimError

#: the method of ``kvtrim chat`` and ``kvtrim stream`` without --method: ``tova``, the best method that
#: can stream on the multi-turn chat at a fixed budget (the reference model: 0.475 / 0.800 of the turns
#: at 512 / 1024 tokens against inf_mllm's 0.100 / 0.250; the embedded model, where every method
#: answers few, slightly below inf_mllm), and level with inf_mllm on a running text stream (perplexity
#: and speed). docs/methods.md, "Measured: kvtrim chat's default at bounded memory", has the tables.
DEFAULT_METHOD = "tova"
#: chat's method under --quality without --method when the model's calibration has no DEFAULT_METHOD
#: (one made before tova, a user's own: the shipped calibrations hold tova since 2026-12-06): the
#: previous default, which such calibrations hold
QUALITY_FALLBACK = "inf_mllm"


def _chat_method(args) -> str:
    """``--method``, else DEFAULT_METHOD; under --quality, QUALITY_FALLBACK where the calibration has no
    DEFAULT_METHOD (said on stderr; a missing calibration is left to --quality's own error)."""
    if args.method:
        return args.method
    if getattr(args, "quality", None) is not None:
        from kvtrim.budget import calibration_for

        try:
            methods = calibration_for(args.model, getattr(args, "calibration", None)).methods
        except KVTrimError:
            return DEFAULT_METHOD
        if DEFAULT_METHOD not in methods and QUALITY_FALLBACK in methods:
            print(f"kvtrim: --quality: the calibration has no {DEFAULT_METHOD} (chat's default) yet; using "
                  f"{QUALITY_FALLBACK}, which it holds (--method to choose)", file=sys.stderr)
            return QUALITY_FALLBACK
    return DEFAULT_METHOD


def _policy(args, streaming: bool):
    """The session's policy from the arguments; without --keep/--max-tokens the method's default budget
    (``Policy.default_max_tokens``, 1024) applies, as everywhere."""
    from kvtrim.registry import check_text_prompt, create_policy, get_policy_class, split_method

    name, kw = split_method(args.method)  # "snapkv:chunk=8": parameters as kvtrim eval's --methods takes them
    cls = get_policy_class(name)
    for flag, key in (("--keep", "keep"), ("--max-tokens", "max_tokens"), ("--position", "position")):
        if key in kw:
            raise KVTrimError(f"--method {args.method!r}: give {key} with {flag}, not as a method parameter")
    if getattr(args, "keep", None) is not None:
        kw["keep"] = args.keep
    if getattr(args, "quality", None) is not None:
        check_quality_args(args, name)
        # a conversation's length is not known in advance: the largest pick over the calibrated lengths
        choice = quality_choice(args, name, args.model, None)
        kw["keep"] = choice.keep
        args.kv_bits = quality_bits(args, choice)  # the calibration's bit width where it picks one
    if args.max_tokens is not None:
        kw["max_tokens"] = args.max_tokens
    if args.position:
        kw["position"] = args.position
    elif cls.supports_streaming and cls.takes_budget:
        kw["position"] = "reassigned"  # so the session can outrun the model's context
    pol = check_text_prompt(create_policy(name, **kw))  # sessions are text: no image spans
    if streaming and pol.needs_reconstruction:
        raise KVTrimError(f"method {args.method!r} scores a whole first message by reconstructing it; `kvtrim stream` "
                          "feeds chunks: use a streaming method (tova, streaming_llm, inf_mllm)")
    if not pol.supports_turns:
        raise KVTrimError(f"method {args.method!r} does not support multi-turn sessions")
    if streaming and not pol.can_stream():
        raise KVTrimError(
            f"method {args.method!r} (position {pol.position_policy!r}, max_tokens {pol.max_tokens}) cannot stream: "
            f"streaming needs a method that supports it ({', '.join(streaming_methods())}), reassigned positions "
            "and --max-tokens"
        )
    return pol


def streaming_methods() -> list[str]:
    """The registered methods that can run past the model's context (``Policy.supports_streaming``)."""
    from kvtrim.registry import get_policy_class, method_names

    return [m for m in method_names() if get_policy_class(m).supports_streaming]


def describe_policy(policy) -> str:
    """A policy as people read it: ``inf_mllm (max_tokens=1024, position=reassigned, ...)``."""
    params = [f"{k}={v}" for k, v in policy.describe().items() if k != "method" and v is not None]
    return f"{policy.name} ({', '.join(params)})" if params else policy.name


def _json(d: dict) -> str:
    """Strict JSON: a value that is not a number (a perplexity with nothing scored) is null, not NaN."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}, allow_nan=False)


def _mib(n: int) -> str:
    """Bytes as MiB, or KiB below one MiB (a small model's or a short chat's cache reads as more than 0.0)."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def cmd_chat(args) -> int:
    from transformers import TextStreamer

    from kvtrim.session import Session
    from kvtrim.session_file import check_save_target

    if args.save:
        check_save_target(args.save)  # before the model loads and the conversation starts
    if args.load:
        given = [f"--{n.replace('_', '-')}" for n in ("method", "keep", "quality", "max_tokens", "position") if getattr(args, n) is not None]
        given += ["--plain-prompt"] if args.plain_prompt else []
        if given:
            raise KVTrimError(
                f"--load continues a saved session with the method, budget and prompt format it was saved with; {', '.join(given)} "
                "cannot change them (start a new chat without --load to use another method)")
        if not Path(args.load).is_dir():
            raise KVTrimError(f"session directory {args.load!r} does not exist")
        if args.model is None:  # the model the session was saved with (its manifest's source), else the default
            from kvtrim.session_file import saved_model_source

            args.model = saved_model_source(args.load)
    else:
        args.method = _chat_method(args)
    policy = None if args.load else _policy(args, streaming=False)
    if args.max_new_tokens < 1:
        raise KVTrimError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.sample and not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise KVTrimError(f"--temperature must be a finite number > 0, got {args.temperature!r}")
    check_model_options(args)
    lm = load_from_args(args)
    if policy is None:
        s = Session.load(args.load, lm.model, lm.tokenizer, kv_bits=args.kv_bits)
    else:
        s = Session(lm.model, lm.tokenizer, policy, seed=args.seed, plain=args.plain_prompt,
                    kv_bits=16 if args.kv_bits is None else args.kv_bits)
    interactive = sys.stdin.isatty()
    print(f"kvtrim chat: {lm.source}, method {describe_policy(s.policy)}; /save DIR, /stats, /quit", file=sys.stderr)

    def stats() -> str:
        c = s.cache
        # resident counts the buffers' spare room for the next tokens too (a short chat's resident
        # bytes can exceed the uncompressed cache's): the stored tokens' own bytes are told apart
        return (f"[KV {_mib(c.kv_bytes())} resident, {_mib(c.kv_bytes_stored())} of it stored tokens "
                f"(uncompressed: {_mib(c.kv_bytes_full())}); {s.stored()} tokens stored of {s.seen} seen]")

    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        command, _, rest = text.strip().partition(" ")
        if command in ("/quit", "/exit") and not rest:
            break
        if command == "/save":
            target = rest.strip() or args.save
            if not target:
                print_error("/save needs a directory")
                continue
            try:
                s.save(target)  # atomic; SessionError for a target it refuses or cannot write
            except (KVTrimError, OSError) as e:  # the conversation goes on; nothing is lost
                print_error(f"could not save to {target!r}: {e}")
                continue
            print(f"[saved to {target}]", file=sys.stderr)
            continue
        if command == "/stats" and not rest:
            print(stats(), file=sys.stderr)
            continue
        if not text.strip():
            print_error("the turn is empty; type a message (or /quit)")
            continue
        streamer = TextStreamer(lm.tokenizer, skip_special_tokens=True)
        s.send(text, max_new_tokens=args.max_new_tokens, do_sample=args.sample, temperature=args.temperature,
               top_p=args.top_p, top_k=args.top_k, streamer=streamer)
        sys.stdout.flush()
        print(stats(), file=sys.stderr)
    if args.save:
        s.save(args.save)
        print(f"[saved to {args.save}]", file=sys.stderr)
    return 0


def cmd_stream(args) -> int:
    from tqdm import tqdm

    from kvtrim.session import Session, peak_rss_bytes
    from kvtrim.session_file import check_save_target
    from kvtrim.textio import read_text_file

    if args.save:
        check_save_target(args.save)  # before the model loads and the file is streamed
    if args.chunk < 1:
        raise KVTrimError(f"--chunk must be a positive number of tokens, got {args.chunk}")
    if args.limit is not None and args.limit < 1:
        raise KVTrimError(f"--limit must be a positive number of tokens, got {args.limit}")
    text = read_text_file(args.file, "file")
    policy = _policy(args, streaming=True)
    check_model_options(args)
    lm = load_from_args(args)
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    if args.limit is not None:
        ids = ids[: args.limit]
    s = Session(lm.model, lm.tokenizer, policy, kv_bits=args.kv_bits)
    nll = scored = 0.0
    seconds = 0.0
    bar = tqdm(total=len(ids), unit="tok", unit_scale=True, file=sys.stderr, disable=args.no_progress)
    for st in s.feed_ids_iter(ids, chunk=args.chunk):
        nll += st.nll_sum
        scored += st.scored
        seconds += st.seconds
        if args.json:
            print(_json(st.to_dict()), flush=True)
        bar.update(st.tokens)
        bar.set_postfix(ppl=f"{st.ppl:.1f}", kv=_mib(st.kv_bytes), refresh=False)
    bar.close()
    summary = {"summary": True, "method": policy.name, "tokens": s.seen, "chunks": s.chunks_fed,
               "ppl": math.exp(nll / scored) if scored else float("nan"),
               "kv_bytes": s.cache.kv_bytes(), "kv_bytes_full": s.cache.kv_bytes_full(),
               "peak_rss_bytes": peak_rss_bytes(), "tokens_per_s": s.seen / seconds if seconds else float("nan")}
    if args.save:
        s.save(args.save)
    if args.json:
        print(_json(summary))
    else:
        print(f"{summary['tokens']} tokens in {summary['chunks']} chunks with {policy.name}: perplexity {summary['ppl']:.2f}, "
              f"KV {_mib(summary['kv_bytes'])} resident (uncompressed: {_mib(summary['kv_bytes_full'])}), "
              f"peak RSS {_mib(summary['peak_rss_bytes'])}, {summary['tokens_per_s']:.0f} tokens/s")
    return 0


def add_session_commands(sub) -> None:
    """Add the ``chat`` and ``stream`` sub-commands to kvtrim's parser."""
    from kvtrim.cli.generate import method_help
    from kvtrim.policies.base import DEFAULT_MAX_TOKENS, POSITION_POLICIES

    c = sub.add_parser("chat", help="interactive multi-turn chat over a bounded cache (one line per turn)",
                       description="Chat over a bounded KV cache: one line per turn on stdin, the reply on stdout, the "
                                   "KV memory in use on stderr; /save DIR, /stats, /quit.")
    model_options(c)
    m = c.add_argument_group("method and budget")
    m.add_argument("--method", metavar="NAME[:K=V...]",
                   help=method_help(f"{DEFAULT_METHOD}; a method that supports turns; parameters as in kvtrim eval's "
                                    "--methods, e.g. snapkv:chunk=8"))
    g = m.add_mutually_exclusive_group()
    g.add_argument("--max-tokens", type=int_arg(1), metavar="N",
                   help=f"tokens kept per layer and KV head [default: {DEFAULT_MAX_TOKENS}, the methods' default budget]")
    g.add_argument("--keep", type=fraction_arg(), metavar="R", help="fraction of the tokens seen to keep, instead of a fixed budget")
    g.add_argument("--quality", type=fraction_arg(), metavar="Q",
                   help="target agreement with the full cache: the budget calibrated to reach it, the largest over the "
                        "calibrated prompt lengths (docs/autobudget.md)")
    m.add_argument("--calibration", metavar="FILE", help="calibration JSON for --quality [default: the one shipped for the model]")
    m.add_argument("--position", metavar="POLICY",
                   help=f"positions of the kept tokens: {', '.join(POSITION_POLICIES)} [default: reassigned for a "
                        "streaming method, else the method's]")
    kv_bits_option(m, default=None, extra=" [default: 16; with --load, the saved session's, which is the only one "
                                          "it loads with]")
    d = c.add_argument_group("generation")
    d.add_argument("--max-new-tokens", type=int_arg(1, unit="tokens"), default=256, metavar="N", help="longest reply in tokens")
    sampling_options(d, temperature=0.7)
    d.add_argument("--plain-prompt", action="store_true",
                   help="turns in kvtrim's plain prompt format (User: ... / Assistant:) even if the model has a chat "
                        "template (used anyway for a model without one)")
    o = c.add_argument_group("session")
    o.add_argument("--load", metavar="DIR", help="continue a session saved in this directory (its model too, unless --model)")
    o.add_argument("--save", metavar="DIR", help="save the session into this directory at the end")
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("stream", help="feed a long text file through a bounded cache, chunk by chunk",
                       description="Feed a long text file through a bounded KV cache, chunk by chunk; per chunk: "
                                   "perplexity, resident KV bytes, process memory, tokens/s.")
    s.add_argument_group("input").add_argument("--file", required=True, help="UTF-8 text file")
    model_options(s)
    m = s.add_argument_group("method and budget")
    m.add_argument("--method", default=DEFAULT_METHOD, metavar="NAME[:K=V...]",
                   help=method_help(f"{DEFAULT_METHOD}; a method that can stream: {', '.join(streaming_methods())}; "
                                    "parameters as in kvtrim eval's --methods"))
    m.add_argument("--max-tokens", type=int_arg(1), metavar="N",
                   help=f"tokens kept per layer and KV head [default: {DEFAULT_MAX_TOKENS}, the methods' default budget]")
    m.add_argument("--position", metavar="POLICY",
                   help=f"positions of the kept tokens: {', '.join(POSITION_POLICIES)} [default: reassigned]")
    kv_bits_option(m)
    f = s.add_argument_group("feeding")
    f.add_argument("--chunk", type=int_arg(1, unit="tokens"), default=512, metavar="N", help="tokens per chunk")
    f.add_argument("--limit", type=int_arg(1, unit="tokens"), metavar="N",
                   help="stop after this many tokens of the file [default: the whole file]")
    o = s.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object per chunk, then a summary object")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--save", metavar="DIR", help="save the session into this directory at the end")
    s.set_defaults(func=cmd_stream)
