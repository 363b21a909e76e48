"""Which of a request's KV blocks stay, planned from integers alone (no vLLM import, no tensors).

The scheduler (engine-core process) and every worker (one per tensor-parallel rank) keep one
:class:`Ledger` per request and feed it the same integers each step -- the tokens cached before the
step (``ctx``) and the tokens it brings (``q``) -- so they agree on every freed block without
messages between them.

A request's KV lives in blocks of ``block_size`` tokens; its block table lists them in *logical*
order (logical block ``i`` holds stream positions ``i*bs .. i*bs+bs-1`` until kvtrim moves tokens).
After every forward the policy's integer rule (``Policy.eviction_target``: after a prompt chunk, a
turn, a decode step) says how many tokens the layer keeps; rounded so that whole blocks are freed
(``kvtrim.decisions.planned_length``), that is ``m`` blocks to free at the next step. Then:

* the scheduler replaces the ``m`` oldest held blocks after the first (the first stays: the workers
  know a request by it; the last stays too, see below) with vLLM's null block and returns them to the
  pool, as vLLM does for sliding-window layers, so its own block counting is unchanged;
* each worker moves every layer's kept tokens (the policy's decision, per KV head, in order) into
  the blocks that stay (``kvtrim.integrations.vllm.storage``) and hands the attention kernel a table
  of those blocks and a sequence length of the tokens they hold. Keys are cached after RoPE at their
  true positions and new tokens keep theirs, so attention over the kept keys is exact.

The last held block stays too: it holds ``stored % bs`` tokens, and the next token is written into
it at the slot vLLM computes from its true position. Keeping the count of kept tokens congruent to
the stored count modulo the block size (the rounding above) keeps that slot right. With the first
and the last block held, a layer keeps at least one block more than the partial one
(``kvtrim.decisions.paged_kept``): at most ``2 * block_size - 1`` tokens beyond a small budget.

The rounding makes a method that evicts at every decode step (H2O, StreamingLLM, Elastic Cache)
compact once per ``block_size`` steps: the layer holds between its budget and budget + block_size - 1
tokens between compactions (docs/vllm.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtrim.decisions import paged_kept
from kvtrim.errors import KVTrimError


def phase_of(ctx: int, q: int) -> str:
    """The phase of a forward that brings ``q`` tokens after ``ctx`` cached ones: what the
    transformers storage calls it too (a first forward, a later one of several tokens, or one token)."""
    if ctx == 0:
        return "prefill"
    return "decode" if q == 1 else "turn"


@dataclass
class Ledger:
    """One request's blocks and counters, kept alike by the scheduler and every worker."""

    block_size: int
    live: list[int] = field(default_factory=list)  # logical indices of the blocks held, in order
    seen: int = 0  # tokens seen (the stream position of the next token)
    stored: int = 0  # tokens held in the live blocks
    pending: int = 0  # blocks to free at the request's next step (planned after its last forward)

    def begin_step(self, ctx: int, q: int) -> tuple[list[int], list[int]]:
        """Start a step that brings ``q`` tokens after ``ctx`` cached ones: free the blocks planned
        at the last forward and hold the blocks the new tokens need. Returns ``(freed, before)``:
        the logical indices freed now, and the live blocks before (which hold the ``stored`` tokens
        the pending decision was made over)."""
        if ctx != self.seen:
            raise KVTrimError(f"kvtrim: a request continued at {ctx} cached tokens, its ledger is at {self.seen}")
        before = list(self.live)
        freed: list[int] = []
        if self.pending:
            freed = self.live[1:1 + self.pending]
            self.live = self.live[:1] + self.live[1 + self.pending:]
            self.stored -= self.pending * self.block_size
            self.pending = 0
        last = (ctx + q - 1) // self.block_size  # the logical block of the step's last new token
        nxt = self.live[-1] + 1 if self.live else 0
        self.live.extend(range(nxt, last + 1))  # the last held block is always the one of position ctx - 1
        return freed, before

    def end_step(self, policy, ctx: int, q: int) -> int:
        """Account the step's forward and plan what its hook evicts; returns the tokens kept."""
        self.seen = ctx + q
        self.stored += q
        target = policy.eviction_target(phase_of(ctx, q), self.seen, self.stored)
        kept = paged_kept(target, self.stored, self.block_size)
        self.pending = (self.stored - kept) // self.block_size
        return kept

    @property
    def kept_after_pending(self) -> int:
        return self.stored - self.pending * self.block_size


def token_major(data, layout):
    """Blocks ``[nb, Hkv, bs, D]`` as stored by the kernel, as ``[nb, Hkv, bs, D]`` token by token.

    ``layout``: where token-major element ``t * D + j`` (token ``t``, channel ``j``) lies in a
    block head's ``bs * D`` stored values (a permutation; ``None``: stored token-major already).
    vLLM's CPU kernel, for example, stores a block's keys channel-major (``[D, bs]``) and its
    values token-major.
    """
    if layout is None:
        return data
    nb, h, bs, d = data.shape
    return data.reshape(nb, h, bs * d)[..., layout].view(nb, h, bs, d)


def stored(data, layout):
    """The inverse of :func:`token_major`: token-major blocks in the kernel's stored order."""
    if layout is None:
        return data
    nb, h, bs, d = data.shape
    out = data.new_empty(data.shape).reshape(nb, h, bs * d)
    out[..., layout] = data.reshape(nb, h, bs * d)
    return out.view(nb, h, bs, d)
