"""kvtrim eval: replay equals the plain path, resumption, bad input, the report (tiny random models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import cli_status

from kvtrim.decoding import Clock, Step, Wait, decode
from kvtrim.errors import KVTrimError
from kvtrim.eval.plan import make_plan
from kvtrim.eval.replay import make_policy, record_prefill, replay
from kvtrim.eval.store import read_lines
from kvtrim.generation import generate_ids
from kvtrim.integrations.batched import drive
from kvtrim.integrations.hf import attach
from kvtrim.registry import create_policy, get_policy_class, method_names

#: methods whose prefill can be recorded once and replayed, and that act on plain text
#: (``kvzip`` needs its reconstruction scores before the replay: tests/test_kvzip.py)
TEXT_METHODS = [m for m in method_names()
                if not get_policy_class(m).rewrites_forward and not get_policy_class(m).needs_spans
                and not get_policy_class(m).needs_reconstruction]


@pytest.mark.parametrize("method", TEXT_METHODS)
def test_replay_equals_plain_generation(model, prompt, method):
    """The recorded forward + replayed compression gives the tokens and cache of a plain run."""
    ids = prompt[0].tolist()
    params = {"keep": 0.3} if get_policy_class(method).takes_budget else {}
    plain = generate_ids(model, None, ids, create_policy(method, **params), max_new_tokens=12, stop_at_eos=False)
    rec = record_prefill(model, ids)
    memo: dict = {}
    cache = replay(model, make_policy(method, params, memo), rec)
    with attach(model):
        out, steps = drive(model, {0: decode(cache, rec.logits, 12)}, batch=False)[0]
    assert out == plain.token_ids and steps == plain.decode_steps
    assert cache.kv_bytes() == plain.kv_bytes
    assert max(cache.stored_tokens()) == plain.stored_tokens
    # a second budget sharing the memo still equals its own plain run
    if params:
        plain2 = generate_ids(model, None, ids, create_policy(method, keep=0.6), max_new_tokens=12, stop_at_eos=False)
        cache2 = replay(model, make_policy(method, {"keep": 0.6}, memo), rec)
        with attach(model):
            out2, _ = drive(model, {0: decode(cache2, rec.logits, 12)}, batch=False)[0]
        assert out2 == plain2.token_ids


def test_batched_decode_equals_plain_generation(model, prompt):
    """Every text method at two budgets, decoded together as rows of one batch (kvtrim.integrations.batched),
    gives each configuration the tokens and cache of its own plain batch-1 run; steps of different
    lengths (a later turn) are grouped, and a program can wait for another's result."""
    ids = prompt[0].tolist()
    configs = [(m, k) for m in TEXT_METHODS for k in ((0.3, 0.6) if get_policy_class(m).takes_budget else (None,))]
    rec = record_prefill(model, ids)
    memo: dict = {}
    turn = [5, 6, 7]

    def program(cache, key, wait=True):
        clock = Clock()
        out, _ = yield from decode(cache, rec.logits, 6, clock=clock)
        # a second turn: rows feed 3 tokens or 4 (odd rows), so two groups run in the same round
        logits = yield Step(cache, (turn + [8]) if key[2] else turn)
        out2, _ = yield from decode(cache, logits, 4)
        if wait and key[0] != "full":
            ref = yield Wait(("full", None))
            assert ref["out"] == ref_out[0]
        return {"out": out, "out2": out2, "kv": cache.kv_bytes(), "stored": max(cache.stored_tokens()), "rows": clock.mean_rows}

    caches = {}
    for m, k in configs:
        caches[(m, k, 1)] = replay(model, make_policy(m, {} if k is None else {"keep": k}, memo), rec)
        caches[(m, k, 0)] = replay(model, make_policy(m, {} if k is None else {"keep": k}, memo), rec)
    ref_out: list = []
    with attach(model):
        alone = {}
        for m, k in configs:
            res = drive(model, {(m, k): program(caches[(m, k, 0)], (m, k, False), wait=False)}, batch=False)
            alone.update(res)
            if m == "full":
                ref_out.append(res[(m, k)]["out"])
        together = drive(model, {(m, k): program(caches[(m, k, 1)], (m, k, i % 2 == 1)) for i, (m, k) in enumerate(configs)})
    for i, key in enumerate(configs):
        a, b = alone[key], together[key]
        assert b["out"] == a["out"], key
        assert a["rows"] == 1 and b["rows"] == len(configs), key  # really one batch row each
        assert b["kv"] == a["kv"] and b["stored"] == a["stored"], key
        if i % 2 == 0:  # same second-turn feed as the batch-1 run
            assert b["out2"] == a["out2"], key


def test_batched_rows_apply_their_own_logit_bias(model, prompt):
    """Elastic's size-aware merge adds a per-key logit bias; in a batch only its own row gets it."""
    ids = prompt[0].tolist()
    rec = record_prefill(model, ids)
    params = {"prop": {"keep": 0.3, "proportional": True}, "plain": {"keep": 0.3}, "prop6": {"keep": 0.6, "proportional": True}}

    def run(batch):
        caches = {n: replay(model, make_policy("elastic", p, {}), rec) for n, p in params.items()}
        assert "logit_bias" in caches["prop"].compressed_layers[0].token_state
        with attach(model):
            res = drive(model, {n: decode(c, rec.logits, 8) for n, c in caches.items()}, batch=batch)
        return {n: r[0] for n, r in res.items()}

    alone = run(False)
    assert alone["prop"] != alone["plain"]  # the bias changes this tiny model's greedy tokens, so a misrouted bias shows
    assert run(True) == alone


def test_shared_prefill_scores_are_computed_once_and_change_nothing(model, prompt, monkeypatch):
    """share_prefill_scores: the prompt's column sums are computed once per layer for every budget of
    every method that shares them (H2O, Elastic Cache), and a shared H2O cache holds exactly the
    state of an unshared one."""
    import kvtrim.policies.base as base

    rec = record_prefill(model, prompt[0].tolist())
    calls = []
    real = base.causal_column_sums
    monkeypatch.setattr(base, "causal_column_sums", lambda *a: calls.append(1) or real(*a))
    memo: dict = {}
    sharing = [m for m in method_names() if get_policy_class(m).shares_prefill_scores]
    assert "h2o" in sharing and "elastic" in sharing
    configs = [(m, k) for m in sharing for k in (0.3, 0.6)]
    shared = {c: replay(model, make_policy(c[0], {"keep": c[1]}, memo), rec) for c in configs}
    assert len(calls) == len(rec.record)  # once per layer, for every sharing method and both budgets
    assert not make_policy("snapkv", {"keep": 0.3}, memo).shares_prefill_scores
    for k in (0.3, 0.6):
        plain = replay(model, make_policy("h2o", {"keep": k}), rec)
        for a, b in zip(shared[("h2o", k)].compressed_layers, plain.compressed_layers):
            assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
            assert torch.equal(a.state_view("h2o_acc"), b.state_view("h2o_acc"))


def test_batched_rows_refuse_a_method_that_rewrites_the_forward(model):
    from kvtrim.cache import KVTrimCache
    from kvtrim.integrations.batched import MultiCache

    rewriting = [m for m in method_names() if get_policy_class(m).rewrites_forward]
    assert rewriting, "no registered method rewrites the forward pass"
    with pytest.raises(KVTrimError, match="cannot share a batch"):
        MultiCache([KVTrimCache(model, "full"), KVTrimCache(model, rewriting[0])])


def test_drive_reports_dead_wait(model, prompt):
    def waits():
        yield Wait("nobody")
        return {}

    with pytest.raises(KVTrimError, match="never come"):
        drive(model, {0: waits()})


def test_plan_validation_errors():
    ok = make_plan("passkey", "512", "snapkv", "0.1,0.5")
    assert ok.configs[0] == ("full", None) and ("snapkv", 0.5) in ok.configs
    bad = [
        (dict(tasks="nope"), "unknown task 'nope'"),
        (dict(methods="snapkv,zip"), "unknown method 'zip'"),
        (dict(methods="fastv"), "visual tokens only"),
        (dict(keeps="0"), "--keep must be a fraction in (0, 1)"),
        (dict(keeps="1.5"), "--keep must be a fraction in (0, 1)"),
        (dict(keeps="a"), "--keep takes comma-separated"),
        (dict(lengths="100"), "--length must be >= 128"),
        (dict(lengths="x"), "--length takes"),
        (dict(tasks="passkey,"), "without empty items"),
    ]
    for kw, msg in bad:
        args = dict(tasks="passkey", lengths="512", methods="snapkv", keeps="0.25") | kw
        with pytest.raises(KVTrimError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            make_plan(args["tasks"], args["lengths"], args["methods"], args["keeps"])
    with pytest.raises(KVTrimError, match="--samples"):
        make_plan("passkey", "512", "snapkv", "0.25", samples=0)
    with pytest.raises(KVTrimError, match="unknown --prefill"):
        make_plan("passkey", "512", "snapkv", "0.25", prefill="fast")


def test_a_method_with_its_own_budget_runs_once_at_it():
    """``snapkv:max_tokens=96`` is a fixed budget (kvtrim chat's bounded memory): one configuration, not one per --keep."""
    plan = make_plan("multiturn", "512", "snapkv,snapkv:max_tokens=96,h2o:keep=0.2:position=reassigned", "0.1,0.5")
    assert plan.configs == [("full", None), ("snapkv", 0.1), ("snapkv", 0.5), ("snapkv:max_tokens=96", None),
                            ("h2o:keep=0.2:position=reassigned", None)]
    with pytest.raises(KVTrimError, match="max_tokens=8 is smaller"):
        make_plan("multiturn", "512", "snapkv:max_tokens=8", "0.5")


def test_read_lines_repairs_a_cut_line(tmp_path):
    line = {"task": "passkey", "length": 512, "sample": 0, "method": "full", "keep": None, "score": 1.0,
            "kv_bytes": 10, "prefill_seconds": 0.1}
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(line) + "\n" + '{"a": 2, "b"')
    assert read_lines([p]) == [line]
    assert read_lines([p], repair=True) == [line]
    assert p.read_text() == json.dumps(line) + "\n"
    assert (tmp_path / "x.jsonl.corrupt").read_text() == 'line 2: {"a": 2, "b"\n'  # moved out, not lost


# ----------------------------------------------------------------------------- the sweep on a tiny model
@pytest.fixture(scope="module")
def tiny_lm(embedded_tokenizer):
    """A tiny random Llama with the embedded model's tokenizer (so the task generators can size prompts)."""
    from conftest import tiny_llama

    from kvtrim.models import LoadedModel

    tok = embedded_tokenizer
    model = tiny_llama(vocab_size=len(tok), max_position_embeddings=1024)
    return LoadedModel(model, tok, "tiny-test-model")


SWEEP = dict(tasks="passkey,multiturn,ppl,labelfree", lengths="256", methods="snapkv,h2o", keeps="0.5")


def _plan(**kw):
    a = SWEEP | kw
    return make_plan(a["tasks"], a["lengths"], a["methods"], a["keeps"], samples=2)


def test_sweep_resumes_without_redoing_or_losing(tiny_lm, tmp_path, monkeypatch):
    from kvtrim.eval import store
    from kvtrim.eval.store import line_key, result_files
    from kvtrim.eval.sweep import run_eval

    plan = _plan()
    out = tmp_path / "sweep"
    run_eval(tiny_lm, plan, out, progress=False, stop_after=3)  # "interrupted" after 3 sample units
    first = read_lines(result_files(out))
    assert len(first) == 3 * len(plan.configs)
    # a line cut short by a kill in the middle of a write
    victim = result_files(out)[0]
    with open(victim, "a") as f:
        f.write('{"task": "passkey", "length": 256, "sam')
    summary = run_eval(tiny_lm, plan, out, progress=False)
    lines = read_lines(result_files(out))
    keys = [line_key(d) for d in lines]
    assert len(keys) == len(set(keys)) == len(plan.units()) * len(plan.configs)
    assert lines[: len(first)] == first or all(d in lines for d in first)  # finished lines kept as they were
    assert summary["n_lines"] == len(lines)
    for d in lines:
        assert set(store.LINE_FIELDS) <= set(d), set(store.LINE_FIELDS) - set(d)
        assert d["kv_bytes"] > 0 and d["prefill_seconds"] > 0
        if d["method"] == "snapkv":
            assert d["stored_tokens"] < d["prompt_tokens"]
    by = {(d["task"], d["sample"], d["method"]): d for d in lines}
    for i in range(2):
        assert by[("labelfree", i, "full")]["score"] == 1.0  # the full cache is its own reference
        assert by[("ppl", i, "full")]["n_target"] > 0
        assert len(by[("multiturn", i, "snapkv")]["turn_scores"]) == 4
    # a finished sweep does no work at all on a rerun
    monkeypatch.setattr("kvtrim.eval.replay.record_prefill", lambda *a, **k: pytest.fail("re-ran a finished sample"))
    run_eval(tiny_lm, plan, out, progress=False)
    assert len(read_lines(result_files(out))) == len(lines)


def test_a_fixed_budget_holds_its_tokens_whatever_the_prompt_length(tiny_lm, tmp_path):
    """A fixed budget keeps the same number of tokens at every prompt length and every turn of the chat."""
    from kvtrim.eval.store import result_files
    from kvtrim.eval.sweep import run_eval

    plan = make_plan("multiturn", "256,512", "snapkv:max_tokens=96,inf_mllm:max_tokens=96", "0.5", samples=1)
    run_eval(tiny_lm, plan, tmp_path / "sweep", progress=False)
    lines = read_lines(result_files(tmp_path / "sweep"))
    fixed = [d for d in lines if d["method"] != "full"]
    assert len(fixed) == 4 and {d["length"] for d in fixed} == {256, 512}
    for d in fixed:
        assert d["keep"] is None and d["params"]["max_tokens"] == 96
        # the last turn's prompt evicted down to 96; the answer's decoded tokens came after it
        assert 96 <= d["stored_tokens"] <= 96 + d["new_tokens"] < d["prompt_tokens"]
    # the report names the rows as written and draws its plots (a fixed budget has no place on the keep axis)
    from kvtrim.eval.report import write_report

    write_report([str(tmp_path / "sweep")], str(tmp_path / "report"))
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| snapkv:max_tokens=96 |" in md and "| inf_mllm:max_tokens=96 |" in md
    assert (tmp_path / "report" / "kv_and_time.png").stat().st_size > 0


def test_resume_moves_corrupted_lines_out_and_recomputes_them(tiny_lm, tmp_path, caplog):
    from kvtrim.eval.store import line_key, result_files
    from kvtrim.eval.sweep import run_eval

    plan = _plan(tasks="passkey", methods="snapkv")
    out = tmp_path / "sweep"
    run_eval(tiny_lm, plan, out, progress=False)
    (victim,) = result_files(out)
    good = victim.read_bytes().splitlines(keepends=True)
    cut = good[1][:25]  # line 2 cut in the middle of the file, then an empty object, then the rest
    victim.write_bytes(good[0] + cut + b"\n" + b"{}\n" + b"".join(good[2:]))
    with caplog.at_level("WARNING", logger="kvtrim.eval.store"):
        run_eval(tiny_lm, plan, out, progress=False)
    assert f"{victim}:2: corrupted result line (not valid JSON" in caplog.text
    assert f"{victim}:3: corrupted result line (no task" in caplog.text
    lines = read_lines([victim])
    keys = [line_key(d) for d in lines]
    assert len(keys) == len(set(keys)) == len(plan.units()) * len(plan.configs)  # recomputed, nothing doubled
    assert b"{}" not in victim.read_bytes() and cut + b"\n" not in victim.read_bytes()
    assert Path(f"{victim}.corrupt").read_bytes() == b"line 2: " + cut + b"\nline 3: {}\n"  # kept aside, not lost


def test_sweep_refuses_bad_output_and_lengths(tiny_lm, tmp_path):
    from kvtrim.eval.store import check_out_dir
    from kvtrim.eval.sweep import run_eval

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(KVTrimError, match="cannot write to the output directory"):
        check_out_dir(blocker / "sub")
    with pytest.raises(KVTrimError, match=r"context of 1024.*cannot stream"):
        run_eval(tiny_lm, _plan(lengths="2048"), tmp_path / "long", progress=False)
    assert not (tmp_path / "long" / "config.json").exists()  # a refused plan writes nothing
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model": "another-model"}))
    with pytest.raises(KVTrimError, match="holds a sweep of model 'another-model'"):
        run_eval(tiny_lm, _plan(), tmp_path / "other", progress=False)
    with pytest.raises(KVTrimError, match="--shard"):
        run_eval(tiny_lm, _plan(), tmp_path / "s", shard=(2, 2), progress=False)


def test_eval_cli_bad_input(tmp_path, capsys):

    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = [
        (["eval", "passkey,bogus", "--out", str(tmp_path / "a")], "unknown task 'bogus'"),
        (["eval", "passkey", "--methods", "nope", "--out", str(tmp_path / "a")], "unknown method 'nope'"),
        (["eval", "passkey", "--keep", "0,0.5", "--out", str(tmp_path / "a")], "--keep must be comma-separated numbers in (0, 1)"),
        (["eval", "passkey", "--out", str(blocker / "x")], "cannot write to the output directory"),
        (["eval", "passkey", "--shard", "3/2", "--out", str(tmp_path / "a")], "--shard"),
        (["report", str(tmp_path / "missing")], "is not a directory"),
        (["bench", "--methods", "zip"], "unknown method 'zip'"),
        (["bench", "--reps", "0"], "--reps must be"),
    ]
    for argv, msg in cases:
        assert cli_status(argv) == 2, argv
        assert msg in capsys.readouterr().err, argv


# ----------------------------------------------------------------------------- the report
def _line(task, sample, method, keep, score, kv, **extra):
    d = {"task": task, "length": 256, "sample": sample, "seed": sample, "depth": 0.0, "method": method, "keep": keep,
         "prefill": "dense", "score": score, "correct": score == 1.0, "answer": "", "prompt_tokens": 256,
         "new_tokens": 3, "kv_bytes": kv, "kv_bytes_full": 1000, "kv_bytes_stored": kv, "stored_tokens": 10,
         "prefill_seconds": 1.0 + sample, "record_seconds": 1.0, "compress_seconds": 0.0, "decode_seconds": 0.3,
         "decode_steps": 3}
    d.update(extra)
    return d


def test_summarize_pairs_with_full_and_pools_perplexity():
    from kvtrim.eval.report import summarize

    lines = [_line("passkey", 0, "full", None, 1.0, 1000), _line("passkey", 1, "full", None, 0.0, 1000),
             _line("passkey", 0, "snapkv", 0.25, 1.0, 250), _line("passkey", 1, "snapkv", 0.25, 1.0, 250),
             _line("passkey", 2, "snapkv", 0.25, 0.0, 250),  # no full line for sample 2: not paired
             _line("ppl", 0, "full", None, 0, 1000, nll_sum=10.0, n_target=10),
             _line("ppl", 1, "full", None, 0, 1000, nll_sum=30.0, n_target=10),
             _line("ppl", 0, "h2o", 0.1, 0, 100, nll_sum=20.0, n_target=10),
             _line("ppl", 1, "h2o", 0.1, 0, 100, nll_sum=40.0, n_target=10)]
    cells = {(c["task"], c["method"]): c for c in summarize(lines)["cells"]}
    snap = cells[("passkey", "snapkv")]
    assert snap["n"] == 3 and snap["n_paired"] == 2
    assert snap["score"] == pytest.approx(2 / 3)
    assert snap["rel_full"] == pytest.approx(1.0 / 0.5)  # paired: 1.0 vs the full cache's 0.5
    assert snap["kv_frac"] == pytest.approx(0.25)
    assert snap["prefill_s"] == 2.0 and snap["decode_ms"] == pytest.approx(100.0)
    import math

    assert cells[("ppl", "full")]["score"] == pytest.approx(math.exp(40 / 20))
    assert cells[("ppl", "h2o")]["rel_full"] == pytest.approx(math.exp(60 / 20) / math.exp(40 / 20))


def test_report_writes_tables_plots_and_readme_block(tmp_path):
    from kvtrim.eval.report import END, START, write_report

    d = tmp_path / "res"
    (d / "runs").mkdir(parents=True)
    rows = [_line(t, i, m, k, s, kv) for t in ("passkey", "vt") for i in range(2)
            for m, k, s, kv in (("full", None, 1.0, 1000), ("snapkv", 0.25, 0.5, 250), ("snapkv", 0.5, 1.0, 500))]
    (d / "runs" / "x-256.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\n\n{START}\nold\n{END}\ntail\n")
    write_report([str(d)], readme=str(readme), image_prefix="docs/img")
    md = (d / "report.md").read_text()
    assert "| snapkv @0.25 | 0.50 | 0.50 | 0.50 | 50% |" in md  # passkey, vt, then mean score and rel. to full
    assert "| full | 1.00 | 1.00 | 1.00 | 100% |" in md
    assert "![score vs budget, 256 tokens](./score_vs_keep_256.png)" in md  # report.md links the PNGs beside it
    for png in ("score_vs_keep_256.png", "kv_and_time.png"):
        assert (d / png).stat().st_size > 1000
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{END}\ntail\n") and "docs/img/score_vs_keep_256.png" in text
    readme.write_text("no markers")
    with pytest.raises(KVTrimError, match="no <!-- kvtrim-report:start -->"):
        write_report([str(d)], readme=str(readme), plots=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(KVTrimError, match="holds no result lines"):
        write_report([str(tmp_path / "empty")])


def test_relative_to_full_only_over_tasks_the_full_cache_solves():
    """A task where the full cache scores below 0.5 (0.1 here: 0.2 would read as "200%") is left out of the
    mean score and the ratio to full, both; the note names the tasks counted."""
    from kvtrim.eval.report import eligible_tasks, row_summary, score_table, summarize

    lines = [_line(t, i, m, k, s, kv) for i in range(2) for t, m, k, s, kv in (
        ("passkey", "full", None, 1.0, 1000), ("passkey", "snapkv", 0.25, 0.5, 250),
        ("cwe", "full", None, 0.1, 1000), ("cwe", "snapkv", 0.25, 0.2, 250),
        ("vt", "full", None, 0.5, 1000), ("vt", "snapkv", 0.25, 0.25, 250))]
    cells = summarize(lines)["cells"]
    assert eligible_tasks(cells, 256) == ["passkey", "vt"]
    mean, rel = row_summary(cells, 256, "snapkv", 0.25)
    assert mean == pytest.approx((0.5 + 0.25) / 2) and rel == pytest.approx((0.5 + 0.5) / 2)
    md = score_table(cells, 256)
    assert "| snapkv @0.25 | 0.20 | 0.50 | 0.25 | 0.38 | 50% |" in md
    assert "scores at least 0.5 (passkey, vt)" in md


# ----------------------------------------------------------------------------- kvtrim bench
def test_bench_on_a_saved_tiny_model(tiny_lm, tmp_path):
    from kvtrim.eval.bench import make_bench_plan, run_bench, table

    d = tmp_path / "tiny"
    tiny_lm.model.save_pretrained(d)
    tiny_lm.tokenizer.save_pretrained(d)
    plan = make_bench_plan("full,snapkv", 0.25, "256", reps=2, new_tokens=3)
    res = run_bench(str(d), plan, rss=True, progress=False)
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"full", "snapkv"} and all(len(r["reps"]) == 2 for r in rows.values())
    assert rows["snapkv"]["kv_bytes"] < 0.5 * rows["full"]["kv_bytes"]
    assert all(r["prefill_s"] > 0 and r["decode_ms"] > 0 and r["peak_rss_bytes"] > 50e6 for r in rows.values())
    assert res["machine"]["loadavg_before"] and "torch" in res["machine"]
    md = table(res)
    assert "| 256 | snapkv @0.25 |" in md and "100%" in md


def test_bench_plan_errors():
    from kvtrim.eval.bench import make_bench_plan

    for kw, msg in [(dict(keep=0.0), "--keep"), (dict(lengths="64"), ">= 128"), (dict(new_tokens=1), "--new-tokens"),
                    (dict(prefill="x"), "unknown --prefill"), (dict(threads=0), "--threads")]:
        args = dict(methods="full", keep=0.25, lengths="256") | kw
        with pytest.raises(KVTrimError, match=msg):
            make_bench_plan(**args)


def test_early_stop_waits_for_a_boundary(tiny_lm):
    """Decoding may stop early only when more tokens cannot change the score."""
    from kvtrim.eval.programs import answer_complete

    tok = tiny_lm.tokenizer

    def done(text, answers=("14314",), metric="contains"):
        return answer_complete(tok, metric, tok(text, add_special_tokens=False)["input_ids"], list(answers), None)

    assert not done("The pass key is 14314")  # "5" could still follow
    assert done("The pass key is 14314.")
    assert not done("The pass key is 1431.")
    assert not done("a 12, b", ("12", "13"), "recall")
    assert done("a 12, b 13,", ("12", "13"), "recall")


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_text("{}"), "exists; name a new file"),
])
def test_bench_out_is_checked_before_the_run(make, message, tmp_path, capsys, monkeypatch):
    """A bad --out is refused before anything is measured (measurements are never thrown away)."""
    import kvtrim.eval.bench as bench
    from kvtrim.cli import main

    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("the run started before --out was checked"))
    out = tmp_path / "res.json"
    make(out)
    assert main(["bench", "--methods", "full", "--lengths", "256", "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
