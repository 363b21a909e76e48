"""What a measurement ran on, and giving memory back: shared by ``kvtrim eval``, ``kvtrim bench``
and the benchmark harness (:mod:`kvtrim.harness`)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import platform


def machine_info() -> dict:
    """Date, machine, versions, torch threads and the load average now (the start of a run)."""
    import torch
    import transformers

    import kvtrim

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvtrim": getattr(kvtrim, "__version__", "?"),
        "cpu_matrix_flags": cpu_matrix_flags(),
        "cpu_model": cpu_model(),
        "l2_cache_kib": l2_cache_kib(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


_MATRIX_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo(key: str) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line named ``key`` (None where the OS does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def cpu_matrix_flags() -> list[str] | None:
    """Which of the CPU's vector and matrix extensions that decide bfloat16 speed it reports
    (``/proc/cpuinfo`` flags among AVX2, FMA, AVX-512, AVX-512 BF16/FP16 and AMX), sorted; None where the OS
    does not say. Machines of one name differ here (with and without AMX), and bfloat16 timings
    with them, so every result records it."""
    flags = _cpuinfo("flags")
    if flags is None:
        return None
    have = set(flags.split())
    return sorted(flag for flag in _MATRIX_FLAGS if flag in have)


def cpu_model() -> str | None:
    """The CPU's model name as ``/proc/cpuinfo`` gives it (None where the OS does not say)."""
    return _cpuinfo("model name")


def l2_cache_kib() -> int | None:
    """One core's L2 cache in KiB (sysfs; None where the OS does not say). Attention kernels that
    keep a block of scores in cache run differently with 512 KiB and 2 MiB, so results record it."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(e for e in os.listdir(base) if e.startswith("index")):
            with open(os.path.join(base, entry, "level")) as f:
                if f.read().strip() != "2":
                    continue
            with open(os.path.join(base, entry, "size")) as f:
                size = f.read().strip().upper()
            scale = {"K": 1, "M": 1024}.get(size[-1:])
            return int(size[:-1]) * scale if scale else int(size) // 1024
    except (OSError, ValueError):
        return None
    return None


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages now (None where the OS does not say)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim`` (None where the C library has none: not Linux, or not glibc)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Hand the heap's free pages back to the OS now (glibc ``malloc_trim(0)``); False where there is none."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    A sweep allocates and frees caches of many sizes per sample; without trimming, glibc keeps the
    freed pages and a long sweep's resident memory grows to several times what one sample needs.
    """
    import gc

    gc.collect()
    trim_heap()


@dataclasses.dataclass
class TrimCount:
    """How many heap trims :func:`heap_trimmed_per_module` has made (benchmarks report it)."""

    trims: int = 0


@contextlib.contextmanager
def heap_trimmed_per_module(model):
    """Within the block, trim the heap (glibc ``malloc_trim(0)``) after the forward of every module of ``model``.

    glibc keeps freed blocks of up to 32 MiB in its heap once it has raised its mmap threshold, so
    inside one forward the activations freed by one layer stay resident while the next allocates
    its own, and a chunked prefill's resident set grows well past what is alive (docs/memory.md,
    "The allocator"). Trimming after each module returns them as soon as they are freed; the
    arithmetic is untouched. The hooks are removed on leaving the block, also on an error; no
    allocator setting is changed. A no-op where there is no ``malloc_trim``, and for a model whose
    weights are not on the CPU (its activations are not in this heap: the trims would only cost time).

    Yields a :class:`TrimCount` whose ``trims`` counts the trims made so far in the block.
    """
    count = TrimCount()
    trim = _malloc_trim()
    first = next(model.parameters(), None)
    if trim is None or (first is not None and first.device.type != "cpu"):
        yield count
        return

    def after(module, args, output):
        trim(0)
        count.trims += 1

    handles = [m.register_forward_hook(after) for m in model.modules()]
    try:
        yield count
    finally:
        for h in handles:
            h.remove()
