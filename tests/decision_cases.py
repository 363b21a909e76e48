"""Stored cases of every method's behaviour, to check that a change of how policies reach the storage
changes nothing they do.

Each case runs a tiny random Llama in float64 (so that the scores of two machines agree far beyond
any tie a ranking could break differently) through kvtrim's decode stepper: a prompt (in one
forward or in chunks), greedy decoding, a second turn and more decoding. What it records: the
generated tokens, and per compressed layer the stream index of every stored token per KV head
and the sums of its keys and values. ``tests/test_decision_replay.py`` replays every case and
compares with ``tests/data/decision_cases.json``, which was written by::

    .venv/bin/python tests/decision_cases.py --write tests/data/decision_cases.json

on the code before policies returned decisions (commit b2235d6), and must not be rewritten to
make that test pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

CASES: dict[str, dict] = {
    "full": {"method": "full"},
    "snapkv": {"method": "snapkv", "keep": 0.3},
    "snapkv_chunk_shared": {"method": "snapkv", "keep": 0.3, "chunk": 4, "per_head": False, "kernel": 3},
    "snapkv_max_tokens_chunked": {"method": "snapkv", "max_tokens": 48, "_chunk": 40},
    "h2o": {"method": "h2o", "keep": 0.3},
    "h2o_max_tokens": {"method": "h2o", "max_tokens": 40, "recent_ratio": 0.25},
    "h2o_reassigned": {"method": "h2o", "max_tokens": 40, "position": "reassigned"},
    "streaming_llm": {"method": "streaming_llm", "max_tokens": 40},
    "streaming_llm_true": {"method": "streaming_llm", "keep": 0.3, "position": "true"},
    "streaming_llm_compressed": {"method": "streaming_llm", "max_tokens": 40, "position": "compressed"},
    "inf_mllm": {"method": "inf_mllm", "max_tokens": 48, "decode_cap": 6},
    "inf_mllm_history": {"method": "inf_mllm", "max_tokens": 48, "history": 0.5, "bias": 0.5, "chunk": 2, "_chunk": 30},
    "inf_mllm_true": {"method": "inf_mllm", "keep": 0.4, "position": "true", "decode_cap": 4},
    "elastic": {"method": "elastic", "keep": 0.3},
    "elastic_max_tokens": {"method": "elastic", "max_tokens": 40, "distance": 8},
    "elastic_frequency": {"method": "elastic", "keep": 0.3, "eviction": "frequency", "importance": "mean"},
    "elastic_recent_drop": {"method": "elastic", "keep": 0.3, "eviction": "recent", "combine": "drop"},
    "elastic_proportional_align": {"method": "elastic", "keep": 0.3, "proportional": True, "align": True, "kernel": 3},
    "elastic_reassigned": {"method": "elastic", "keep": 0.3, "position": "reassigned", "importance": "query", "window": 8},
    # no second turn for FastV: a multi-token forward after FastV's pruning fails in transformers' mask
    # (its layers hold different lengths), before and after this change
    "fastv_prune": {"method": "fastv", "targets": ["document"], "_spans": True, "_turn": False},
    "fastv_kv": {"method": "fastv", "targets": ["document"], "mode": "kv", "ratio": 0.3, "_spans": True, "_turn": False},
    "hae_prune": {"method": "hae", "targets": ["document"], "max_tokens": 48, "r": 0.01, "alpha": 0.02, "_spans": True},
    "hae_kv": {"method": "hae", "targets": ["document"], "mode": "kv", "max_tokens": 48, "r": 0.01, "alpha": 0.02, "_spans": True},
}

PROMPT, TURN, DECODE = 97, 23, 9


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = LlamaForCausalLM(cfg).eval().to(torch.float64)
    model.set_attn_implementation("sdpa")
    return model


def run_case(model, spec: dict) -> dict:
    import kvtrim
    from kvtrim import decoding
    from kvtrim.cache import KVTrimCache

    params = {k: v for k, v in spec.items() if not k.startswith("_") and k != "method"}
    if "targets" in params:
        params["targets"] = tuple(params["targets"])
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 128, (PROMPT,), generator=g).tolist()
    turn = torch.randint(3, 128, (TURN,), generator=g).tolist()
    spans = [(20, 70, "document")] if spec.get("_spans") else None
    out: dict = {}
    with torch.inference_mode(), kvtrim.attach(model, fused_scores="never"):
        cache = KVTrimCache(model, spec["method"], spans=spans, **params)
        logits = decoding.run(model, decoding.prefill(cache, prompt, chunk=spec.get("_chunk")))
        tokens, _ = decoding.run(model, decoding.decode(cache, logits, DECODE))
        more: list[int] = []
        if spec.get("_turn", True):
            logits = decoding.run(model, decoding.prefill(cache, [tokens[-1], *turn]))
            more, _ = decoding.run(model, decoding.decode(cache, logits, DECODE))
    out["tokens"] = tokens + more
    out["seen"] = cache.get_seq_length()
    out["layers"] = []
    for layer in cache.compressed_layers:
        out["layers"].append({
            "positions": layer.positions[0].tolist(),
            "key_sum": float(layer.keys.double().sum()),
            "value_sum": float(layer.values.double().sum()),
            "key_abs": float(layer.keys.double().abs().sum()),
        })
    return out


def run_all() -> dict:
    model = tiny_model()
    return {name: run_case(model, spec) for name, spec in CASES.items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.write.exists():
        print(f"{args.write} exists; the stored cases are not rewritten", file=sys.stderr)
        return 2
    args.write.parent.mkdir(parents=True, exist_ok=True)
    args.write.write_text(json.dumps({"cases": CASES, "results": run_all()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
