"""Offline, kernel-aware pattern search (the MInference paper's search, with its output-error objective).

A tool above the layers it uses (``kvtrim search-patterns`` runs it): for a loaded model it builds the
calibration prompt with :mod:`kvtrim.eval.tasks`, runs the model through
:func:`kvtrim.integrations.hf.attach` with :class:`SearchHook` as the prefill attention, sizes
candidates with the kernels' patterns (:mod:`kvtrim.attention`), and returns the per-model
:class:`kvtrim.integrations.prefill.PatternConfig`.

For every layer and query head, candidates of each pattern are sized to the same *executed* cost,
counted as the kernel runs them (whole 64x64 blocks, 64-row columns; see
:meth:`SparseLayout.density`), and the candidate whose sparse attention output is closest to the
dense output on one calibration prompt wins:

- ``a_shape``: ``n_init`` in :data:`A_SHAPE_SINKS`, ``n_local`` bisected to the target cost;
- ``vertical_slash``: ``k_v : k_s`` in the ratios :data:`VS_RATIOS`, scaled by bisection until the
  layout estimated *on this head's calibration q/k* costs the target (slashes sharing blocks cost
  less, so sizes can exceed the naive count);
- ``block_sparse``: ``k_b`` bisected to the target.

The target cost is ``target_density`` x dense causal attention at the calibration length. Sizes
are stored as absolute numbers (like MInference's shipped configs), so at longer prompts the same
config is sparser (cost grows ~linearly with length, dense quadratically) and at shorter prompts
denser, up to dense.

Error = ``||O_sparse - O_dense||_F / ||O_dense||_F`` over all rows of the head, float32. The model
runs dense while searching (each layer sees dense inputs), so heads are judged independently.
The calibration prompt is a multi-key needle retrieval over essays (the paper used a KV-retrieval
prompt), generated offline by :mod:`kvtrim.eval.tasks`.
"""

from __future__ import annotations

import math
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvtrim.attention.cpu import sparse_attention_cpu
from kvtrim.attention.patterns import AShape, BlockSparse, SparseLayout, VerticalSlash, vertical_slash_layout
from kvtrim.errors import KVTrimError
from kvtrim.integrations.prefill import PatternConfig, model_identity, rope_scaling_of

A_SHAPE_SINKS = (64, 256)
VS_RATIOS = ((1, 6), (1, 1), (6, 1))  # k_v : k_s
# A candidate may exceed the target cost by this factor (its smallest size can cost more than the
# target at short lengths); costlier ones are left out so every candidate competes at equal cost.
OVER = 1.05
# Default cost levels and error tolerance: each head takes the cheapest level at which its best
# candidate's relative output error is <= DEFAULT_MAX_ERROR, else stays dense.
DEFAULT_LEVELS = (0.1, 0.2, 0.35, 0.5, 0.65, 0.8)
DEFAULT_MAX_ERROR = 0.05
# Query blocks a candidate's error is measured on (None: every row); see search_patterns.
DEFAULT_QUERY_BLOCKS = 32


def _bisect_int(lo: int, hi: int, cost, target: float) -> int:
    """Largest integer x in [lo, hi] with cost(x) <= target (lo if even lo is over)."""
    if cost(hi) <= target:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


class HeadCandidates:
    """One head's candidates at any cost level (``q``, ``k`` ``[1, 1, T, D]``).

    What does not depend on the sizes is computed once per head and shared by every bisection
    step and every level: the vertical-slash estimation (the runtime's own scores, the native
    version where it is built) and the block-sparse pooled scores. A block-sparse size's cost is
    counted without building its layout; the vertical-slash layouts built while bisecting are
    kept for the level that asks for the same sizes.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, scale: float):
        from kvtrim.attention.native import kernel_for

        self.q, self.k, self.scale, self.t = q, k, scale, q.shape[2]
        native = q.device.type == "cpu" and kernel_for(q) == "native"
        self.vert, self.slash = VerticalSlash.scores(q, k, scale, VerticalSlash().last_q, native=native)
        self.native = native
        self.blocks = BlockSparse.block_scores(q, k, scale)
        self.n = self.blocks.shape[-1]
        self._vs: dict[tuple[int, int], SparseLayout] = {}
        self._ashape: dict[tuple[int, int], SparseLayout] = {}

    def _vs_layout(self, pat: VerticalSlash) -> SparseLayout:
        key = (pat.k_v, pat.k_s)
        if key not in self._vs:
            v_idx, s_off = pat.select(self.vert, self.slash)
            self._vs[key] = vertical_slash_layout(v_idx, s_off, self.t, pat.block_size, native=self.native)
        return self._vs[key]

    def _a_layout(self, sink: int, n_local: int) -> SparseLayout:
        if (sink, n_local) not in self._ashape:
            self._ashape[(sink, n_local)] = AShape(sink, n_local).layout(self.q, self.k)
        return self._ashape[(sink, n_local)]

    def candidates(self, target_density: float) -> list[tuple[str, dict, SparseLayout]]:
        """``(pattern, sizes, layout)`` for each pattern, each at ~the target cost (see the module docstring)."""
        t = self.t
        target = target_density  # densities are relative to dense causal, blocked
        out = []
        for sink in A_SHAPE_SINKS:
            if sink >= t:
                continue
            n_local = _bisect_int(1, t, lambda x, sink=sink: self._a_layout(sink, x).density(), target)
            lay = self._a_layout(sink, n_local)
            if lay.density() <= target * OVER:
                out.append(("a_shape", {"n_init": sink, "n_local": n_local}, lay))
        seen_vs: set[tuple[int, int]] = set()
        for rv, rs in VS_RATIOS:

            def vs(s: int, rv=rv, rs=rs) -> VerticalSlash:  # sizes as run (minimums applied)
                d = VerticalSlash()
                return VerticalSlash(k_v=min(t, max(d.min_k_v, rv * s)), k_s=min(t, max(d.min_k_s, rs * s)))

            s = _bisect_int(1, max(1, t // min(rv, rs)), lambda x: self._vs_layout(vs(x)).density(), target)
            pat = vs(s)
            lay = self._vs_layout(pat)
            if lay.density() <= target * OVER and (pat.k_v, pat.k_s) not in seen_vs:
                seen_vs.add((pat.k_v, pat.k_s))
                out.append(("vertical_slash", {"k_v": pat.k_v, "k_s": pat.k_s}, lay))
        n = self.n
        dense_blocks = n * (n + 1) / 2
        k_b = _bisect_int(1, n, lambda kb: BlockSparse(kb).blocks_listed(n) / dense_blocks, target)
        lay = BlockSparse(k_b).layout_from_scores(self.blocks, t)
        if lay.density() <= target * OVER:
            out.append(("block_sparse", {"k_b": k_b}, lay))
        if not out:
            raise KVTrimError(
                f"no pattern fits a density of {target_density} at {t} tokens (the smallest candidates cost more); "
                "raise --density or --length"
            )
        return out


def head_candidates(q: torch.Tensor, k: torch.Tensor, scale: float, target_density: float) -> list[tuple[str, dict, SparseLayout]]:
    """Candidates ``(pattern, sizes, layout)`` for one head (``q`` ``[1,1,T,D]``, ``k`` ``[1,1,T,D]``), each at ~the target cost."""
    return HeadCandidates(q, k, scale).candidates(target_density)


def sampled_blocks(n_blocks: int, count: int | None) -> torch.Tensor | None:
    """The query blocks a head's output error is measured on: ``count`` blocks spread evenly over
    the prompt, the last one always among them (``None``, or ``count >= n_blocks``: every block)."""
    if count is None or count >= n_blocks:
        return None
    if count < 1:
        raise KVTrimError(f"query_blocks must be >= 1 (or None for every block); got {count}")
    idx = torch.linspace(n_blocks - 1, 0, count).round().long().flip(0)  # the last block first, then evenly back
    keep = torch.zeros(n_blocks, dtype=torch.bool)
    keep[idx] = True
    return keep


def restrict(lay: SparseLayout, keep: torch.Tensor | None) -> SparseLayout:
    """The layout with nothing listed for the query blocks outside ``keep`` (their rows come out 0,
    at no cost): the same outputs on the kept rows for a fraction of the work."""
    if keep is None:
        return lay
    drop = ~keep.to(lay.block_cnt.device)
    return SparseLayout(lay.block_size, lay.seq_len, lay.block_idx, lay.block_cnt.masked_fill(drop, 0), lay.col_idx,
                        lay.col_cnt.masked_fill(drop, 0), lay.n_init, lay.n_local)


def block_rows(keep: torch.Tensor | None, t: int, block_size: int = 64) -> torch.Tensor | slice:
    """The token rows of the kept query blocks (all rows when ``keep`` is ``None``)."""
    if keep is None:
        return slice(None)
    rows = (torch.nonzero(keep).flatten()[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()
    return rows[rows < t]


class SearchHook:
    """Prefill hook: dense output for the model, candidate errors recorded per head.

    Passed to ``attach(model, prefill_attention=...)`` by :func:`search_patterns`; after the
    forward, ``rows[layer]`` holds each head's chosen entry (pattern, sizes, error, density, level
    and every candidate's error), the layer's row of the :class:`PatternConfig`.

    ``target_density`` is one cost level or an ascending sequence of levels: a head takes the
    cheapest level whose best candidate's error is at most ``max_error`` (``None``: the first
    level, no tolerance), and stays dense when no level meets it.

    ``query_blocks``: the error is measured on this many 64-row query blocks spread evenly over
    the prompt (:func:`sampled_blocks`); candidates compute only those rows (:func:`restrict`),
    so a candidate costs ``query_blocks / n_blocks`` of its full run. ``None``: every row.
    The candidates themselves (their sizes and costs) are built on the whole head either way.
    """

    def __init__(self, n_layers: int, n_heads: int, target_density, progress=None, max_error: float | None = None,
                 query_blocks: int | None = None):
        self.levels = sorted(target_density) if isinstance(target_density, (list, tuple)) else [target_density]
        self.max_error = max_error
        self.rows: list[list[dict] | None] = [None] * n_layers
        self.n_heads = n_heads
        self.progress = progress
        self.query_blocks = query_blocks

    def __call__(self, module, query, key, value, attention_mask, scale, **kwargs):
        li = getattr(module, "layer_idx", 0)
        q, k, v = query.float(), key.float(), value.float()
        g = q.shape[1] // k.shape[1]
        dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        keep = sampled_blocks(math.ceil(q.shape[2] / 64), self.query_blocks)
        rows = block_rows(keep, q.shape[2])
        row = []
        for h in range(q.shape[1]):
            kv = h // g
            qh, kh, vh = q[:, h : h + 1], k[:, kv : kv + 1], v[:, kv : kv + 1]
            ref = dense[:, h : h + 1, rows]
            ref_norm = ref.norm().clamp(min=1e-12)
            errors = {}
            chosen = None
            head = HeadCandidates(qh, kh, scale)
            for level in self.levels:
                try:
                    cands = head.candidates(level)
                except KVTrimError:  # nothing fits this level at this length
                    continue
                best = None
                for name, sizes, lay in cands:
                    o = sparse_attention_cpu(qh, kh, vh, restrict(lay, keep), scale)[:, :, rows]
                    err = float((o - ref).norm() / ref_norm)
                    label = candidate_label(level, name, sizes)
                    errors[label] = {"error": round(err, 6), "density": round(lay.density(), 4)}
                    if best is None or err < best["error"]:
                        best = {"pattern": name, **sizes, "error": round(err, 6), "density": round(lay.density(), 4), "level": level}
                if best is not None and (self.max_error is None or best["error"] <= self.max_error):
                    chosen = best
                    break
            if chosen is None:
                if self.max_error is None:
                    raise KVTrimError(f"no pattern fits the density levels {self.levels} at {q.shape[2]} tokens; raise --density or --length")
                chosen = {"pattern": "dense", "error": 0.0, "density": 1.0, "level": None}
            chosen["candidates"] = errors
            row.append(chosen)
            if self.progress is not None:
                self.progress.update(1)
        self.rows[li] = row
        return dense.to(query.dtype).transpose(1, 2).contiguous(), None


def calibration_ids(tokenizer, length: int, seed: int = 0) -> tuple[list[int], str]:
    """The calibration prompt: a multi-key needle retrieval over essays, ``length`` tokens."""
    from kvtrim.eval.tasks import make_samples
    from kvtrim.models import build_prompt_ids

    s = make_samples("niah_multikey", tokenizer, length, n=1, seed=seed)[0]
    return build_prompt_ids(tokenizer, s.prompt), f"niah_multikey over essays, seed {seed}"


@torch.inference_mode()
def search_patterns(model, tokenizer, length: int = 8192, target_density=DEFAULT_LEVELS, seed: int = 0,
                    progress: bool = True, model_tags: list[str] | None = None, max_error: float | None = DEFAULT_MAX_ERROR,
                    query_blocks: int | None = DEFAULT_QUERY_BLOCKS) -> PatternConfig:
    """Run the search on ``model`` and return its :class:`PatternConfig`.

    Args:
        length: calibration prompt length in tokens (>= 256, within the model's context).
        target_density: the executed cost candidates are sized to, as a fraction of dense
            causal attention at ``length`` (0 < d < 1): one level, or ascending levels tried in
            turn per head (see ``max_error``).
        max_error: a head takes the cheapest level whose best candidate has a relative output
            error at most this, and stays dense if none does. ``None``: one level, best candidate.
        query_blocks: measure each candidate's error on this many 64-row query blocks spread over
            the prompt instead of on every row (``None``: every row). The default, 32, is 1/4 of
            the rows at 8k and 1/16 at 32k; its agreement with the exhaustive search is measured
            by ``benchmarks/search_agreement.py`` (docs/minference.md).
    """
    from kvtrim.cache import KVTrimCache, cache_keyword
    from kvtrim.integrations.hf import attach

    levels = list(target_density) if isinstance(target_density, (list, tuple)) else [target_density]
    if not levels or not all(0.0 < d < 1.0 for d in levels):
        raise KVTrimError(f"target densities must be in (0, 1); got {target_density}")
    if max_error is not None and not max_error > 0:
        raise KVTrimError(f"max_error must be > 0; got {max_error}")
    if query_blocks is not None and (not isinstance(query_blocks, int) or isinstance(query_blocks, bool) or query_blocks < 1):
        raise KVTrimError(f"query_blocks must be an integer >= 1 (or None for every row); got {query_blocks!r}")
    cfg = model.config.get_text_config(decoder=True)
    max_ctx = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    if not isinstance(length, int) or length < 256:
        raise KVTrimError(f"--length must be an integer >= 256 tokens; got {length!r}")
    if max_ctx and length > max_ctx:
        raise KVTrimError(f"--length {length} exceeds the model's context of {max_ctx} tokens")
    ident = model_identity(model)
    ids, desc = calibration_ids(tokenizer, length, seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=ident["num_hidden_layers"] * ident["num_attention_heads"], desc="search-patterns", unit="head")
    hook = SearchHook(ident["num_hidden_layers"], ident["num_attention_heads"], levels, bar, max_error, query_blocks)
    t0, c0 = time.perf_counter(), time.process_time()
    cache = KVTrimCache(model, "full")
    device = next(model.parameters()).device
    with attach(model, prefill_attention=hook):
        model(input_ids=torch.tensor([ids], device=device), **{cache_keyword(): cache}, logits_to_keep=1)
    if bar is not None:
        bar.close()
    if any(r is None for r in hook.rows):
        missing = [i for i, r in enumerate(hook.rows) if r is None]
        raise KVTrimError(f"the search saw no prefill attention in layers {missing}; is this a supported (full-attention) model?")
    import kvtrim

    search = {
        "objective": "relative L2 error of the head's sparse output vs dense",
        "calibration": desc,
        "length": len(ids),
        "target_density": levels,
        "max_error": max_error,
        "candidates": {"a_shape_sinks": list(A_SHAPE_SINKS), "vertical_slash_ratios": [list(r) for r in VS_RATIOS]},
        "query_blocks": query_blocks,
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(time.process_time() - c0, 1),
        "threads": torch.get_num_threads(),
        "kvtrim": kvtrim.__version__,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "model_tags": list(model_tags or []),
    }
    scaling = rope_scaling_of(model)
    if scaling is not None:  # e.g. --rope-scaling yarn:2: shipped_configs matches it
        search["rope_scaling"] = scaling
    return PatternConfig(model=ident, layers=[r for r in hook.rows if r is not None], search=search)  # every row is set (checked above)


def candidate_label(level: float, name: str, sizes: dict[str, int]) -> str:
    """The key a search records a tried candidate under: ``"LEVEL:PATTERN:size=n,..."``
    (``"0.1:vertical_slash:n_vertical=1000,n_slash=600"``); :func:`parse_candidate_label` reads it back."""
    return f"{level}:{name}:" + ",".join(f"{a}={b}" for a, b in sizes.items())


def parse_candidate_label(label: str) -> tuple[float, str, dict[str, int]]:
    """``(level, pattern, sizes)`` of a :func:`candidate_label`."""
    level_s, name, sizes_s = label.split(":", 2)
    return float(level_s), name, {k: int(v) for k, v in (kv.split("=") for kv in sizes_s.split(",") if kv)}


def with_tolerance(cfg: PatternConfig, max_error: float) -> PatternConfig:
    """The config a search with the looser tolerance ``max_error`` would have made, from the
    candidates ``cfg``'s search recorded (no model run): a search stops at each head's first level
    within its tolerance, so every level up to that one is recorded, and a looser tolerance stops
    at the same level or a cheaper one. Refused when ``max_error`` is below the search's own.
    """
    searched = cfg.search.get("max_error")
    if not isinstance(searched, (int, float)) or not max_error >= searched:
        raise KVTrimError(f"a config searched with max_error {searched} can only be loosened (max_error >= {searched}); got {max_error}")
    layers = []
    for row in cfg.layers:
        out = []
        for e in row:
            best: dict[float, tuple[float, str, dict]] = {}
            for label, c in e.get("candidates", {}).items():
                level, name, sizes = parse_candidate_label(label)
                if level not in best or c["error"] < best[level][0]:
                    best[level] = (c["error"], name, {**sizes, "density": c["density"]})
            chosen = {"pattern": "dense", "error": 0.0, "density": 1.0, "level": None}
            for level in sorted(best):
                err, name, sizes = best[level]
                if err <= max_error:
                    chosen = {"pattern": name, **sizes, "error": err, "level": level}
                    break
            chosen["candidates"] = e.get("candidates", {})
            out.append(chosen)
        layers.append(out)
    search = dict(cfg.search, max_error=max_error, loosened_from=searched)
    return PatternConfig(model=cfg.model, layers=layers, search=search)


def save_config(cfg: PatternConfig, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write a searched pattern config as JSON, atomically and never through a symbolic link
    (:func:`kvtrim.files.write_atomic`); an existing file is refused unless ``force``."""
    return cfg.save(path, force=force)
