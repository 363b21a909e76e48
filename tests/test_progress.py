"""Progress on the long steps: the set-up script's step list, the GGUF conversion's bar with the size
it takes on disk, and the batch bar of ``--prompts-file`` ending at 100% when rows stop early."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kvtrim.registry import create_policy

ROOT = Path(__file__).resolve().parents[1]


def test_setup_script_says_each_step_as_it_starts():
    """Read, not run (it installs torch): every step is announced as `kvtrim setup [i/n] ...`, numbered
    1..n in order, before each command that installs or builds something."""
    lines = (ROOT / "scripts" / "setup.sh").read_text().splitlines()
    total = int(next(m.group(1) for ln in lines if (m := re.fullmatch(r"STEPS=(\d+)", ln.strip()))))
    assert 'step() { echo "kvtrim setup [$1/$STEPS] $2"; }' in lines
    calls = [(i, int(m.group(1))) for i, ln in enumerate(lines) if (m := re.match(r'\s*step (\d+) "', ln))]
    numbers = sorted({n for _, n in calls})
    assert numbers == list(range(1, total + 1)) and [n for _, n in calls] == sorted(n for _, n in calls)
    work = [i for i, ln in enumerate(lines) if re.match(r"\s*(\$PIP |\.venv/bin/python |\[ -x \.venv|\"\$PY\" -m venv)", ln)
            or "-m venv" in ln]
    assert work, "no commands found in scripts/setup.sh"
    first_step = calls[0][0]
    assert all(i > first_step for i in work), "a command runs before the first step is announced"
    # every install or build runs under a step announced since the previous one
    for i in work:
        assert any(j < i for j, _ in calls)
    assert lines[-1].startswith('echo "kvtrim setup: done')


def test_gguf_conversion_shows_steps_and_the_size_on_disk(tmp_path, capsys):
    from test_model_loading import write_tiny_gguf

    from kvtrim import gguf

    g = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = gguf.convert_gguf(g, tmp_path / "out")
    err = capsys.readouterr().err
    size = gguf.converted_bytes(g)
    assert f"kvtrim: converting tiny.gguf once (about {size / 2**20:.1f} MiB on disk): 4/4" in err, err
    assert "done" in err
    weights = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert size <= weights <= size + 64 * 1024  # float32 tensors plus the safetensors header
    gguf.convert_gguf(g, tmp_path / "quiet", progress=False)
    assert "kvtrim: converting" not in capsys.readouterr().err


class _Tokenizer:
    """Just enough of a tokenizer: an end-of-sequence id and decode."""

    def __init__(self, eos: int):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_batch_progress_reaches_100_percent_when_rows_stop_early(model, capsys):
    from kvtrim.generation import generate_batch, generate_ids

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (40, 57)]
    first = generate_ids(model, None, prompts[0], create_policy("full"), max_new_tokens=1).token_ids[0]
    results = generate_batch(model, _Tokenizer(first), prompts, create_policy("full"), max_new_tokens=8, progress=True)
    assert results[0].new_tokens == 1  # its first token is the end of sequence: it stopped early
    assert sum(r.new_tokens for r in results) < 16
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "100%" in last and f"{sum(r.new_tokens for r in results)}/{sum(r.new_tokens for r in results)}" in last, last
