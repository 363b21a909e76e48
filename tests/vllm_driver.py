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

``"inprocess": true`` runs vLLM's engine core in this process, so that kvtrim's scheduler can be
read: per request, every step it was scheduled in (cached tokens before, tokens scheduled, blocks
freed), at the probe and at the end (``steps_at_probe``, ``steps``). At tensor parallel 1 the worker
runs here too, and ``kept`` gives per request, per layer and KV head, the stream indices the
plugin's storage holds after the request's last forward (its pending decision applied).
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
    if spec.get("inprocess"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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
    watch = Watch(eng, len(prompts)) if spec.get("inprocess") else None
    at_probe = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = list(o.outputs[0].token_ids)
        if watch is not None:
            watch.look()
        if probe and blocks_in_use is None and len(outs) == len(prompts) and min(map(len, outs.values())) >= probe:
            usage = next((m.value for m in llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc"), None)
            blocks_in_use = None if usage is None else round(usage * num_blocks)
            at_probe = None if watch is None else [list(map(list, s)) for s in watch.steps]
    out = {"tokens": [outs[f"r{i}"] for i in range(len(prompts))], "num_blocks": num_blocks, "block_size": block_size,
           "blocks_in_use": blocks_in_use}
    if watch is not None:
        out.update(steps=watch.steps, steps_at_probe=at_probe, kept=watch.kept)
    return out


class Watch:
    """Reads kvtrim's scheduler (and, at tensor parallel 1, its worker state) after every engine step."""

    def __init__(self, eng, n: int):
        self.sched = eng.engine_core.engine_core.scheduler
        self.n = n
        self.internal: list[str | None] = [None] * n  # vLLM appends a suffix of its own to a request id
        self.first_block: list[int | None] = [None] * n
        self.steps: list[list] = [[] for _ in range(n)]
        self.kept: list[dict | None] = [None] * n
        from kvtrim.integrations.vllm.backend import PROCESS

        self.process = PROCESS

    def look(self) -> None:
        import torch

        mgr = self.sched.kv_cache_manager.coordinator.single_type_managers[0]
        for i in range(self.n):
            if self.internal[i] is None:
                self.internal[i] = next((r for r in self.sched.requests if r.startswith(f"r{i}-") or r == f"r{i}"), None)
            if self.internal[i] is not None and self.first_block[i] is None and mgr.req_to_blocks.get(self.internal[i]):
                self.first_block[i] = mgr.req_to_blocks[self.internal[i]][0].block_id  # once it holds blocks
            steps = getattr(self.sched, "kvtrim_steps", {}).get(self.internal[i])
            if steps is None:
                continue  # not started, or ended before the scheduler's last step (its blocks may serve another)
            self.steps[i] = [list(x) for x in steps]
            st = self.process.requests.get(self.first_block[i]) if self.first_block[i] is not None else None
            if st is not None and st.layers:
                kept = {}
                for li, layer in st.layers.items():
                    pos = layer.positions if layer.pending is None else torch.gather(layer.positions, 2, layer.pending.idx)
                    kept[str(li)] = pos[0].tolist()
                self.kept[i] = kept


if __name__ == "__main__":
    arg = sys.argv[1]
    result = main(json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg))
    sys.stdout.write("@@RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
