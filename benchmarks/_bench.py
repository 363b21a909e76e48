"""Shared pieces of the benchmark scripts: machine/version record and the ``--table``/``--out`` contract."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch


def machine_info() -> dict:
    """Date, machine, versions, torch threads and the load average at the start of a run."""
    import transformers

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "loadavg_start": list(os.getloadavg()),
    }


def print_table_or_require_out(parser, args, table) -> bool:
    """``--table FILE``: print ``table(json)`` and return True (the script exits); else require ``--out``."""
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return True
    if not args.out:
        parser.error("--out is required")
    return False
