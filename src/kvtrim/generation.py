"""Generation with a compressing cache, measured: kvtrim's own loop.

``generate_ids`` runs a hand-written prefill + decode loop (greedy or sampling) with a
``KVTrimCache`` and reports what a user needs to judge a method: the answer, the resident KV
bytes at the end against what an uncompressed cache would hold, and prefill and decode times
measured separately. Policies that can stream (reassigned positions, fixed budget) take prompts
longer than the model's context: the prompt is then fed in chunks that stay inside it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from kvtrim import decoding
from kvtrim.cache import KVTrimCache
from kvtrim.decoding import Sampler, check_context, check_token_ids, chunk_size, max_context, run
from kvtrim.errors import KVTrimError
from kvtrim.integrations.hf import attach
from kvtrim.policies.base import Policy


@dataclass
class GenerationResult:
    """One generation's answer and measurements.

    ``compressed`` says whether the cache held fewer tokens than it was fed at the end (any token
    evicted or merged, in any layer); when it did not, ``reason`` says why (for example a prompt
    too short for compression to save memory, which every method keeps whole: ``Policy.kept_whole``).
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
    if max_new_tokens < 0:
        raise KVTrimError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
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
    seed: int = 0,
    stop_at_eos: bool = True,
    prefill_chunk: int | None = None,
    cache: KVTrimCache | None = None,
    prefill=None,
    model_inputs: dict | None = None,
) -> GenerationResult:
    """Prefill ``prompt_ids`` and decode up to ``max_new_tokens`` with ``policy``.

    ``prefill_chunk`` feeds the prompt in chunks (each later chunk is a policy "turn"); streaming
    policies get chunks automatically when the prompt exceeds the model's context.
    ``prefill`` is a :class:`kvtrim.integrations.prefill.SparsePrefill` (MInference sparse prefill of
    the first forward; decode stays dense); its statistics are returned in ``result.prefill``.
    ``model_inputs`` are extra prefill inputs of a vision-language model (``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids``, ... from its processor; see ``kvtrim.vlm``).
    """
    max_ctx = max_context(model)
    check_prompt(policy, len(prompt_ids), max_new_tokens, max_ctx)
    prompt_ids = check_token_ids(model, prompt_ids)
    cache = cache if cache is not None else KVTrimCache(model, policy)
    if model_inputs and prefill_chunk:
        raise KVTrimError("image/video inputs need the prompt in one prefill; chunked prefill is not supported with them")
    chunk = prefill_chunk or chunk_size(policy, held=0, seen=0, n=len(prompt_ids), extra=max_new_tokens, max_ctx=max_ctx)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    eos = getattr(tokenizer, "eos_token_id", None)
    stop = (eos,) if stop_at_eos and eos is not None else ()
    sampler = Sampler(do_sample, temperature, top_p)
    if prefill is not None:
        prefill.reset_stats()
    out: list[int] = []
    steps = 0
    with attach(model, prefill_attention=prefill):
        t0 = time.perf_counter()
        logits = run(model, decoding.prefill(cache, prompt_ids, chunk=chunk, extra=model_inputs or None))
        t1 = time.perf_counter()
        if max_new_tokens:
            out, steps = run(model, decoding.decode(cache, logits, max_new_tokens, sampler=sampler, generator=gen, stop_ids=stop))
        t2 = time.perf_counter()
    text_ids = [t for t in out if not (stop_at_eos and t == eos)]
    stored = cache.stored_tokens()
    compressed = any(layer.length < layer.seen for layer in cache.compressed_layers)
    return GenerationResult(
        answer=tokenizer.decode(text_ids, skip_special_tokens=True).strip() if tokenizer is not None else "",
        method=policy.name,
        prompt_tokens=len(prompt_ids),
        new_tokens=len(out),
        kv_bytes=cache.kv_bytes(),
        kv_bytes_full=cache.kv_bytes_full(),
        kv_bytes_stored=cache.kv_bytes_stored(),
        index_bytes=cache.index_bytes(),
        stored_tokens=max(stored) if stored else 0,
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        decode_steps=steps,
        policy=policy.describe(),
        token_ids=out,
        prefill=prefill.stats() if prefill is not None else None,
        compressed=compressed,
        reason=None if compressed else not_compressed_reason(policy, len(prompt_ids)),
    )


def not_compressed_reason(policy: Policy, n_prompt: int) -> str:
    """Why a generation of ``policy`` on a prompt of ``n_prompt`` tokens evicted nothing."""
    if policy.needs_spans and not policy.compresses:
        return f"{policy.name} acts only on tagged image/video/document tokens and evicted none"
    why = policy.short_prompt_reason(n_prompt)
    if why is not None:
        return why
    return f"the budget ({policy.budget(n_prompt)} tokens at the prompt) held every token"
