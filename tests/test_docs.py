"""The README's claims that code can check: its Python snippet runs, its method table matches the registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtrim.registry import method_names

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_method_table_matches_registry():
    text = README.read_text()
    section = text.split("## Methods", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M)
    assert names == method_names()


def test_readme_has_exactly_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    cmds = [line for b in blocks for line in b.splitlines() if line.strip() and not line.startswith("#")]
    assert cmds == [
        "bash scripts/setup.sh && .venv/bin/kvtrim demo",
        "bash scripts/setup.sh && .venv/bin/python -m pytest -q",
    ]


@pytest.mark.model
def test_readme_python_snippet_runs(real, capsys):
    """The snippet runs, and prints the answer the same snippet gives with the full cache (its short
    prompt is kept whole, as the comment in the snippet says: nothing to save, nothing lost)."""
    block = README.read_text().split("## Python: one line", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, flags=re.S).group(1)
    call = 'kvtrim.compress(lm.model, "snapkv", keep=0.2)'
    assert call in code
    answers = {}
    for name, source in (("snapkv", code), ("full", code.replace(call, 'kvtrim.compress(lm.model, "full")'))):
        env: dict = {}
        exec(compile(source, "README.md", "exec"), env)
        out = capsys.readouterr().out.strip().splitlines()
        assert out and out[0].strip()
        answers[name] = (env["out"][0].tolist(), out[0])
        cache, n_prompt = env["cache"], env["ids"].shape[1]
        assert cache.kv_bytes_stored() == cache.kv_bytes_full()
    assert answers["snapkv"] == answers["full"]
    assert env["cache"].policy.name == "full"
    snap = __import__("kvtrim").create_policy("snapkv", keep=0.2)
    assert snap.kept_whole(n_prompt), f"the README's prompt has {n_prompt} tokens; the snippet's comment says it is kept whole"


@pytest.mark.model
def test_demo_runs(capsys, real):
    from kvtrim.cli import main

    assert main(["demo", "--length", "1200", "--methods", "full,snapkv"]) == 0
    out = capsys.readouterr().out
    assert "full" in out and "snapkv" in out and "pass key:" in out


def test_readme_results_block_is_generated_by_kvtrim_report():
    """The README's sweep results are `kvtrim report`'s output for the committed result lines."""
    from kvtrim.eval.report import END, START, load_dirs, render, summarize

    results = README.parent / "benchmarks" / "results" / "eval_baseline"
    block = README.read_text().split(START, 1)[1].split(END, 1)[0]
    expected = render(summarize(load_dirs([str(results)])), "docs/eval")
    assert block.strip() == expected.strip(), "regenerate: kvtrim report benchmarks/results/eval_baseline --out docs/eval --readme README.md --image-prefix docs/eval"
