"""The engine-core half of kvtrim's KV compression in vLLM: free the evicted blocks.

Selected with ``--scheduler-cls kvtrim.integrations.vllm.scheduler.KVTrimScheduler``. After vLLM's
own scheduling of a step, for each request decoding one token in it (cached tokens ``ctx`` at
least its prompt), the scheduler computes the same evicted block range as the workers
(:func:`kvtrim.integrations.vllm.plan.evicted_range`), replaces those blocks in the request's
block list by vLLM's null block and returns them to the pool, as vLLM does for sliding-window
layers. Because the list keeps its length, vLLM's accounting of the blocks a request still needs
is unchanged; its pool just has more free blocks, and ``kv_cache_usage`` falls.

The blocks are freed after this step's allocations, so no other request receives them before
the step that compacts or stops reading them runs. A request that is preempted starts again
from no cached tokens (vLLM recomputes it); its state is dropped then, and compression happens
again at its next first decode step, in the workers as here.
"""

from __future__ import annotations

import logging

from vllm.v1.core.sched.scheduler import Scheduler

from kvtrim.errors import KVTrimError
from kvtrim.integrations.vllm import plan
from kvtrim.integrations.vllm.config import parse

log = logging.getLogger("vllm.kvtrim")  # under vLLM's logger, so its handlers print it


class KVTrimScheduler(Scheduler):
    """vLLM's scheduler plus block freeing for kvtrim's ``method`` (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        try:
            self.kvtrim = parse(self.vllm_config.additional_config)
        except KVTrimError as e:
            log.error("kvtrim: %s", e)
            raise
        self.kvtrim_prompt_len: dict[str, int] = {}
        self.kvtrim_freed = 0  # blocks returned to the pool so far (all groups)

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        cfg = self.kvtrim
        if cfg is None or cfg.method is None:
            return out
        for req_id in [r for r in self.kvtrim_prompt_len if r not in self.requests]:
            del self.kvtrim_prompt_len[req_id]
        managers = self.kv_cache_manager.coordinator.single_type_managers
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            ctx = req.num_computed_tokens - n  # cached before this step (vLLM has already advanced it)
            if ctx == 0:
                self.kvtrim_prompt_len.pop(req_id, None)  # new, or recomputed after preemption
            if n != 1 or ctx < req.num_prompt_tokens:
                continue
            prompt_len = self.kvtrim_prompt_len.setdefault(req_id, ctx)
            for mgr in managers:
                first, stop = plan.evicted_range(cfg, prompt_len, ctx, mgr.block_size)
                blocks = mgr.req_to_blocks.get(req_id)
                if blocks is None or stop <= first:
                    continue
                null = mgr.block_pool.null_block
                freed = []
                for i in range(first, min(stop, len(blocks))):
                    if not blocks[i].is_null:
                        freed.append(blocks[i])
                        blocks[i] = null
                if freed:
                    mgr.block_pool.free_blocks(freed)
                    if not self.kvtrim_freed:
                        log.info("kvtrim: %s frees evicted KV blocks (first: %d of request %s)", cfg.method, len(freed), req_id)
                    self.kvtrim_freed += len(freed)
        return out
