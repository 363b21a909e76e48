"""What the property-based fuzz tests (``tests/test_fuzz_*.py``) share: how many examples a run
takes, the hard per-example time limit, the file-tree snapshot that proves nothing outside an
output changed, the check of kvtrim's error contract, and the outcome counts.

Examples per run come from a profile chosen by ``KVTRIM_FUZZ_PROFILE``: ``ci`` (the default: a
few hundred over all fuzz tests, what every test run and CI take) or ``fuzz`` (10,000 over all of
them; docs: CONTRIBUTING.md, "Fuzzing"). Each test takes a fixed share of the profile's total.
``KVTRIM_FUZZ_REPORT=FILE`` writes the outcome counts of the run (per test: examples, successes,
one-line refusals) as JSON when the tests end.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import signal
import stat
from collections import Counter, defaultdict
from pathlib import Path

from hypothesis import HealthCheck, settings

PROFILES = {"ci": 300, "fuzz": 10_000}  # examples over all fuzz tests
PROFILE = os.environ.get("KVTRIM_FUZZ_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise ValueError(f"KVTRIM_FUZZ_PROFILE={PROFILE!r}: use one of {', '.join(PROFILES)}")
#: the longest one example may take before it counts as a hang (the machine may be loaded)
EXAMPLE_SECONDS = 60.0

COUNTS: dict[str, Counter] = defaultdict(Counter)


def fuzz_settings(share: float):
    """Hypothesis settings for a fuzz test taking ``share`` of the profile's examples. Hypothesis'
    own deadline is off (a loaded machine makes timings flaky); :func:`no_hang` bounds each example."""
    return settings(max_examples=max(1, round(PROFILES[PROFILE] * share)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


class Hang(Exception):
    """An example ran past EXAMPLE_SECONDS (a blocked open, an endless loop)."""


@contextlib.contextmanager
def no_hang(seconds: float = EXAMPLE_SECONDS):
    """Raise :class:`Hang` in the main thread after ``seconds`` (SIGALRM interrupts a blocked system
    call too: the handler raises, so Python does not retry it)."""

    def fire(signum, frame):
        raise Hang(f"the example ran past {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed, FIFOs not opened): kind, size and a digest
    of a regular file's bytes, a link's target."""
    out: dict[str, tuple] = {}
    for base, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = os.path.join(base, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[p] = ("file", st.st_size, hashlib.sha256(f.read()).hexdigest())
            elif stat.S_ISLNK(st.st_mode):
                out[p] = ("link", os.readlink(p))
            else:
                out[p] = (stat.S_IFMT(st.st_mode),)
    return out


def changed_outside(before: dict, after: dict, allowed: list[str]) -> list[str]:
    """Paths added, removed or changed between two snapshots, except under the ``allowed`` paths."""
    roots = [os.path.normpath(a) for a in allowed]

    def inside(p: str) -> bool:
        return any(p == r or p.startswith(r + os.sep) for r in roots)

    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p) and not inside(p))


def check_cli_outcome(rc: int, err: str) -> str:
    """kvtrim's promise for one command: exit 0, or exit 2 with exactly one ``kvtrim: error:`` line;
    never a traceback. Returns the outcome (``"ok"`` or ``"refused"``)."""
    assert "Traceback (most recent call last)" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("kvtrim: error:")]
    if rc == 0:
        assert not errors, err
        return "ok"
    assert rc == 2, f"exit status {rc}: {err}"
    assert len(errors) == 1, err
    return "refused"


def count(test: str, outcome: str) -> None:
    COUNTS[test][outcome] += 1
    COUNTS[test]["examples"] += 1


@atexit.register
def _write_report() -> None:
    path = os.environ.get("KVTRIM_FUZZ_REPORT")
    if path and COUNTS:
        Path(path).write_text(json.dumps({"profile": PROFILE, "tests": {k: dict(v) for k, v in COUNTS.items()}},
                                         indent=1) + "\n")
