"""kvtrim's fused C++ CPU kernel for sparse prefill, built on first use.

The sources are ``csrc/sparse_attention.cpp`` (sparse prefill), ``csrc/fused_scores.cpp`` (dense
causal attention that also returns a KV method's scores), ``csrc/lowbit_decode.cpp`` (a decode
step's attention over low-bit KV codes), ``csrc/cpu_layers.cpp`` (a one-pass RMS norm) and ``csrc/common.h``, shipped in the package. It is compiled once per
machine and install (per CPU capability, since it is built with ``-march=native``, and per
checkout and torch install, so that two of them never rebuild each other's) with
:func:`torch.utils.cpp_extension.load` (needs a C++ compiler and ``ninja``; 12-15 s on 2 cores)
into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), then loaded from there.

The kernel takes float32, bfloat16 and float16 inputs as they are (no converted copy of q, k or
v) and computes in float32: each task converts the tiles it reads, accumulates in float32 and
writes its output in the input dtype, rounding once.

``KVTRIM_CPU_KERNEL`` picks the CPU path: ``auto`` (default: the native kernel, or the PyTorch
path with one warning if it cannot be built), ``native`` (fail with the build error instead),
``torch`` (always the PyTorch path). :func:`cpu_kernel` says which one runs; the prefill stats
report it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

__all__ = ["NATIVE_BLOCK", "NATIVE_DTYPES", "cpu_kernel", "kernel_for", "load_native", "native_causal_attention_scores",
           "native_lowbit_decode", "native_rms_norm", "native_sparse_attention",
           "native_flat_rows", "native_vertical_slash_layout",
           "native_vertical_slash_scores", "writable_in_place"]

NATIVE_BLOCK = 64  # the kernel's query/key block (kBlock in the source)

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "sparse_attention.cpp", _CSRC / "fused_scores.cpp", _CSRC / "lowbit_decode.cpp",
            _CSRC / "cpu_layers.cpp"]  # + csrc/common.h
_CHOICES = ("auto", "native", "torch")
_lock = threading.Lock()
_state: dict[str, object] = {}


def _choice() -> str:
    value = os.environ.get("KVTRIM_CPU_KERNEL", "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"KVTRIM_CPU_KERNEL must be one of {', '.join(_CHOICES)}; got {value!r}")
    return value


def _build_name(csrc: Path = _CSRC, torch_dir: str | None = None) -> str:
    """The extension's name in torch's build cache: one per CPU capability, torch version and
    install (this package's sources and torch's headers, by path).

    ninja rebuilds a directory whose build file names other paths, so two checkouts or two
    environments sharing one name would rebuild each other's kernel on every switch; a
    short hash of both paths keeps one build per install.
    """
    version = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    where = f"{Path(csrc).resolve()}\0{Path(torch_dir or os.path.dirname(torch.__file__)).resolve()}"
    digest = hashlib.sha1(where.encode()).hexdigest()[:10]
    return f"kvtrim_native_{torch.backends.cpu.get_cpu_capability().lower()}_{version}_{digest}"


def load_native() -> bool:
    """Build (once) and load the native kernel; True when ``torch.ops.kvtrim_native`` is ready.

    Raises the build error when ``KVTRIM_CPU_KERNEL=native``; otherwise a failure is logged once
    as a warning and the PyTorch path is used.
    """
    with _lock:
        if "ok" in _state:
            if not _state["ok"] and _choice() == "native":
                raise RuntimeError(f"kvtrim's native CPU kernel could not be built: {_state['error']}")
            return bool(_state["ok"])
        path = os.environ.get("PATH")
        try:
            from torch.utils import cpp_extension

            if shutil.which("ninja") is None:  # the `ninja` wheel (a dependency) outside an activated venv
                import ninja

                os.environ["PATH"] = os.pathsep.join(p for p in (ninja.BIN_DIR, path) if p)
            logger.info("building kvtrim's native CPU sparse-attention kernel (once per machine)")
            cpp_extension.load(
                # -march=native: one build per CPU capability, in case the cache is shared between machines,
                # and one per torch version and install, so two checkouts or environments (kvtrim's, vLLM's)
                # do not rebuild each other's (see _build_name)
                name=_build_name(),
                sources=[str(p) for p in _SOURCES],
                extra_include_paths=[str(_CSRC)],
                # -mprefer-vector-width=512: GCC's default for many AVX-512 CPUs is 256-bit vectors,
                # and the softmax's exponentials then ran at half width (docs/minference.md, "The
                # CPU kernels' rates"). A CPU without AVX-512 has no 512-bit vectors, and the flag
                # changes nothing there.
                extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffast-math",
                              "-fno-finite-math-only"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            _state["ok"] = True
        except Exception as exc:  # no compiler, no ninja, no headers, ...
            _state["ok"], _state["error"] = False, f"{type(exc).__name__}: {exc}"
            if _choice() == "native":
                raise RuntimeError(f"kvtrim's native CPU kernel could not be built: {_state['error']}") from exc
            logger.warning("kvtrim's native CPU kernel could not be built (%s); using the PyTorch path", _state["error"])
        finally:
            if path is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = path
        return bool(_state["ok"])


def cpu_kernel() -> str:
    """``"native"`` or ``"torch"``: the CPU sparse path that :func:`sparse_attention_cpu` will use."""
    choice = _choice()
    if choice == "torch":
        return "torch"
    return "native" if load_native() else "torch"


def kernel_for(x: torch.Tensor, kernel: str = "auto") -> str:
    """The CPU path for inputs like ``x``: ``kernel`` checked, ``"auto"`` resolved.

    ``"auto"`` is :func:`cpu_kernel` for float32/float16/bfloat16 CPU tensors and ``"torch"`` for
    float64 or non-CPU ones (the native kernel runs on CPU and computes in float32).
    """
    if kernel not in _CHOICES:
        raise ValueError(f"kernel must be 'auto', 'native' or 'torch'; got {kernel!r}")
    if kernel != "auto":
        return kernel
    return cpu_kernel() if (x.dtype != torch.float64 and x.device.type == "cpu") else "torch"


#: The input dtypes the native kernel reads directly (it computes in float32 for all of them).
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` with a contiguous last dimension; no copy when it already is (any other strides)."""
    x = x if x.dtype == dtype else x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def _native_dtype(q: torch.Tensor) -> torch.dtype:
    if q.dtype not in NATIVE_DTYPES:
        raise ValueError(f"the native kernel takes float32, bfloat16 or float16 inputs; got {q.dtype}")
    return q.dtype


def writable_in_place(out: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """True when the kernel may write ``out`` directly: a dtype it takes (that of ``inputs[0]`` when
    given), last dimension contiguous, no two elements at one address (checked on the strides), and
    no storage shared with ``inputs``."""
    want = inputs[0].dtype if inputs else out.dtype
    if out.dtype != want or out.dtype not in NATIVE_DTYPES or out.device.type != "cpu" or (out.numel() and out.stride(-1) != 1):
        return False
    span = 1
    for size, stride in sorted(zip(out.shape, out.stride()), key=lambda p: p[1]):
        if size > 1:
            if stride < span:
                return False
            span = stride * size
    ptr = out.untyped_storage().data_ptr()
    return all(x.untyped_storage().data_ptr() != ptr for x in inputs)


def _require_native() -> None:
    """Build/load the native kernel or raise (the ``native_*`` entry points below call it first)."""
    if not load_native():
        raise RuntimeError(f"kvtrim's native CPU kernel is not available: {_state.get('error')}")


def native_sparse_attention(q, k, v, heads, head_kv, block_idx, block_cnt, col_idx, col_cnt, n_init, n_local,
                            scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """One batch row: ``q [Hq, T, D]``, ``k``/``v`` ``[Hkv, T, D]``; row ``i`` of the layout is query
    head ``heads[i]`` and reads KV head ``head_kv[i]``.

    Layout tensors are ``[H, n_blocks, ...]`` (``H = len(heads)``); ``block_idx`` and ``col_idx``
    may instead be flat (1-D: every row's entries one after another, in row order, as many as its
    count; no padding to the widest row); ``n_init``/``n_local`` ``[H]``
    (negative: no A-shape window). q, k, v are float32, bfloat16 or float16 (k and v are taken
    in q's dtype) and read through their strides (not copied when their last dimension is
    contiguous); the kernel computes in float32 and writes the output in q's dtype.

    Returns:
        with ``out`` (``[Hq, T, D]`` in q's dtype, last dimension contiguous, e.g. a view of a
        ``[T, Hq, D]`` buffer), ``out[heads[i]]`` is written in place and ``out`` returned;
        without it, a new ``[H, T, D]`` tensor in q's dtype whose row ``i`` is head ``heads[i]``.
    """
    _require_native()

    def i32(x):
        return torch.as_tensor(x, dtype=torch.int32).contiguous()

    heads = i32(heads)
    dt = _native_dtype(q)
    if out is None:
        out = torch.empty(len(heads), q.shape[1], q.shape[2], dtype=dt)
        out_head = torch.arange(len(heads), dtype=torch.int32)
    else:
        if out.shape != q.shape or not writable_in_place(out, q, k, v):
            raise ValueError("out must be shaped like q, in q's dtype on CPU with a contiguous last dimension, "
                             "without overlapping elements, and must not share memory with q, k or v")
        out_head = heads
    torch.ops.kvtrim_native.sparse_attention_out(
        _rows(q, dt), _rows(k, dt), _rows(v, dt), heads, i32(head_kv), i32(block_idx), i32(block_cnt),
        i32(col_idx), i32(col_cnt), i32(n_init), i32(n_local), float(scale), out, out_head,
    )
    return out


def native_vertical_slash_scores(q: torch.Tensor, k: torch.Tensor, scale: float, last_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`VerticalSlash.scores <kvtrim.attention.patterns.VerticalSlash.scores>` for one batch row, fused.

    ``q [Hq, T, D]``, ``k [Hkv, T, D]`` (float32, bfloat16 or float16: k is read as it is, the last
    ``last_q`` query rows are converted to float32); returns ``(vert, slash)`` ``[Hq, T]`` float32.
    """
    _require_native()
    hq, t, _ = q.shape
    lq = min(last_q, t)
    head_kv = (torch.arange(hq) // (hq // k.shape[0])).to(torch.int32)
    return torch.ops.kvtrim_native.vertical_slash_scores(
        q[:, t - lq :].float().contiguous(), _rows(k, _native_dtype(k)), head_kv, float(scale)
    )


def native_flat_rows(idx: torch.Tensor, cnt: torch.Tensor) -> torch.Tensor:
    """Rows' entries one after another: ``idx [R, w]``, ``cnt [R]`` -> ``idx[r, :cnt[r]]`` for each
    ``r`` in order, int32 (the sparse kernel's flat layout); reads only the entries."""
    _require_native()
    return torch.ops.kvtrim_native.flat_rows(idx.to(torch.int32).contiguous(), cnt.to(torch.int32).contiguous())


def native_vertical_slash_layout(vertical_idx: torch.Tensor, slash_offsets: torch.Tensor, seq_len: int, block_size: int):
    """The vertical-slash layout build in C++: ``(block_idx, block_cnt, col_idx, col_cnt)`` for ``[R, n]`` rows.

    ``vertical_idx`` ``[R, n_v]`` sorted ascending, ``slash_offsets`` ``[R, n_s]``, int64 on CPU.
    """
    _require_native()
    return torch.ops.kvtrim_native.vertical_slash_layout(
        vertical_idx.long().contiguous(), slash_offsets.long().contiguous(), int(seq_len), int(block_size)
    )


def native_causal_attention_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                                   column_sums: bool = True, window: int = 0, out: torch.Tensor | None = None,
                                   column_max: bool = False,
                                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Causal attention of one batch row and, from the same probabilities, a KV method's scores.

    ``q [Hq, Tq, D]`` are the last ``Tq`` of the ``S`` keys in ``k``/``v [Hkv, S, D]`` (query ``i``
    sees keys ``<= S - Tq + i``); query head ``h`` reads KV head ``h // (Hq // Hkv)``. float32,
    bfloat16 or float16 (k, v taken in q's dtype), read through their strides. Computes in float32.

    Returns ``(out, col_sums, window_probs, col_max)``: ``out [Hq, Tq, D]`` in q's dtype (written
    into ``out`` when given: shaped like q, see :func:`writable_in_place`); ``col_sums [Hq, S]``
    float32, the sum over all queries of their softmax rows (None unless ``column_sums``);
    ``window_probs [Hq, w, S]`` float32, the softmax rows of the last ``w = window`` queries (None
    when 0); ``col_max [Hq, S]`` float32, the largest probability any query gives each key (None
    unless ``column_max``).
    """
    _require_native()
    dt = _native_dtype(q)
    hq, tq, _ = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=dt)
    elif out.shape != q.shape or not writable_in_place(out, q, k, v):
        raise ValueError("out must be shaped like q, in q's dtype on CPU with a contiguous last dimension, "
                         "without overlapping elements, and must not share memory with q, k or v")
    head_kv = (torch.arange(hq) // (hq // k.shape[0])).to(torch.int32)
    col, cmax, win = torch.ops.kvtrim_native.causal_attention_scores_out(
        _rows(q, dt), _rows(k, dt), _rows(v, dt), head_kv, float(scale), bool(column_sums), bool(column_max),
        int(min(window, tq)), out)
    return out, (col if column_sums else None), (win if window > 0 else None), (cmax if column_max else None)


def native_lowbit_decode(query: torch.Tensor, kv, logits: torch.Tensor, scale: float,
                         bias: torch.Tensor | None = None, rotation=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantized slots' part of a decode step (``csrc/lowbit_decode.cpp``): ``query [B, Hq, 1, D]``,
    ``kv`` a ``kvtrim.attention.lowbit.LowBitKV`` of ``lq >= 1`` slots; writes ``logits[..., :lq]``
    (``[B, Hkv, G, S]`` float32, contiguous) and returns the softmax state ``(max [B, Hkv, G, 1],
    sum [B, Hkv, G, 1], acc [B, Hkv, G, Dv])`` in float32, as the Triton twin does. ``rotation``: a
    ``kvtrim.attention.lowbit.KeyRotation`` (the turn of each slot's key since it was packed), or None."""
    _require_native()
    b, hq, _, d = query.shape
    hkv = kv.key_codes.shape[1]
    g = hq // hkv
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous")

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(b * hkv, *t.shape[2:]).contiguous()

    def rows(t: torch.Tensor) -> torch.Tensor:
        # a per-slot tensor as [B * Hkv, S, ...] rows without a copy where it is a view into a larger
        # allocation (a storage that dropped slots in place): the kernel steps from row to row by stride
        r = t.reshape(b * hkv, *t.shape[2:])
        inner = r.stride(-1) == 1 and (r.dim() == 2 or r.stride(1) == r.shape[2])
        return r if inner else r.contiguous()

    q = query.reshape(b * hkv, g, d).float().contiguous()
    bias_t = flat(bias.float()) if bias is not None else torch.empty(0)
    if rotation is not None:
        rot_index, rot_table, interleaved = flat(rotation.index), rotation.table.contiguous(), rotation.interleaved
    else:
        rot_index, rot_table, interleaved = torch.empty(0, dtype=torch.int32), torch.empty(0), False
    m, lsum, acc = torch.ops.kvtrim_native.lowbit_decode(
        q, rows(kv.key_codes), rows(kv.key_group), kv.key_table().contiguous(), rows(kv.value_codes),
        rows(kv.value_scale), rows(kv.value_zero), bias_t, rot_index, rot_table, bool(interleaved), int(kv.bits),
        float(scale), logits.view(b * hkv, g, -1))
    return m.view(b, hkv, g, 1), lsum.view(b, hkv, g, 1), acc.view(b, hkv, g, -1)


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMS norm of Llama-family models (``weight * (x / sqrt(mean(x**2) + eps))``, the normalised
    row rounded to x's dtype before the product, as transformers computes it) in one pass, on the CPU.

    ``x [..., H]`` and ``weight [H]`` share a dtype (float32, bfloat16 or float16); returns a new
    tensor like ``x``. Sums in float32 in its own order, so a value can differ from transformers'
    in its last bits: by at most one unit in the last place in bfloat16, a few in float32
    (``csrc/cpu_layers.cpp``; tests/test_cpu_layers.py).
    """
    _require_native()
    return torch.ops.kvtrim_native.rms_norm(x, weight, float(eps))
