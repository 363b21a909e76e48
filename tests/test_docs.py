"""The README's claims that code can check: its Python snippet runs, its method table matches the registry;
and the generated blocks of the README and docs/results.md are what the committed results produce."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from kvtrim.registry import method_names

README = Path(__file__).resolve().parents[1] / "README.md"
RESULTS = README.parent / "docs" / "results.md"


def test_readme_method_table_matches_registry():
    text = README.read_text()
    section = text.split("## Methods", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M)
    assert names == method_names()


def test_methods_page_table_matches_registry():
    """docs/methods.md's table at a glance (the detailed one the README's short table points to)."""
    section = (README.parent / "docs" / "methods.md").read_text().split("## At a glance", 1)[1].split("\n## ", 1)[0]
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
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # the documented path warns on no supported transformers
            warnings.simplefilter("error", DeprecationWarning)
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


def test_results_block_is_generated_by_kvtrim_report():
    """docs/results.md's sweep results are `kvtrim report`'s output for the committed result lines (its PNG
    links relative to docs/)."""
    from kvtrim.eval.report import END, START, load_dirs, render, summarize

    results = README.parent / "benchmarks" / "results" / "eval_baseline"
    block = RESULTS.read_text().split(START, 1)[1].split(END, 1)[0]
    expected = render(summarize(load_dirs([str(results)])), "eval")
    assert block.strip() == expected.strip(), "regenerate: .venv/bin/python -m kvtrim.tools.docs_tables --write"



def test_cache_kwargs_generate_and_forward_without_deprecation_warning(model, prompt):
    """The documented form (`**cache.kwargs()`) warns neither in `generate` nor in a hand-written forward."""
    import kvtrim

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        with kvtrim.compress(model, "snapkv", keep=0.5) as cache:
            out = model.generate(prompt, **cache.kwargs(), max_new_tokens=3, do_sample=False, min_new_tokens=3)
        with kvtrim.compress(model, "h2o", keep=0.5) as cache:
            model(input_ids=prompt, **cache.kwargs(), use_cache=True)
    assert out.shape[1] == prompt.shape[1] + 3
    assert cache.get_seq_length() == prompt.shape[1]


def test_every_generated_block_matches_the_committed_results():
    """Each `<!-- generated: CMD -->` block of README.md and docs/*.md is CMD's output on the committed result
    files (benchmark `--table`s, the method guide, the eval summary, the vLLM comparison, the README's
    headline), and docs/results.md's eval block is `kvtrim report`'s."""
    from kvtrim.tools.docs_tables import BLOCK, doc_files, stale

    root = README.parent
    blocks = [m.group("cmd") for p in doc_files(root) for m in BLOCK.finditer(p.read_text())]
    assert len(blocks) >= 14 and {"kvtrim.tools.docs_tables guide", "kvtrim.tools.docs_tables vllm",
                                 "kvtrim.tools.docs_tables headline"} <= set(blocks)
    assert stale(root) == [], "regenerate: .venv/bin/python -m kvtrim.tools.docs_tables --write"


def test_docs_report_md_is_generated():
    """docs/eval/report.md is `kvtrim report`'s output for the committed lines (its PNG links point beside it)."""
    from kvtrim.eval.report import load_dirs, render, summarize

    results = README.parent / "benchmarks" / "results" / "eval_baseline"
    text = (README.parent / "docs" / "eval" / "report.md").read_text()
    assert text.split(".\n\n", 1)[1] == render(summarize(load_dirs([str(results)])), ".")


def test_memory_is_shown_in_mib_everywhere():
    """One unit for memory in the docs: MiB (no MB, no 10^6-byte megabytes)."""
    for p in [README, *sorted((README.parent / "docs").glob("*.md")), README.parent / "docs" / "eval" / "report.md"]:
        bad = [ln for ln in p.read_text().splitlines() if re.search(r"\d\s*MB\b|\bKV MB\b|10\^6 bytes", ln)]
        assert not bad, f"{p.name}: {bad[:3]}"
