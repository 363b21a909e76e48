"""Sparse prefill inside a transformers model: per-head MInference patterns behind one hook.

This is the transformers-facing half of sparse prefill: the hook has the signature of a
transformers attention function, and a :class:`PatternConfig` belongs to one model (its layer and
head counts). The kernels it runs (pattern index estimation, the CPU and Triton paths) live in
:mod:`kvtrim.attention` and work on plain tensors.

:class:`SparsePrefill` is the function kvtrim's attention calls for a prefill forward (the first
forward of a sequence, ``q_len == k_len > 1``). It picks each head's pattern (one pattern for all
heads, or a per-layer, per-head :class:`PatternConfig` found by ``kvtrim search-patterns``),
estimates the indices from the head's own ``q`` and ``k``, and runs the sparse kernel (the CPU
path, or Triton on CUDA). Decode steps and later chunks never come here: they stay dense.

It falls back to dense attention, and records why, when the prompt is shorter than
``min_length`` or than the patterns need (a pattern that would select every block is dense
anyway, only slower), or when the attention mask is not plain causal (padding). ``stats()``
reports the executed density (work counted as the kernel runs it: whole 64x64 blocks and 64-row
columns, against dense causal attention counted the same way) and the time spent estimating
indices vs computing attention.

Pattern configs are JSON files::

    {"format": "kvtrim-pattern-config/1",
     "model": {"name": ..., "architecture": ..., "num_hidden_layers": 30, "num_attention_heads": 9,
               "num_key_value_heads": 3, "head_dim": 64},
     "search": {...how it was made...},
     "layers": [[{"pattern": "vertical_slash", "k_v": 400, "k_s": 700, "error": 0.01}, ...], ...]}

A config made for another model (layer or head counts, head_dim) is refused with a clear error.
"""

from __future__ import annotations

import json
import math
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from kvtrim.attention.cpu import sparse_attention_cpu, sparse_attention_heads
from kvtrim.attention.native import cpu_kernel, kernel_for
from kvtrim.attention.patterns import AShape, BlockSparse, SparseLayout, VerticalSlash, vertical_slash_layout
from kvtrim.errors import KVTrimError
from kvtrim.files import parse_json, read_json, write_atomic
from kvtrim.rope import scaling_label

FORMAT = "kvtrim-pattern-config/1"
PREFILL_MODES = ("dense", "minference", "a_shape", "vertical_slash", "block_sparse")
PATTERNS = {"a_shape": AShape, "vertical_slash": VerticalSlash, "block_sparse": BlockSparse}
# Size parameters a config entry may carry per pattern (the rest keep their defaults).
SIZE_KEYS = {"a_shape": ("n_init", "n_local"), "vertical_slash": ("k_v", "k_s"), "block_sparse": ("k_b",)}
# Keys a config entry may carry besides ``pattern`` and its sizes: the search's diagnostics.
DIAGNOSTIC_KEYS = ("error", "density", "level", "candidates")
#: Below this many prompt tokens the default SparsePrefill runs dense: twice the measured break-even,
#: where the gain was clear on every machine measured (docs/minference.md, "Why 4096"); the vLLM
#: plugin's default (kvtrim.integrations.vllm.config.DEFAULT_MIN_LENGTH) is the same.
DEFAULT_MIN_LENGTH = 4096


def make_pattern(name: str, **sizes):
    """A pattern object by name with validated sizes: ``make_pattern("block_sparse", k_b=32)``."""
    if name not in PATTERNS:
        raise KVTrimError(f"unknown sparse pattern {name!r}; known patterns: {', '.join(PATTERNS)}")
    allowed = set(SIZE_KEYS[name]) | {"block_size", "last_q", "keep_first_columns", "keep_near_diagonals"}
    unknown = set(sizes) - allowed
    if unknown:
        raise KVTrimError(f"pattern {name!r} does not take {sorted(unknown)}; sizes it takes: {', '.join(SIZE_KEYS[name])}")
    try:
        pat = PATTERNS[name](**sizes)
    except (TypeError, ValueError) as e:
        raise KVTrimError(f"bad sizes for pattern {name!r}: {e}") from None
    return pat


def model_identity(model) -> dict:
    """What a pattern config must match: the text model's layer/head counts and head_dim."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model, "config") else model
    heads = int(cfg.num_attention_heads)
    return {
        "name": str(getattr(model.config, "name_or_path", "") or getattr(cfg, "_name_or_path", "") or ""),
        "architecture": (getattr(model.config, "architectures", None) or [type(model).__name__])[0],
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
    }


@dataclass
class PatternConfig:
    """Per layer and query head: a pattern name and its sizes (plus search diagnostics)."""

    model: dict
    layers: list[list[dict]]
    search: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, dict):
            raise KVTrimError(f"pattern config: 'model' must be an object with the model's layer and head counts, "
                              f"got {type(self.model).__name__}")
        n_l, n_h = self.model.get("num_hidden_layers"), self.model.get("num_attention_heads")
        for key, n in (("num_hidden_layers", n_l), ("num_attention_heads", n_h)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise KVTrimError(f"pattern config: model.{key} must be a positive integer, got {n!r}")
        if not isinstance(self.layers, list) or not all(isinstance(row, list) for row in self.layers):
            raise KVTrimError("pattern config: 'layers' must be a list (one per layer) of lists (one entry per head)")
        if not isinstance(self.search, dict):
            raise KVTrimError(f"pattern config: 'search' must be an object, got {type(self.search).__name__}")
        if len(self.layers) != n_l or any(len(row) != n_h for row in self.layers):
            raise KVTrimError(
                f"pattern config is inconsistent: the model has {n_l} layers x {n_h} heads, "
                f"the config lists {len(self.layers)} layers with {sorted({len(r) for r in self.layers})} heads"
            )
        self._patterns = [[self._build(li, hi, e) for hi, e in enumerate(row)] for li, row in enumerate(self.layers)]

    @staticmethod
    def _build(li: int, hi: int, entry: dict):
        where = f"pattern config, layer {li} head {hi}"
        if not isinstance(entry, dict):
            raise KVTrimError(f"{where}: an entry must be an object with a 'pattern', got {entry!r}")
        name = entry.get("pattern")
        if not isinstance(name, str):
            raise KVTrimError(f"{where}: 'pattern' must be a pattern name, got {name!r}")
        if name != "dense" and name not in PATTERNS:
            raise KVTrimError(f"{where}: unknown sparse pattern {name!r}; known patterns: {', '.join(PATTERNS)}")
        takes = SIZE_KEYS.get(name, ())
        unknown = sorted(set(entry) - {"pattern", *takes, *DIAGNOSTIC_KEYS})
        if unknown:  # a misspelt size would otherwise be ignored and its default used
            raise KVTrimError(f"{where}: unknown key(s) {unknown} for pattern {name!r}; it takes "
                              f"{', '.join(takes) or 'no sizes'} (and the diagnostics {', '.join(DIAGNOSTIC_KEYS)})")
        if name == "dense":  # a head the search found no sparse pattern good enough for
            return None
        sizes = {k: entry[k] for k in takes if k in entry}
        for k, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise KVTrimError(f"{where}: size {k} must be an integer, got {v!r}")
        try:
            return make_pattern(name, **sizes)
        except KVTrimError as e:
            raise KVTrimError(f"{where}: {e}") from None

    def pattern(self, layer: int, head: int):
        return self._patterns[layer][head]

    def check(self, model) -> None:
        """Refuse a config made for another model (layer count, head count, KV heads, head_dim)."""
        ident = model_identity(model)
        bad = [
            f"{k}: config {self.model.get(k)} vs model {ident[k]}"
            for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
            if self.model.get(k) != ident[k]
        ]
        if bad:
            raise KVTrimError(
                f"pattern config was made for another model ({self.model.get('name') or 'unnamed'}): " + "; ".join(bad)
                + ". Make one for this model with `kvtrim search-patterns --model ... --out FILE`."
            )

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self.layers:
            for e in row:
                out[e["pattern"]] = out.get(e["pattern"], 0) + 1
        return out

    def to_json(self) -> dict:
        return {"format": FORMAT, "model": self.model, "search": self.search, "layers": self.layers}

    def save(self, path: str | os.PathLike, *, force: bool = True) -> Path:
        """Write the config as JSON, atomically and never through a symbolic link
        (:func:`kvtrim.files.write_atomic`; its folder is made); ``force=False`` refuses an existing file."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(p, json.dumps(self.to_json(), indent=1) + "\n", force=force)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PatternConfig":
        """Read a config written by :meth:`save` (``kvtrim search-patterns``): a regular file within
        the size limit of a JSON file (:func:`kvtrim.files.read_json`: a FIFO, a device or a huge
        file is one line, nothing blocks), checked entry by entry."""
        d = read_json(path, "pattern config")
        return cls.from_json(d, f"pattern config {str(path)!r}")

    @classmethod
    def from_json(cls, d, where: str = "pattern config") -> "PatternConfig":
        """A config from its JSON document (``where`` names it in errors: ``"pattern config 'x.json'"``)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise KVTrimError(f"{where} is not a {FORMAT} file")
        missing = [k for k in ("model", "layers") if k not in d]
        if missing:
            raise KVTrimError(f"{where} has no {' or '.join(map(repr, missing))}; a {FORMAT} file "
                              "holds 'model' (layer and head counts) and 'layers' (a pattern per head)")
        try:
            return cls(model=d["model"], layers=d["layers"], search=d.get("search", {}))
        except KVTrimError as e:  # name the file: "pattern config 'x.json', layer 0 head 3: ..."
            raise KVTrimError(str(e).replace("pattern config", where, 1)) from None


def rope_scaling_of(model) -> str | None:
    """The RoPE scaling a model runs under, as ``--rope-scaling`` writes it (``"yarn:2"``), or
    ``None`` for its plain RoPE. A search records it (``search["rope_scaling"]``): a config found
    under one scaling describes the heads of that model, not of the unscaled one."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    kind = str(rope.get("rope_type", rope.get("type", "default")))
    return None if kind == "default" else scaling_label(kind, rope.get("factor", 1.0))


def shipped_configs(model) -> list[PatternConfig]:
    """The configs shipped in the package for this model (matched by layer/head counts and name),
    shortest calibration length first; several when the model has configs searched at several
    lengths (:func:`pick_config` chooses per prompt). Configs searched under the RoPE scaling the
    model runs with (:func:`rope_scaling_of`; none for a plain model) come first: only they are
    returned when any ships, else the unscaled ones (the nearest there is)."""
    ident = model_identity(model)
    root = resources.files("kvtrim.attention") / "configs"  # package data, beside the kernels
    if not root.is_dir():
        return []
    found = []
    for f in sorted(root.iterdir(), key=lambda f: f.name):
        if not f.name.endswith(".json"):
            continue
        d = parse_json(f.read_bytes(), "shipped pattern config", f.name)  # package data: a Traversable, maybe in a zip
        m = d.get("model", {})
        same_shape = all(m.get(k) == ident[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"))
        if same_shape and any(tag in ident["name"] for tag in d.get("search", {}).get("model_tags", [])):
            found.append(PatternConfig(model=m, layers=d["layers"], search=d.get("search", {})))
    scaling = rope_scaling_of(model)
    same = [c for c in found if c.search.get("rope_scaling") == scaling]
    if not same and scaling is not None:
        same = [c for c in found if c.search.get("rope_scaling") is None]
    return sorted(same, key=calibration_length)


def shipped_config(model) -> PatternConfig | None:
    """The shipped config with the shortest calibration length for this model, if any (see :func:`shipped_configs`)."""
    found = shipped_configs(model)
    return found[0] if found else None


def calibration_length(cfg: PatternConfig) -> int:
    """The prompt length a config was searched at (0 when it does not say)."""
    n = cfg.search.get("length", 0)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def pick_config(configs: Sequence[PatternConfig], t: int) -> PatternConfig:
    """The config for a ``t``-token prompt: the one searched at the length nearest to ``t`` on a log
    scale (sizes are absolute, so a config gets sparser, and its error larger, as prompts grow past
    its calibration length; measured in docs/minference.md). A tie goes to the longer calibration,
    which is the denser one at ``t``."""
    if len(configs) == 1:
        return configs[0]
    return min(configs, key=lambda c: (abs(math.log(max(calibration_length(c), 1) / max(t, 1))), -calibration_length(c)))


class SparsePrefill:
    """The prefill attention hook (see the module docstring).

    Args:
        mode: ``"minference"`` (per-head config), ``"a_shape"``, ``"vertical_slash"`` or
            ``"block_sparse"`` (one pattern for every head, sizes from ``sizes``), or ``"dense"``
            (no sparsity; the hook only measures).
        config: a :class:`PatternConfig` (``minference`` mode).
        sizes: pattern sizes for the single-pattern modes (default: the published defaults).
        min_length: prompts shorter than this run dense (recorded as a fallback).
        backend: ``"auto"`` (Triton on CUDA when installed, else the CPU path), ``"cpu"``,
            ``"triton"``, ``"reference"`` (explicit mask; tests only).
    """

    def __init__(self, mode: str = "minference", config: PatternConfig | Sequence[PatternConfig] | None = None,
                 sizes: dict | None = None, min_length: int = DEFAULT_MIN_LENGTH, backend: str = "auto"):
        if mode not in PREFILL_MODES:
            raise KVTrimError(f"unknown prefill mode {mode!r}; choose one of: {', '.join(PREFILL_MODES)}")
        if isinstance(config, (list, tuple)):
            if not config:
                config = None
            elif not all(isinstance(c, PatternConfig) for c in config):
                raise KVTrimError("config must be a PatternConfig or a sequence of them")
        if mode == "minference" and config is None:
            raise KVTrimError("prefill mode 'minference' needs a pattern config (see `kvtrim search-patterns`)")
        if mode != "minference" and config is not None:
            raise KVTrimError(f"a pattern config is only used with prefill mode 'minference', not {mode!r}")
        if sizes and mode in ("dense", "minference"):
            raise KVTrimError(f"pattern sizes are only used with a single-pattern prefill mode, not {mode!r}")
        if not isinstance(min_length, int) or min_length < 1:
            raise KVTrimError(f"min_length must be a positive integer; got {min_length!r}")
        if backend not in ("auto", "cpu", "triton", "reference"):
            raise KVTrimError(f"backend must be auto, cpu, triton or reference; got {backend!r}")
        #: every config (one per calibration length, shortest first); ``config`` is the one in use,
        #: picked per prompt by :func:`pick_config`
        if isinstance(config, PatternConfig):
            config = [config]
        self.configs: list[PatternConfig] = sorted(config or [], key=calibration_length)
        self.mode, self.min_length, self.backend = mode, min_length, backend
        self.config: PatternConfig | None = self.configs[0] if self.configs else None
        self.single = make_pattern(mode, **(sizes or {})) if mode in PATTERNS else None
        if mode != "dense" and (backend == "cpu" or (backend == "auto" and not torch.cuda.is_available())):
            # Build/load the native CPU kernel now, not inside the first forward: loading runs
            # subprocesses (compiler and ninja checks), and forking a process that holds a long
            # prompt's activations cost 11 s at 32k tokens.
            try:
                cpu_kernel()
            except ValueError as exc:  # a bad KVTRIM_CPU_KERNEL value
                raise KVTrimError(str(exc)) from None
        self.reset_stats()

    # -- bookkeeping ------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self._work = 0.0
        self._dense = 0.0
        self.estimate_seconds = 0.0
        self.attention_seconds = 0.0
        self.layers_sparse = 0
        self.layers_dense = 0
        self.fallback: str | None = None
        self.kernel: str | None = None
        self._mask_checked: tuple[weakref.ref[torch.Tensor], int | None, bool] | None = None

    def stats(self) -> dict:
        return {
            "prefill": self.mode,
            "density": (self._work / self._dense) if self._dense else 1.0,
            "sparse_layers": self.layers_sparse,
            "dense_layers": self.layers_dense,
            "fallback": self.fallback,
            "estimate_seconds": self.estimate_seconds,
            "attention_seconds": self.attention_seconds,
            "min_length": self.min_length,
            "kernel": self.kernel,
            "config_length": calibration_length(self.config) if self.config is not None else None,
        }

    def check_model(self, model) -> None:
        for cfg in self.configs:
            cfg.check(model)

    # -- the hook ---------------------------------------------------------------------------
    def pattern_for(self, layer_idx: int, head: int):
        if self.single is not None:
            return self.single
        assert self.config is not None  # a sparse prefill runs one pattern or a config
        return self.config.pattern(layer_idx, head)

    def _fallback_reason(self, query, key, attention_mask) -> str | None:
        t = query.shape[-2]
        if self.mode == "dense":
            return "prefill mode is dense"
        if key.shape[-2] != t:
            return "not a first prefill (the cache already holds tokens)"
        if query.shape[0] != 1:
            return "batch > 1"
        if t < self.min_length:
            return f"prompt of {t} tokens is shorter than min_length={self.min_length}"
        if attention_mask is not None:
            m = attention_mask[0, 0] if attention_mask.dim() == 4 else attention_mask
            if m.shape[-2:] != (t, t):
                return "attention mask is not square"
            # Every layer of a forward gets the same mask tensor: check it once (a T x T comparison
            # costs ~1 s per layer at 32k). A weak reference: the hook must not keep the mask alive.
            seen, version = self._mask_checked, _version(attention_mask)
            if seen is None or seen[0]() is not attention_mask or seen[1] != version:
                allowed = m if m.dtype == torch.bool else m == 0
                ok = torch.equal(allowed, torch.ones(t, t, dtype=torch.bool, device=m.device).tril_())
                seen = self._mask_checked = (weakref.ref(attention_mask), version, ok)
            if not seen[2]:
                return "attention mask is not plain causal (padding)"
        return None

    def _layouts(self, layer_idx: int, q, k, scale) -> list[SparseLayout | None]:
        """One layout per query head; ``None`` for a head the config keeps dense.

        Vertical-slash heads share their estimation: the column and diagonal sums of every query
        head of the layer come from one batched pass (:meth:`VerticalSlash.scores`, the fused
        native version on CPU), each head takes its own top ``k_v`` / ``k_s``, and one layout
        build serves them all. The layouts equal those of each head's own ``layout()``.
        """
        g = q.shape[1] // k.shape[1]
        pats = [self.pattern_for(layer_idx, h) for h in range(q.shape[1])]
        out: list[SparseLayout | None] = [None] * len(pats)
        groups: dict[tuple[int, int], list[int]] = {}
        for h, pat in enumerate(pats):
            if isinstance(pat, VerticalSlash):
                groups.setdefault((pat.last_q, pat.block_size), []).append(h)
        native = self._backend(q) == "cpu" and kernel_for(q) == "native"
        for (last_q, bs), heads in groups.items():
            if len(heads) < 2 or q.shape[0] != 1:
                continue
            vert, slash = VerticalSlash.scores(q, k, scale, last_q, native=native)
            picked = [pats[h].select(vert[:, h : h + 1], slash[:, h : h + 1]) for h in heads]
            # One layout build for the group: shorter index lists are padded with a repeat of their
            # first entry (the builder ignores duplicates), then each head gets its row as views.
            n_v = max(v.shape[-1] for v, _ in picked)
            n_s = max(s.shape[-1] for _, s in picked)
            v_all = torch.cat([torch.cat([v, v[..., :1].expand(*v.shape[:2], n_v - v.shape[-1])], -1) for v, _ in picked], 1)
            s_all = torch.cat([torch.cat([s, s[..., :1].expand(*s.shape[:2], n_s - s.shape[-1])], -1) for _, s in picked], 1)
            lay = vertical_slash_layout(v_all, s_all, q.shape[2], bs, native=native)
            for row, h in enumerate(heads):
                out[h] = lay.head(0, row)
        for h, pat in enumerate(pats):
            if pat is not None and out[h] is None:
                out[h] = pat.layout(q[:, h : h + 1], k[:, h // g : h // g + 1], scale)
        return out

    def _backend(self, q) -> str:
        if self.backend != "auto":
            return self.backend
        from kvtrim.attention.triton import triton_available

        return "triton" if (q.is_cuda and triton_available()) else "cpu"

    def _kernel(self, q, k, v, lay, scale):
        backend = self._backend(q)
        if backend == "cpu":
            return sparse_attention_cpu(q, k, v, lay, scale)
        from kvtrim.attention import sparse_prefill

        return sparse_prefill(q, k, v, lay, scale, backend=backend)

    def __call__(self, module, query, key, value, attention_mask, scale, dense_fn=None, **kwargs):
        """``[B, Hq, T, D]`` q and ``[B, Hkv, T, D]`` k, v -> (``[B, T, Hq, D]`` output, None)."""
        layer_idx = getattr(module, "layer_idx", 0)
        t = query.shape[-2]
        reason = self._fallback_reason(query, key, attention_mask)
        n = math.ceil(t / 64)
        dense_work = n * (n + 1) / 2 * 64 * 64 * query.shape[1]
        self._dense += dense_work
        if reason is not None:
            if self.mode != "dense":
                self.fallback = self.fallback or reason
            self.layers_dense += 1
            self._work += dense_work
            if self.mode == "dense" and key.shape[-2] == t and attention_mask is None:  # measured dense SDPA
                t0 = time.perf_counter()
                out = torch.nn.functional.scaled_dot_product_attention(
                    query, key, value, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
                )
                self.attention_seconds += time.perf_counter() - t0
                return out.transpose(1, 2).contiguous(), None
            return None
        if len(self.configs) > 1:
            self.config = pick_config(self.configs, t)
        t0 = time.perf_counter()
        layouts = self._layouts(layer_idx, query, key, scale)
        t1 = time.perf_counter()
        g = query.shape[1] // key.shape[1]
        # [B, Hq, T, D] view of a [B, T, Hq, D] buffer: the layer's output layout, so the kernel
        # writes rows in place and the final transpose is free.
        b_, hq_, _, d_ = query.shape
        out = query.new_empty(b_, t, hq_, d_).transpose(1, 2)
        # Dense heads: one SDPA call per KV head, over all of its dense query heads (GQA, no copies of k/v).
        for kv in range(key.shape[1]):
            hs = [h for h in range(kv * g, (kv + 1) * g) if layouts[h] is None]
            if not hs:
                continue
            idx = torch.as_tensor(hs, device=query.device)
            out[:, idx] = torch.nn.functional.scaled_dot_product_attention(
                query[:, idx], key[:, kv : kv + 1], value[:, kv : kv + 1], is_causal=True, scale=scale,
                enable_gqa=len(hs) > 1,
            )
            self._work += dense_work / query.shape[1] * len(hs)
        sparse = [h for h, lay in enumerate(layouts) if lay is not None]
        sparse_layouts = [lay for lay in layouts if lay is not None]
        for lay in sparse_layouts:
            self._work += lay.density() * (lay.n_blocks * (lay.n_blocks + 1) / 2 * lay.block_size**2)
        backend = self._backend(query)
        if sparse:
            if backend == "cpu":
                self.kernel = f"cpu-{kernel_for(query)}"
            else:
                self.kernel = backend
        if sparse and backend == "cpu" and query.shape[0] == 1:
            # All sparse heads of the layer in one call: the native kernel shares the layer's work out,
            # reads q/k/v through their strides and writes into `out` (no copies of T-long tensors).
            sparse_attention_heads(query, key, value, sparse, sparse_layouts, scale, out=out)
        else:
            for h in sparse:
                kv = h // g
                out[:, h : h + 1] = self._kernel(query[:, h : h + 1], key[:, kv : kv + 1], value[:, kv : kv + 1], layouts[h], scale)
        t2 = time.perf_counter()
        self.estimate_seconds += t1 - t0
        self.attention_seconds += t2 - t1
        self.layers_sparse += 1
        return out.transpose(1, 2).contiguous(), None


def _version(t: torch.Tensor) -> int | None:
    """In-place version counter; ``None`` for inference-mode tensors (they have none, and cannot be
    modified in place outside inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None


def make_prefill(model, mode: str, pattern_config: str | Path | PatternConfig | None = None, sizes: dict | None = None,
                 min_length: int = DEFAULT_MIN_LENGTH, backend: str = "auto") -> SparsePrefill:
    """Build the prefill hook for ``model``, resolving ``minference``'s config.

    ``pattern_config`` may be a path or a :class:`PatternConfig`; for ``minference`` without one,
    the configs shipped for the model are used (one per calibration length, picked per prompt by
    :func:`pick_config`), and a model with none gets a clear error.
    """
    if mode not in PREFILL_MODES:
        raise KVTrimError(f"unknown prefill mode {mode!r}; choose one of: {', '.join(PREFILL_MODES)}")
    cfg: PatternConfig | list[PatternConfig] | None = (PatternConfig.load(pattern_config)
                                                         if isinstance(pattern_config, (str, Path)) else pattern_config)
    if mode == "minference" and cfg is None:
        cfg = shipped_configs(model) or None
        if cfg is None:
            raise KVTrimError(
                "no pattern config ships for this model; make one with "
                "`kvtrim search-patterns --model PATH --out FILE` and pass --pattern-config FILE"
            )
    if cfg is not None and mode != "minference":
        raise KVTrimError(f"--pattern-config is used with --prefill minference only, not {mode!r}")
    hook = SparsePrefill(mode, config=cfg, sizes=sizes, min_length=min_length, backend=backend)
    hook.check_model(model)
    return hook
