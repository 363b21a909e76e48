"""A long bounded-memory chat session: per-turn time early (turn 10) vs late (the last turns).

One :class:`kvtrim.session.Session` with a fixed-budget streaming method (``inf_mllm`` or
``streaming_llm`` with ``--max-tokens``, reassigned positions) takes ``--turns`` chat turns, each a
short user message and ``--new`` generated tokens (no stop token, so every turn decodes the same
number). The KV cache is bounded, so every turn does the same work; per-turn time that grows
with the turn number is the session's own bookkeeping growing (history, token lists, rendering).

The turns are timed one by one (wall time of ``Session.send``); the result reports the median of
each window of ``--window`` turns and compares the window starting at turn 10 with the last one.
``--tiny`` runs a tiny randomly initialised Llama with the embedded model's tokenizer and chat
template (the model's compute is small, so growth in the session's bookkeeping shows most);
without it, the embedded model (or ``--model``).

    python benchmarks/bench_long_session.py --tiny --turns 600 --threads 1 --out results/long_session.json
    python benchmarks/bench_long_session.py --table benchmarks/results/long_session/tiny_600.json

The JSON is rewritten every ``--window`` turns, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from kvtrim import harness

EARLY_TURN = 10


def windows(seconds: list[float], size: int) -> list[dict]:
    """Median, min and max turn time of each window of ``size`` turns (the last may be shorter)."""
    out = []
    for start in range(0, len(seconds), size):
        chunk = seconds[start:start + size]
        out.append({"first_turn": start, "turns": len(chunk), "median_ms": 1000 * statistics.median(chunk),
                    "min_ms": 1000 * min(chunk), "max_ms": 1000 * max(chunk)})
    return out


def summary(seconds: list[float], size: int) -> dict:
    """Early (the window from turn EARLY_TURN) vs late (the last full window) median turn time, and their ratio."""
    early = seconds[EARLY_TURN:EARLY_TURN + size]
    late = seconds[-size:]
    if len(seconds) < EARLY_TURN + 2 * size:
        return {"early_ms": None, "late_ms": None, "late_over_early": None}
    e, lt = statistics.median(early), statistics.median(late)
    return {"early_ms": 1000 * e, "late_ms": 1000 * lt, "late_over_early": lt / e,
            # the fastest turn of each window: what a turn costs when the shared machine's load spares it
            "early_min_ms": 1000 * min(early), "late_min_ms": 1000 * min(late), "late_over_early_min": min(late) / min(early),
            "early_turns": [EARLY_TURN, EARLY_TURN + size - 1], "late_turns": [len(seconds) - size, len(seconds) - 1]}


def table(r: dict) -> str:
    """Markdown table of a long-session result: one row per window of turns."""
    s = r["summary"]
    head = (f"{r['model']}, {r['method']} max_tokens {r['max_tokens']}, {r['turns_done']} turns of {r['new_tokens']} new "
            f"tokens, {r['threads']} thread(s); "
            + (f"median turn {s['early_ms']:.1f} ms at turns {s['early_turns'][0]}-{s['early_turns'][1]}, "
               f"{s['late_ms']:.1f} ms at turns {s['late_turns'][0]}-{s['late_turns'][1]} "
               f"(late / early {s['late_over_early']:.2f}; fastest turns {s['early_min_ms']:.1f} and {s['late_min_ms']:.1f} ms, "
               f"{s['late_over_early_min']:.2f})" if s["early_ms"] is not None else "too few turns to compare")
            + f"; load average {r['info']['loadavg_start'][0]:.1f} -> {r['info']['loadavg_end'][0]:.1f}.")
    rows = ["| turns | median ms | min ms | max ms | stored tokens | seen tokens |", "|---|---:|---:|---:|---:|---:|"]
    for w, st in zip(r["windows"], r["stored_seen"]):
        rows.append(f"| {w['first_turn']}-{w['first_turn'] + w['turns'] - 1} | {w['median_ms']:.1f} | {w['min_ms']:.1f} | "
                    f"{w['max_ms']:.1f} | {st[0]} | {st[1]} |")
    return head + "\n\n" + "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 parents=[harness.options(reps=None, warmup=None, threads=1)])
    ap.add_argument("--model", help="model directory, .gguf or reference model (default: the embedded model)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama with the embedded model's tokenizer")
    ap.add_argument("--method", default="inf_mllm", choices=["inf_mllm", "streaming_llm"])
    ap.add_argument("--max-tokens", type=int, default=256, help="KV budget per layer (default 256)")
    ap.add_argument("--turns", type=int, default=600)
    ap.add_argument("--new", type=int, default=8, help="tokens generated per turn (default 8)")
    ap.add_argument("--window", type=int, default=20, help="turns per reported window (default 20)")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    if args.turns < 1 or args.new < 1 or args.window < 1:
        ap.error("--turns, --new and --window must be positive")

    from kvtrim.models import load_model
    from kvtrim.session import Session

    info = harness.machine_record()
    if args.tiny:
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        from kvtrim.models import resolve_model

        tok = AutoTokenizer.from_pretrained(str(resolve_model(None)[0]))
        import torch

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                          num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        model, label = LlamaForCausalLM(cfg).eval(), "tiny random Llama (3 layers, hidden 96), SmolLM2 tokenizer"
    else:
        lm = load_model(args.model)
        model, tok, label = lm.model, lm.tokenizer, lm.source
    s = Session(model, tok, args.method, max_tokens=args.max_tokens, position="reassigned")
    seconds: list[float] = []
    stored_seen: list[list[int]] = []

    def write() -> None:
        result = {"benchmark": "long_session", "model": label, "method": args.method, "max_tokens": args.max_tokens,
                  "new_tokens": args.new, "threads": args.threads, "turns_requested": args.turns,
                  "turns_done": len(seconds), "window": args.window, "info": harness.finish_record(info),
                  "summary": summary(seconds, args.window), "windows": windows(seconds, args.window),
                  "stored_seen": stored_seen, "turn_ms": [round(1000 * x, 3) for x in seconds]}
        harness.write_json(args.out, result)

    for i in range(args.turns):
        t0 = time.perf_counter()
        s.send(f"Turn {i}: note that box {i % 97} holds {i * 7919 % 10000} coins. What does it hold?",
               max_new_tokens=args.new, stop_ids=())
        seconds.append(time.perf_counter() - t0)
        if (i + 1) % args.window == 0 or i + 1 == args.turns:
            stored_seen.append([s.stored(), s.seen])
            write()
            print(f"turn {i + 1}: {1000 * statistics.median(seconds[-args.window:]):.1f} ms (median of the last "
                  f"{min(args.window, len(seconds))}), stored {s.stored()} of {s.seen} seen", file=sys.stderr, flush=True)
    print(table(harness.read_result(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
