"""``kvtrim generate --prompts-file FILE``: several prompts generated together (batch > 1).

The file holds one prompt per line, in one of two formats chosen by its name:

* ``*.jsonl``: one JSON object per line with ``question`` (the chat template is applied, as with
  ``--question``) or ``prompt`` (raw text, as with ``--prompt``), and optionally ``method``,
  ``keep``, ``max_tokens``, ``position`` (this line's KV method, replacing the command line's;
  a line that names a ``method`` takes only its own budget fields, the method's default without
  them), ``max_new_tokens`` and ``id`` (any JSON value, echoed in the output);
* any other name: plain UTF-8 text, each line one question (``--plain-prompt`` applies).

Blank lines are skipped (line numbers in messages and output count every line). ``--context-file``
is prepended to every prompt. The output is one JSON object per prompt on stdout, in the file's
order, UTF-8: ``{"line": N, "answer": ...}`` (``id`` when the line had one), or with ``--json`` every
field of ``generate --json`` as well. Bad input (an empty file, a line that is not valid JSON, an
unknown field, a prompt longer than the model's context) stops before any generation with one
``kvtrim: error:`` line that names the line.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtrim.cli.common import check_model_options, load_from_args, prefill_from_args, read_context
from kvtrim.errors import KVTrimError

#: the fields a JSONL line may have
FIELDS = ("question", "prompt", "method", "keep", "max_tokens", "position", "max_new_tokens", "id")


@dataclass
class PromptLine:
    """One prompt of a prompts file: its 1-based line number, text, and per-line settings."""

    line: int
    text: str
    chat: bool = True  # a question (chat template) or a raw prompt
    method: dict = field(default_factory=dict)  # method/keep/max_tokens/position given on the line
    max_new_tokens: int | None = None
    id: Any = None
    has_id: bool = False


def read_prompts_file(path: str) -> list[PromptLine]:
    """Parse a prompts file (see the module docstring); ``KVTrimError`` names the file and the line."""
    from kvtrim.textio import read_text_file

    text = read_text_file(path, "prompts file")
    jsonl = Path(path).suffix.lower() == ".jsonl"
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"prompts file {path!r} line {n}"
        if not jsonl:
            out.append(PromptLine(n, raw.strip()))
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise KVTrimError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line of a .jsonl file is "
                              'one object such as {"question": "..."}') from None
        if not isinstance(obj, dict):
            raise KVTrimError(f'{where}: expected a JSON object such as {{"question": "..."}}, got {type(obj).__name__}')
        unknown = sorted(set(obj) - set(FIELDS))
        if unknown:
            raise KVTrimError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(FIELDS)}")
        if ("question" in obj) == ("prompt" in obj):
            raise KVTrimError(f'{where}: give exactly one of "question" (chat template applied) or "prompt" (raw text)')
        key = "question" if "question" in obj else "prompt"
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise KVTrimError(f'{where}: "{key}" must be a non-empty string')
        limit = obj.get("max_new_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise KVTrimError(f'{where}: "max_new_tokens" must be an integer >= 0, got {limit!r}')
        method = {k: obj[k] for k in ("method", "keep", "max_tokens", "position") if k in obj}
        out.append(PromptLine(n, obj[key], key == "question", method, limit, obj.get("id"), "id" in obj))
    if not out:
        raise KVTrimError(f"prompts file {path!r} holds no prompt")
    return out


def line_policy(args, p: PromptLine):
    """The line's policy: its own method fields over the command line's (a named method takes only its own budget)."""
    from kvtrim.registry import check_text_prompt, create_policy

    if "method" in p.method:
        kw = dict(p.method)
        name = kw.pop("method")
    else:
        name = args.method
        kw = {k: v for k, v in (("keep", args.keep), ("max_tokens", args.max_tokens), ("position", args.position))
              if v is not None}
        if "keep" in p.method or "max_tokens" in p.method:
            kw.pop("keep", None), kw.pop("max_tokens", None)
        kw.update(p.method)
    if not isinstance(name, str):
        raise KVTrimError(f'"method" must be a method name (see `kvtrim methods`), got {name!r}')
    for k in ("keep", "max_tokens"):
        v = kw.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and math.isnan(v))):
            raise KVTrimError(f'"{k}" must be a number, got {v!r}')
    return check_text_prompt(create_policy(name, **kw))


def write_line(d: dict) -> None:
    """One JSON object per line on stdout, UTF-8 whatever the locale."""
    line = json.dumps(d, ensure_ascii=False) + "\n"
    buf = getattr(sys.stdout, "buffer", None)
    if buf is None:
        sys.stdout.write(line)
    else:
        sys.stdout.flush()
        buf.write(line.encode("utf-8"))
        buf.flush()


def cmd_generate_batch(args) -> int:
    """``kvtrim generate --prompts-file FILE``."""
    from kvtrim.decoding import check_prefill_chunk, max_context
    from kvtrim.generation import check_prompt, generate_batch
    from kvtrim.models import build_prompt_ids
    from kvtrim.validate import integer, number

    if getattr(args, "image", None):
        raise KVTrimError("--prompts-file takes text prompts; --image runs one prompt at a time")
    if getattr(args, "quality", None) is not None:
        raise KVTrimError("--quality is not supported with --prompts-file; give each line its own \"keep\" (or --keep for all)")
    check_model_options(args)  # a bad --dtype/--device is refused before the file is read
    integer(args.max_new_tokens, "--max-new-tokens", minimum=0, unit="tokens")
    integer(args.max_rows, "--max-rows", minimum=1)
    if args.sample:
        number(args.temperature, "--temperature", minimum=0, min_open=True)
    prefill_from_args(args)
    lines = read_prompts_file(args.prompts_file)
    policies = []
    for p in lines:
        try:
            policies.append(line_policy(args, p))
            check_prefill_chunk(policies[-1], args.prefill_chunk)
        except KVTrimError as e:
            raise KVTrimError(f"prompts file {args.prompts_file!r} line {p.line}: {e}") from None
    if args.plain_prompt and not all(p.chat for p in lines):
        raise KVTrimError('--plain-prompt formats questions; a "prompt" line is raw text')
    context = read_context(args.context_file)
    lm = load_from_args(args)
    prefill = prefill_from_args(args, lm.model)
    max_ctx = max_context(lm.model)
    prompts, limits = [], []
    for p, policy in zip(lines, policies):
        text = f"{context}\n\n{p.text}" if context else p.text
        ids = build_prompt_ids(lm.tokenizer, text, chat=p.chat, plain=args.plain_prompt and p.chat)
        limit = args.max_new_tokens if p.max_new_tokens is None else p.max_new_tokens
        try:
            check_prompt(policy, len(ids), limit, max_ctx)
        except KVTrimError as e:
            raise KVTrimError(f"prompts file {args.prompts_file!r} line {p.line}: {e}") from None
        prompts.append(ids)
        limits.append(limit)
    t0 = time.perf_counter()
    results = generate_batch(lm.model, lm.tokenizer, prompts, policies, max_new_tokens=limits, do_sample=args.sample,
                             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                             prefill=prefill, max_rows=args.max_rows, progress=not args.no_progress,
                             prefill_chunk=args.prefill_chunk, kv_bits=args.kv_bits)
    wall = time.perf_counter() - t0
    for p, res in zip(lines, results):
        d: dict = {"line": p.line}
        if p.has_id:
            d["id"] = p.id
        if args.json:
            full = res.to_dict()
            full.pop("token_ids")
            stats = full.pop("prefill") or {"prefill": "dense", "density": 1.0, "fallback": None}
            full["model"] = lm.source
            full["prefill"] = {k: v for k, v in stats.items() if k != "prefill"} | {"mode": stats["prefill"]}
            full["attention_density"] = stats["density"]
            # a row that decoded no step has no decode speed: null, not NaN (which is not JSON)
            d |= {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in full.items()}
        else:
            d["answer"] = res.answer
        write_line(d)
    new = sum(r.new_tokens for r in results)
    print(f"[batch] {len(results)} prompts ({sum(r.prompt_tokens for r in results)} prompt tokens), {new} new tokens in "
          f"{wall:.2f}s: {new / wall if wall > 0 else float('nan'):.1f} new tok/s in total "
          f"(prefill {sum(r.prefill_seconds for r in results):.2f}s, decode {sum(r.decode_seconds for r in results):.2f}s)",
          file=sys.stderr)
    return 0

