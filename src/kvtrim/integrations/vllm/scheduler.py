"""The engine-core half of kvtrim's KV compression in vLLM: free the blocks the policy no longer needs.

Selected with ``--scheduler-cls kvtrim.integrations.vllm.scheduler.KVTrimScheduler``. After vLLM's
own scheduling of a step, every request scheduled in it advances its :class:`~kvtrim.integrations.vllm.plan.Ledger`
exactly as each worker's does: the blocks planned after the request's last forward are replaced in
its block list by vLLM's null block and returned to the pool (as vLLM does for sliding-window
layers), and the step's own forward is planned. Because the list keeps its length, vLLM's
accounting of the blocks a request still needs is unchanged; its pool just has more free blocks,
and ``kv_cache_usage`` falls.

The blocks are freed after this step's allocations, so no other request receives them before the
step in which the workers move the kept tokens out of them has run. A request that is preempted
starts again from no cached tokens (vLLM recomputes it), and so does its ledger, here and in the
workers.
"""

from __future__ import annotations

import logging

from vllm.v1.core.sched.scheduler import Scheduler

from kvtrim.errors import KVTrimError
from kvtrim.integrations.vllm.config import parse
from kvtrim.integrations.vllm.plan import Ledger

log = logging.getLogger("vllm.kvtrim")  # under vLLM's logger, so its handlers print it


class KVTrimScheduler(Scheduler):
    """vLLM's scheduler plus block freeing for kvtrim's ``method`` (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        try:
            self.kvtrim = parse(self.vllm_config.additional_config)
            self.kvtrim_policy = self.kvtrim.policy() if self.kvtrim is not None and self.kvtrim.method else None
        except KVTrimError as e:
            log.error("kvtrim: %s", e)
            raise
        self.kvtrim_ledgers: dict[tuple[str, int], Ledger] = {}
        self.kvtrim_freed = 0  # blocks returned to the pool so far (all groups)
        # per request, each step it was scheduled in: (cached tokens before, tokens scheduled, blocks freed)
        self.kvtrim_steps: dict[str, list[tuple[int, int, int]]] = {}

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        policy = self.kvtrim_policy
        if policy is None:
            return out
        for key in [k for k in self.kvtrim_ledgers if k[0] not in self.requests]:
            del self.kvtrim_ledgers[key]
        for req_id in [r for r in self.kvtrim_steps if r not in self.requests]:
            del self.kvtrim_steps[req_id]
        managers = self.kv_cache_manager.coordinator.single_type_managers
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            ctx = req.num_computed_tokens - n  # cached before this step (vLLM has already advanced it)
            if ctx == 0:
                self.kvtrim_steps[req_id] = []
            n_freed = 0
            for g, mgr in enumerate(managers):
                if ctx == 0:
                    self.kvtrim_ledgers[(req_id, g)] = Ledger(mgr.block_size)
                ledger = self.kvtrim_ledgers.get((req_id, g))
                if ledger is None:
                    continue  # started before the plugin saw it (cannot happen): left alone
                freed, _ = ledger.begin_step(ctx, n)
                ledger.end_step(policy, ctx, n)
                blocks = mgr.req_to_blocks.get(req_id)
                if not freed or blocks is None:
                    continue
                null = mgr.block_pool.null_block
                back = []
                for i in freed:
                    if i < len(blocks) and not blocks[i].is_null:
                        back.append(blocks[i])
                        blocks[i] = null
                if back:
                    n_freed += len(back)
                    mgr.block_pool.free_blocks(back)
                    if not self.kvtrim_freed:
                        log.info("kvtrim: %s frees evicted KV blocks (first: %d of request %s)", policy.name, len(back),
                                 req_id)
                    self.kvtrim_freed += len(back)
            self.kvtrim_steps.setdefault(req_id, []).append((ctx, n, n_freed))
        return out
