"""Reconstruction scores: how much the model needs each prompt token to repeat the prompt (KVzip).

After a prompt's prefill, :func:`reconstruction_scores` asks the model to repeat the prompt: for
each chunk of ``chunk`` prompt tokens it feeds the repeat instruction (a new user turn, in the
prompt's format: :func:`repeat_ids`) followed by the chunk, teacher-forced, into a scratch copy of
the prompt's full cache. Every reconstructing query sees the whole stored prompt and the rows of
its own chunk before it (causal), never the other chunks', so each forward's working set is one
chunk against the prompt. A stored token's score, per layer and KV head, is the largest attention
probability any of those queries (over the query heads of the KV head) gives it. The scratch caches
are thrown away; the scores go to a method that declares ``needs_reconstruction`` (``kvzip``),
through :func:`prepare`, before that method's cache evicts at the prompt.

The scores depend on the prompt only, not on the budget: :func:`prepare` keeps them in a per-prompt
memo, so several budgets of one prompt (``kvtrim eval``) reconstruct it once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch

from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy
from kvtrim.scores import ScoreRequest, grouped_queries
from kvtrim.storage import CompressedLayer

#: reconstructing queries whose attention is computed at once (bounds the probabilities' memory)
ROWS = 256


class _Probe(Policy):
    """Keeps everything; at each later forward (a reconstructed chunk) raises ``scores[layer]`` to
    the largest attention the forward's queries give each of the first ``n_prompt`` stored tokens.

    It asks the forward's attention for the column maxima of its probabilities
    (``ScoreRequest(column_max=True)``): kvtrim's attention function computes them with the
    attention itself (``kvtrim.attention.fused``, the native CPU kernel or Triton), so the chunk's
    ``q @ K^T`` is formed once; :meth:`record` computes them from the queries and keys where the
    attention did not (no native kernel, a mask the kernel does not compute)."""

    name = "reconstruction_probe"
    description = "records the attention a reconstructing forward gives the prompt (kvtrim.reconstruction)"
    takes_budget = False

    def __init__(self, n_prompt: int, scores: dict[int, torch.Tensor]):
        super().__init__()
        self.n_prompt, self.scores = n_prompt, scores

    def on_prefill(self, layer, query, key, scaling):
        return None

    def on_decode(self, layer, query, key, scaling):
        return None

    def wants_prefill_scores(self, layer):
        return ScoreRequest(column_max=True)

    def on_turn(self, layer, query, key, scaling):
        got = layer.attention_scores
        if got is not None and got.column_max is not None and got.column_max.shape[-1] == key.shape[-2]:
            self.raise_to(layer.layer_idx, got.column_max[..., : self.n_prompt].amax(dim=2))  # over the group's query heads
        else:
            self.record(layer.layer_idx, query, key, scaling)
        return None

    def raise_to(self, layer_idx: int, best: torch.Tensor) -> None:
        """``scores[layer_idx] = max(scores[layer_idx], best)`` (``best [B, Hkv, n_prompt]`` float32)."""
        have = self.scores.get(layer_idx)
        self.scores[layer_idx] = best if have is None else torch.maximum(have, best)

    def record(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """Raise ``scores[layer_idx]`` to the largest probability the new queries give the prompt.

        ``query [B, Hq, q, D]``: the new rows, at stored indices ``n .. n + q - 1`` (``n`` prompt
        tokens first); ``key [B, Hkv, n + q, D]``. Every row sees the whole prompt and its own chunk
        causally. The prompt's probabilities are ``exp(logit - logsumexp(row))``: the row's
        log-normaliser comes from the prompt's logits and the chunk's (masked, small) ones, and only
        the maximum over rows is exponentiated, so no softmax of the whole row is materialised."""
        n, q = self.n_prompt, query.shape[-2]
        kf = key.float()
        k_prompt, k_chunk = kf[:, :, :n], kf[:, :, n:]
        best = None
        for r0 in range(0, q, ROWS):
            r1 = min(q, r0 + ROWS)
            qg = grouped_queries(query[:, :, r0:r1].float(), key.shape[1])  # [B, Hkv, G, w, D]
            lp = torch.einsum("bhgqd,bhkd->bhgqk", qg, k_prompt) * scaling  # [B, Hkv, G, w, n]
            lc = torch.einsum("bhgqd,bhkd->bhgqk", qg, k_chunk[:, :, :r1]) * scaling  # [B, Hkv, G, w, r1]
            rows = torch.arange(r0, r1, device=key.device).unsqueeze(1)
            lc = lc.masked_fill(torch.arange(r1, device=key.device).unsqueeze(0) > rows, float("-inf"))
            lse = torch.logaddexp(torch.logsumexp(lp, dim=-1), torch.logsumexp(lc, dim=-1))  # [B, Hkv, G, w]
            m = (lp - lse.unsqueeze(-1)).amax(dim=(2, 3))  # [B, Hkv, n]: the largest log-probability
            best = m if best is None else torch.maximum(best, m)
        assert best is not None
        self.raise_to(layer_idx, best.exp())


def repeat_ids(tokenizer, plain: bool = False) -> list[int]:
    """The repeat instruction as the next user turn after the prompt, in the prompt's format (the
    chat template's, or kvtrim's plain format: :func:`kvtrim.models.next_turn_ids`)."""
    from kvtrim.models import next_turn_ids
    from kvtrim.policies.kvzip import REPEAT_INSTRUCTION

    if tokenizer is None:
        raise KVTrimError("kvzip needs the tokenizer: it asks the model, in words, to repeat the prompt")
    return next_turn_ids(tokenizer, REPEAT_INSTRUCTION, plain)


@torch.inference_mode()
def reconstruction_scores(model, prompt_kv: Sequence[tuple[torch.Tensor, torch.Tensor] | None], ids: Sequence[int],
                          instruction: Sequence[int], *, chunk: int = 2048,
                          on_chunk: Callable[[int, int], None] | None = None) -> dict[int, torch.Tensor]:
    """Per compressed layer index, float32 ``[B, Hkv, len(ids)]``: the largest attention a query
    reconstructing the prompt gives each prompt token (see the module docstring).

    ``prompt_kv``: per layer the prompt's full ``(keys, values)`` as the model's attention stores
    them (None for a layer kvtrim does not compress); ``ids``: the prompt; ``instruction``: the ids
    fed before each chunk (:func:`repeat_ids`); ``on_chunk(done, total)``: progress after each chunk."""
    from kvtrim.decoding import forward
    from kvtrim.integrations.hf import ATTN_NAME, attach

    n = len(ids)
    if n == 0:
        raise KVTrimError("kvzip: the prompt is empty")
    n_layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    if len(prompt_kv) != n_layers or any(kv is None for kv in prompt_kv):
        raise KVTrimError("kvzip: this model has layers kvtrim does not compress (sliding-window attention); "
                          "reconstruction scores need every layer's prompt keys")
    if not instruction:
        raise KVTrimError("kvzip: the repeat instruction has no tokens")
    scores: dict[int, torch.Tensor] = {}
    attached = getattr(model.config, "_attn_implementation", None) == ATTN_NAME
    starts = list(range(0, n, chunk))
    with contextlib.nullcontext() if attached else attach(model):
        for i, s in enumerate(starts):
            probe = _Probe(n, scores)
            scratch = KVTrimCache(model, probe)
            for layer, kv in zip(scratch.layers, prompt_kv):
                if kv is None:
                    continue
                layer.update(kv[0].clone(), kv[1].clone())
                if isinstance(layer, CompressedLayer):
                    scratch.after_attention(layer, None, None, 1.0)  # type: ignore[arg-type]  # the probe ignores the prompt's own forward
            forward(model, scratch, list(instruction) + list(ids[s : s + chunk]))
            del scratch
            if on_chunk is not None:
                on_chunk(i + 1, len(starts))
    return scores


def recorded_kv(recording) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per layer, the prompt's ``(keys, values)`` from a recorded prefill (:class:`kvtrim.recording.Recording`)."""
    record = recording.record
    n = max(record) + 1 if record else 0
    return [(record[i][1], record[i][2]) if i in record else None for i in range(n)]


def reconstructed_prefill(model, policy: Policy, ids: Sequence[int], instruction: Sequence[int], *,
                          kv_bits: int = 16) -> tuple[KVTrimCache, torch.Tensor]:
    """The prompt's cache for a ``needs_reconstruction`` policy, and the prompt's last logits: one
    full prefill recorded (:func:`kvtrim.recording.record_prefill`), the reconstruction scores
    (:func:`prepare`), then the policy's cache replayed from the recording, evicting by them
    (``generate_ids`` and a session's first message)."""
    from tqdm.auto import tqdm

    from kvtrim.recording import record_prefill, replay

    rec = record_prefill(model, list(ids))
    chunk = int(getattr(policy, "chunk", 2048))
    n_chunks = -(-len(ids) // chunk)
    # a long prompt's reconstruction takes minutes on a CPU: a bar over its chunks (none for one chunk)
    with tqdm(total=n_chunks, desc=f"{policy.name}: reconstructing the prompt", unit="chunk",
              disable=n_chunks < 2, dynamic_ncols=True) as bar:
        prepare(policy, model, recorded_kv(rec), ids, instruction, on_chunk=lambda done, total: bar.update(1))
    return replay(model, policy, rec, kv_bits=kv_bits), rec.logits


def prepare(policy: Policy, model, prompt_kv, ids: Sequence[int], instruction: Sequence[int], *,
            memo: dict | None = None, on_chunk: Callable[[int, int], None] | None = None) -> Policy:
    """Give a ``needs_reconstruction`` policy (``kvzip``) the reconstruction scores of the prompt
    ``ids`` before its cache evicts at the prompt; nothing is computed when the policy will not
    evict this prompt (a budget it fits), so a cache that saves nothing costs nothing. ``memo``: one
    dict per prompt shared by the policies of several budgets (the scores are computed once).
    Sets ``policy.reconstruction`` (the scores) and ``policy.reconstruction_seconds`` (what computing
    them took, also when the memo had them: the cost a budget run alone would pay). Returns the policy."""
    if not policy.needs_reconstruction:
        return policy
    n = len(ids)
    if policy.eviction_target("prefill", n, n) is None:
        policy.reconstruction = {}  # type: ignore[attr-defined]  # nothing will be scored
        policy.reconstruction_seconds = 0.0  # type: ignore[attr-defined]
        return policy
    chunk = int(getattr(policy, "chunk", 2048))
    key = ("reconstruction", chunk, tuple(instruction))
    got = None if memo is None else memo.get(key)
    if got is None:
        t0 = time.perf_counter()
        got = (reconstruction_scores(model, prompt_kv, ids, instruction, chunk=chunk, on_chunk=on_chunk),
               time.perf_counter() - t0)
        if memo is not None:
            memo[key] = got
    # the scores, and what computing them took (shared by the budgets of one memo: each budget's cost)
    policy.reconstruction, policy.reconstruction_seconds = got  # type: ignore[attr-defined]
    return policy
