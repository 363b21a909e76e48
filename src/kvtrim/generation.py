"""Generation with a compressing cache, measured: kvtrim's own loop.

``generate_ids`` runs a prefill + decode loop (greedy or sampling; the programs of
:mod:`kvtrim.decoding`) with a ``KVTrimCache`` and reports what a user needs to judge a method:
the answer, the resident KV bytes at the end against what an uncompressed cache would hold, and
prefill and decode times measured separately. Policies that can stream (reassigned positions,
fixed budget) take prompts longer than the model's context: the prompt is then fed in chunks that
stay inside it.

``generate_batch`` does the same for several prompts at once (batch > 1): each prompt gets its own
cache and method, is prefilled alone, and all of them decode together as the rows of one batch
(:mod:`kvtrim.integrations.batched`), each row with exactly the tokens of its own ``generate_ids``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from kvtrim import decoding, validate
from kvtrim.cache import KVTrimCache, check_kv_bits
from kvtrim.decoding import (
    Clock,
    Sampler,
    check_context,
    check_prefill_chunk,
    check_seed,
    check_token_ids,
    chunk_size,
    max_context,
    run,
)
from kvtrim.errors import KVTrimError
from kvtrim.integrations.hf import attach
from kvtrim.machine import heap_trimmed_per_module, release_memory
from kvtrim.policies.base import Policy

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """One generation's answer and measurements.

    ``compressed`` says whether the cache held fewer tokens than it was fed at the end (any token
    evicted or merged, in any layer); when it did not, ``reason`` says why (for example a prompt
    too short for compression to save memory, which every method keeps whole: ``Policy.kept_whole``).

    ``decode_rows`` is the mean number of batch rows that shared this generation's decode steps
    (1: decoded alone; :func:`generate_batch`). ``decode_seconds`` of a batch row is its share of
    the shared steps (step time / rows), so the rows' decode seconds add up to the wall time.
    """

    answer: str
    method: str
    prompt_tokens: int
    new_tokens: int
    kv_bytes: int
    kv_bytes_full: int
    kv_bytes_stored: int
    index_bytes: int
    stored_tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int = 0
    policy: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    prefill: dict | None = None
    compressed: bool = False
    reason: str | None = None
    decode_rows: float = 1.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode forward passes per second (the first new token comes from the prefill)."""
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


def check_prompt(policy: Policy, n_prompt: int, max_new_tokens: int, max_context: int) -> None:
    """Raise a clear error when a prompt cannot be run with this policy."""
    if n_prompt == 0:
        raise KVTrimError("the prompt is empty; give a question or prompt text")
    validate.integer(max_new_tokens, "max_new_tokens", minimum=0)
    check_context(policy, n_prompt + max_new_tokens, max_context,
                  what=f"the prompt has {n_prompt} tokens (+{max_new_tokens} to generate) and")


@torch.inference_mode()
def generate_ids(
    model,
    tokenizer,
    prompt_ids: list[int],
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_at_eos: bool = True,
    prefill_chunk: int | None = None,
    cache: KVTrimCache | None = None,
    prefill=None,
    model_inputs: dict | None = None,
    kv_bits: int = 16,
) -> GenerationResult:
    """Prefill ``prompt_ids`` and decode up to ``max_new_tokens`` with ``policy``.

    ``prefill_chunk`` feeds the prompt in chunks of that many tokens (at least 2; default None: one
    forward). Each later chunk is a policy "turn": a compressing method evicts down to its budget
    after every chunk, so the cache holds at most its budget plus one chunk and the prefill's working
    set (activations, attention, scores) is that of one chunk against the budget, not of the whole
    prompt (docs/memory.md; what it changes in the kept tokens is measured there). Methods that
    rewrite the prefill forward (FastV, HAE) are refused. Streaming policies get chunks
    automatically when the prompt exceeds the model's context.
    ``prefill`` is a :class:`kvtrim.integrations.prefill.SparsePrefill` (MInference sparse prefill of
    the first forward; decode stays dense); its statistics are returned in ``result.prefill``.
    ``model_inputs`` are extra prefill inputs of a vision-language model (``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids``, ... from its processor; see ``kvtrim.vlm``).
    ``do_sample``, ``temperature``, ``top_p`` and ``top_k`` choose each token
    (:class:`kvtrim.decoding.Sampler`; greedy by default); ``seed`` seeds the sampling.
    ``kv_bits`` stores the keys and values in 16 (default: the model's dtype), 8, 4 or 2 bits
    (``KVTrimCache``; docs/quantization.md); a ``cache`` given keeps its own.
    """
    sampler = Sampler(do_sample, temperature, top_p, top_k)  # checked before any work
    check_kv_bits(kv_bits)
    prefill_chunk = check_prefill_chunk(policy, prefill_chunk)
    if model_inputs and prefill_chunk:
        raise KVTrimError("image/video inputs need the prompt in one prefill; chunked prefill is not supported with them")
    row = _Row.make(model, tokenizer, prompt_ids, policy, max_new_tokens=max_new_tokens, seed=seed,
                    stop_at_eos=stop_at_eos, prefill_chunk=prefill_chunk, cache=cache, kv_bits=kv_bits)
    with attach(model, prefill_attention=prefill):
        row.prefill(model, prefill, extra=model_inputs or None)
        t1 = time.perf_counter()
        if max_new_tokens:
            row.tokens, row.steps = run(model, row.decode(sampler))
        row.clock.seconds = time.perf_counter() - t1  # wall time of the decode, sampling included
    return row.result(tokenizer)


@torch.inference_mode()
def generate_batch(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    policies: Policy | Sequence[Policy],
    *,
    max_new_tokens: int | Sequence[int] = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_at_eos: bool = True,
    prefill=None,
    max_rows: int = 64,
    progress: bool = False,
    prefill_chunk: int | None = None,
    kv_bits: int = 16,
) -> list[GenerationResult]:
    """Generate for several prompts together (batch > 1); one :class:`GenerationResult` per prompt, in order.

    Each prompt (a list of token ids; prompts may differ in length) gets its own ``KVTrimCache``
    with its own method: ``policies`` is one policy for every row or a sequence of one per prompt
    (different methods and budgets per row are fine). Each prompt is prefilled alone, exactly as
    :func:`generate_ids` does (chunks, sparse ``prefill``, statistics); then all rows decode in lock
    step as the rows of one forward pass, at most ``max_rows`` per forward
    (:func:`kvtrim.integrations.batched.drive`): the weights are read once per step for all rows,
    while attention runs per row against the row's own cache, positions and evictions. A row that
    stops (EOS, its ``max_new_tokens``) leaves the batch. Row ``i``'s tokens equal
    ``generate_ids(model, tokenizer, prompts[i], policies[i], ...)`` with the same arguments (up to
    the floating-point rounding of the batched matmuls; ``tests/test_generate_batch.py`` checks token
    equality for every text method). Sampling gives every row its own generator seeded with
    ``seed``, as its batch-1 run would have.

    ``max_new_tokens`` is one limit or one per prompt. ``prefill_chunk`` prefills every prompt in
    chunks, as :func:`generate_ids` does; ``kv_bits`` is every row's cache's (:func:`generate_ids`). ``progress`` shows a progress bar (tqdm, on
    stderr) over the prefills and the generated tokens; it counts on every row's limit, and ends at
    100% when rows stop early.

    Methods that change the forward pass itself (``Policy.rewrites_forward``: FastV's and HAE's
    hidden-state pruning) cannot share a forward with other rows: their rows decode alone at batch 1
    (a warning is logged; their ``decode_rows`` is 1). Every prompt is checked before any work:
    an empty list, an empty prompt, a token outside the vocabulary or a prompt that does not fit the
    model's context with its method raises ``KVTrimError`` naming the prompt's index.
    """
    from tqdm import tqdm

    from kvtrim.integrations.batched import drive

    sampler = Sampler(do_sample, temperature, top_p, top_k)  # checked before any work
    check_kv_bits(kv_bits)
    n = len(prompts)
    if n == 0:
        raise KVTrimError("no prompts given; generate_batch needs at least one prompt")
    if isinstance(policies, Policy):
        policies = [policies] * n
    if len(policies) != n:
        raise KVTrimError(f"give one policy, or one per prompt: {n} prompts but {len(policies)} policies")
    given = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * n
    if len(given) != n:
        raise KVTrimError(f"give one max_new_tokens, or one per prompt: {n} prompts but {len(given)} limits")
    limits = [validate.integer(x, "max_new_tokens", minimum=0) for x in given]
    if not isinstance(max_rows, int) or max_rows < 1:
        raise KVTrimError(f"max_rows must be an integer >= 1, got {max_rows!r}")
    rows = []
    for i, (ids, policy, limit) in enumerate(zip(prompts, policies, limits)):
        if not isinstance(policy, Policy):
            raise KVTrimError(f"prompt {i}: expected a kvtrim Policy (kvtrim.create_policy), got {type(policy).__name__}")
        try:
            rows.append(_Row.make(model, tokenizer, list(ids), policy, max_new_tokens=limit, seed=seed,
                                  stop_at_eos=stop_at_eos, prefill_chunk=check_prefill_chunk(policy, prefill_chunk),
                                  kv_bits=kv_bits))
        except KVTrimError as e:
            raise KVTrimError(f"prompt {i} (of {n}): {e}") from None
    alone = sorted({r.policy.name for r in rows if r.policy.rewrites_forward})
    if alone and n > 1:
        logger.warning("method(s) %s change the forward pass (hidden-state pruning) and cannot share a batch: "
                       "their rows decode alone at batch 1", ", ".join(alone))
    bar = tqdm(total=sum(limits), desc="kvtrim generate", unit="tok", disable=not progress, dynamic_ncols=True)
    try:
        with attach(model, prefill_attention=prefill):
            for i, row in enumerate(rows):
                bar.set_postfix_str(f"prefill {i + 1}/{n}")
                row.prefill(model, prefill)
            bar.set_postfix_str(f"decode {n} rows")

            def tick(_token: int) -> None:
                bar.update(1)

            together = {i: row.decode(sampler, tick) for i, row in enumerate(rows)
                        if row.max_new_tokens and not row.policy.rewrites_forward}
            for i, (tokens, steps) in drive(model, together, max_rows=max_rows).items():
                rows[i].tokens, rows[i].steps = tokens, steps
            for row in rows:
                if row.max_new_tokens and row.policy.rewrites_forward:
                    row.tokens, row.steps = run(model, row.decode(sampler, tick))
        # rows that stopped before their limit (EOS) generated fewer tokens than the bar counted on:
        # the bar's total becomes what was generated, so a finished batch reads 100%
        bar.total = sum(len(row.tokens) for row in rows)
        bar.refresh()
    finally:
        bar.close()
    return [row.result(tokenizer) for row in rows]


@dataclass
class _Row:
    """One prompt of a generation: its checked ids, cache and decoding state, and its measurements."""

    ids: list[int]
    policy: Policy
    cache: KVTrimCache
    chunk: int | None
    max_new_tokens: int
    generator: torch.Generator
    eos: int | None
    stop: tuple[int, ...]
    stop_at_eos: bool
    logits: torch.Tensor | None = None
    prefill_seconds: float = 0.0
    prefill_stats: dict | None = None
    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    clock: Clock = field(default_factory=Clock)
    #: the repeat instruction's ids, for a method scored by reconstructing the prompt (``kvzip``)
    repeat: list[int] | None = None

    @classmethod
    def make(cls, model, tokenizer, prompt_ids, policy: Policy, *, max_new_tokens: int, seed: int, stop_at_eos: bool,
             prefill_chunk: int | None = None, cache: KVTrimCache | None = None, kv_bits: int = 16) -> "_Row":
        """Check the prompt (length, context, token ids) and the seed, and set up its cache; raises ``KVTrimError``."""
        seed = check_seed(seed)
        max_ctx = max_context(model)
        check_prompt(policy, len(prompt_ids), max_new_tokens, max_ctx)
        ids = check_token_ids(model, prompt_ids)
        chunk = prefill_chunk or chunk_size(policy, held=0, seen=0, n=len(ids), extra=max_new_tokens, max_ctx=max_ctx)
        eos = getattr(tokenizer, "eos_token_id", None)
        repeat = None
        if policy.needs_reconstruction:
            if cache is not None:
                raise KVTrimError(f"{policy.name}: builds its cache from the reconstructed prompt; do not pass a cache")
            if chunk:
                raise KVTrimError(f"{policy.name}: reconstructs the prompt after one whole prefill; a chunked prefill "
                                  "(prefill_chunk, or a prompt longer than the model's context) is not supported")
            from kvtrim.reconstruction import repeat_ids

            repeat = repeat_ids(tokenizer)
        return cls(ids=ids, policy=policy, cache=cache if cache is not None else KVTrimCache(model, policy, kv_bits=kv_bits), chunk=chunk,
                   max_new_tokens=max_new_tokens, generator=torch.Generator(device="cpu").manual_seed(seed), eos=eos,
                   stop=(eos,) if stop_at_eos and eos is not None else (), stop_at_eos=stop_at_eos, repeat=repeat)

    def prefill(self, model, sparse=None, extra: dict | None = None) -> None:
        """Feed the prompt at batch 1 (inside ``attach``): the last logits, the time, the sparse-prefill statistics."""
        if self.repeat is not None:
            return self._prefill_reconstructed(model, sparse, extra)
        if sparse is not None:
            sparse.reset_stats()
        t0 = time.perf_counter()
        # a chunked prefill hands freed activations back to the OS after every module's forward and
        # collects garbage between chunks: glibc keeps freed blocks of up to 32 MiB in its heap, and
        # without a trim the resident set grows past the prefill-memory bound even though the cache
        # stays at its budget (docs/memory.md measures both); a one-forward prefill runs as it was
        between = (lambda step, seconds: release_memory()) if self.chunk else None
        with heap_trimmed_per_module(model) if self.chunk else contextlib.nullcontext():
            self.logits = run(model, decoding.prefill(self.cache, self.ids, chunk=self.chunk, extra=extra),
                              on_step=between)
        self.prefill_seconds = time.perf_counter() - t0
        self.prefill_stats = sparse.stats() if sparse is not None else None

    def _prefill_reconstructed(self, model, sparse, extra: dict | None) -> None:
        """A ``needs_reconstruction`` method (``kvzip``): one full prefill recorded, the reconstruction
        forward that scores it (:mod:`kvtrim.reconstruction`), then the method's cache built from the
        recorded prompt, evicting by those scores; the prefill time covers all three."""
        from kvtrim.reconstruction import reconstructed_prefill

        if sparse is not None or extra:
            what = "a sparse prefill" if sparse is not None else "image/video inputs"
            raise KVTrimError(f"{self.policy.name}: reconstructs a text prompt after a dense prefill; {what} is not supported")
        assert self.repeat is not None
        t0 = time.perf_counter()
        self.cache, self.logits = reconstructed_prefill(model, self.policy, self.ids, self.repeat,
                                                        kv_bits=self.cache.kv_bits)
        self.prefill_seconds = time.perf_counter() - t0
        self.prefill_stats = None

    def decode(self, sampler: Sampler, on_token=None):
        """The decode program (:func:`kvtrim.decoding.decode`) of this row, from its prefill's logits."""
        assert self.logits is not None, "prefill first"
        return decoding.decode(self.cache, self.logits, self.max_new_tokens, sampler=sampler, generator=self.generator,
                               stop_ids=self.stop, on_token=on_token, clock=self.clock)

    def result(self, tokenizer) -> GenerationResult:
        cache, policy, out = self.cache, self.policy, self.tokens
        text_ids = [t for t in out if not (self.stop_at_eos and t == self.eos)]
        stored = cache.stored_tokens()
        compressed = any(layer.length < layer.seen for layer in cache.compressed_layers)
        return GenerationResult(
            answer=tokenizer.decode(text_ids, skip_special_tokens=True).strip() if tokenizer is not None else "",
            method=policy.name,
            prompt_tokens=len(self.ids),
            new_tokens=len(out),
            kv_bytes=cache.kv_bytes(),
            kv_bytes_full=cache.kv_bytes_full(),
            kv_bytes_stored=cache.kv_bytes_stored(),
            index_bytes=cache.index_bytes(),
            stored_tokens=max(stored) if stored else 0,
            prefill_seconds=self.prefill_seconds,
            decode_seconds=self.clock.seconds,
            decode_steps=self.steps,
            policy=policy.describe(),
            token_ids=out,
            prefill=self.prefill_stats,
            compressed=compressed,
            reason=None if compressed else not_compressed_reason(policy, len(self.ids)),
            decode_rows=round(self.clock.mean_rows, 3),
        )


def not_compressed_reason(policy: Policy, n_prompt: int) -> str:
    """Why a generation of ``policy`` on a prompt of ``n_prompt`` tokens evicted nothing."""
    if policy.needs_spans and not policy.compresses:
        return f"{policy.name} acts only on tagged image/video/document tokens and evicted none"
    why = policy.short_prompt_reason(n_prompt)
    if why is not None:
        return why
    return f"the budget ({policy.budget(n_prompt)} tokens at the prompt) held every token"
