"""How long the README's test command takes, and its fast tier: one run of the whole suite, timed.

Runs ``python -m pytest -q`` (the README's command; CI runs it through ``.ci/run``) once in a child
process with a JUnit XML report, and records the wall time, the summary counts and every test's
duration. The fast tier is the tests ``-m FAST`` selects (collected, not run, by ``pytest
--collect-only``); its time is the collection's plus its tests' durations in the same run (the
slowest tests are listed, with their markers, so that the tier can be kept fast).

    OMP_NUM_THREADS=1 python benchmarks/test_suite.py --out benchmarks/results/test_suite.json
    python benchmarks/test_suite.py --table benchmarks/results/test_suite.json     # the README's lines
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from kvtrim import harness

ROOT = Path(__file__).resolve().parents[1]
#: the fast tier's marker expression (README, CONTRIBUTING)
FAST = "not model and not slow and not qwen"


def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 600 else f"{int(s // 60)} min {int(s % 60):02d} s"


def table(r: dict) -> str:
    """The README's lines on the test command's duration."""
    m = r["machine"]
    fast = r["fast"]
    return "\n".join([
        "| tests | command | tests run | time |", "|---|---|---:|---:|",
        f"| all | `.venv/bin/python -m pytest -q` | {r['counts'].get('passed', 0)} passed, "
        f"{r['counts'].get('skipped', 0)} skipped | {_minutes(r['wall_seconds'])} |",
        f"| fast tier | `.venv/bin/python -m pytest -q -m \"{fast['marker']}\"` | {fast['tests']} | "
        f"{_minutes(fast['seconds'])} |", "",
        f"Measured by `benchmarks/test_suite.py` on {m['cpus']} cores of an {m.get('cpu_model') or m['machine']} "
        f"with OMP_NUM_THREADS={r['omp_num_threads'] or 'unset'}, load average {m['loadavg_start'][0]:.1f} -> "
        f"{m['loadavg_end'][0]:.1f} ({'quiet at the start' if m['loadavg_start'][0] < 0.5 else 'the machine was shared'}), "
        f"{m['date'][:10]}, "
        f"{'with' if r['qwen_installed'] else 'without'} the reference model installed; the fast tier's time is the "
        "collection's plus its tests' durations in that run."])


def _node_ids(marker: str | None, env: dict) -> tuple[list[str], float]:
    """The node ids pytest collects (with ``-m marker``) and the seconds collecting took."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd + (["-m", marker] if marker else []), cwd=ROOT, env=env, capture_output=True, text=True,
                         check=False).stdout
    return [ln for ln in out.splitlines() if "::" in ln], time.perf_counter() - t0


def _junit_times(path: Path) -> dict[str, float]:
    """Seconds per test from a JUnit XML report, keyed like pytest's node ids (``tests/x.py::name``)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        # tests.test_x[.TestClass] -> tests/test_x.py[::TestClass]
        i = next((k for k in range(len(parts), 0, -1) if (ROOT / Path(*parts[:k])).with_suffix(".py").is_file()), 0)
        node = "/".join(parts[:i]) + ".py" + "".join(f"::{p}" for p in parts[i:]) + f"::{case.get('name')}"
        out[node] = float(case.get("time", 0))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (default: none, the README's command)")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    from kvtrim import reference_models as rm

    info = harness.machine_record()
    env = dict(os.environ)
    fast_ids, collect_seconds = _node_ids(FAST, env)
    with tempfile.TemporaryDirectory(prefix="kvtrim-test-suite-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args.pytest_args]
        t0 = time.perf_counter()
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        times = _junit_times(xml) if xml.is_file() else {}
    tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", tail)}
    print(run.stdout[-3000:], file=sys.stderr)
    slowest = sorted(times.items(), key=lambda kv: -kv[1])[:25]
    fast_set = set(fast_ids)
    result = {"benchmark": "test_suite", "command": ["python", "-m", "pytest", "-q", *args.pytest_args],
              "returncode": run.returncode,
              "summary": tail, "counts": counts, "wall_seconds": wall,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "qwen_installed": rm.is_installed(rm.QWEN),
              "fast": {"marker": FAST, "tests": len(fast_ids), "collect_seconds": collect_seconds,
                       "seconds": collect_seconds + sum(t for n, t in times.items() if n in fast_set),
                       "matched": sum(1 for n in times if n in fast_set)},
              "slowest": [{"test": n, "seconds": t, "fast_tier": n in fast_set} for n, t in slowest]}
    harness.publish(args.out, result, info, table)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
