"""What a measurement ran on, and giving memory back: shared by ``kvtrim eval``, ``kvtrim bench``
and the benchmark harness (:mod:`kvtrim.harness`)."""

from __future__ import annotations

import datetime
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
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages now (None where the OS does not say)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    A sweep allocates and frees caches of many sizes per sample; without trimming, glibc keeps the
    freed pages and a long sweep's resident memory grows to several times what one sample needs.
    """
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name and platform.system() == "Linux":
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass
