"""Runs one vLLM engine configuration for the vLLM test tier and prints one JSON line (``@@RESULT``).

    python tests/vllm_driver.py '{"additional_config": {...}, "engine": {...}, "prompts": [[ids...], ...],
                                   "max_tokens": 12, "probe_after": 4}'
    python tests/vllm_driver.py @SPEC.json     # the same, from a file (long prompts exceed one argument's limit)

Run in vLLM's own venv, in a process of its own (vLLM spawns its engine core and workers; a fresh
process per configuration keeps each test's engine apart). All requests are added at once and
driven with ``LLMEngine.step()``: with ``max_num_batched_tokens`` below the prompt lengths the
engine chunks the prefills and mixes them with other requests' decode steps. ``probe_after``:
once every request has that many output tokens, the number of KV blocks in use is read from
vLLM's ``kv_cache_usage`` gauge (its fraction of the pool times the pool's block count).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MODEL_ENV = "KVTRIM_VLLM_MODEL"  # a plain transformers directory (config.json + safetensors)


def main(spec: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 2048, "enable_prefix_caching": False,
              "seed": 0, "disable_log_stats": False, **spec.get("engine", {})}
    llm = LLM(model=os.environ[MODEL_ENV], additional_config=spec.get("additional_config", {}), **engine)
    eng = llm.llm_engine
    num_blocks = eng.vllm_config.cache_config.num_gpu_blocks
    block_size = eng.vllm_config.cache_config.block_size
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 12), temperature=0.0, ignore_eos=True)
    prompts = spec["prompts"]
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids), sp)
    outs: dict[str, list[int]] = {}
    probe = spec.get("probe_after")
    blocks_in_use = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = list(o.outputs[0].token_ids)
        if probe and blocks_in_use is None and len(outs) == len(prompts) and min(map(len, outs.values())) >= probe:
            usage = next((m.value for m in llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc"), None)
            blocks_in_use = None if usage is None else round(usage * num_blocks)
    return {"tokens": [outs[f"r{i}"] for i in range(len(prompts))], "num_blocks": num_blocks, "block_size": block_size,
            "blocks_in_use": blocks_in_use}


if __name__ == "__main__":
    arg = sys.argv[1]
    result = main(json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg))
    sys.stdout.write("@@RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
