"""Batch > 1: ``generate_batch`` and ``kvtrim generate --prompts-file`` (tiny random models; the CLI's
model-dependent checks on the embedded model, marked ``model``)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvtrim.cli import main
from kvtrim.errors import KVTrimError
from kvtrim.generation import generate_batch, generate_ids
from kvtrim.registry import create_policy, get_policy_class, method_names

#: methods the batched rows serve (the eval's batched path): not rewriting the forward, acting on text
#: (``kvzip`` asks the model in words to repeat the prompt, so it needs a tokenizer: tests/test_kvzip.py)
TEXT_METHODS = [m for m in method_names()
                if not get_policy_class(m).rewrites_forward and not get_policy_class(m).needs_spans
                and not get_policy_class(m).needs_reconstruction]


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def _policy(method, keep):
    return create_policy(method, **({"keep": keep} if get_policy_class(method).takes_budget else {}))


def _same(a, b, key):
    assert a.token_ids == b.token_ids, key
    assert a.decode_steps == b.decode_steps, key
    assert a.kv_bytes == b.kv_bytes and a.stored_tokens == b.stored_tokens, key
    assert a.prompt_tokens == b.prompt_tokens and a.compressed == b.compressed, key


def test_rows_of_different_lengths_and_methods_equal_batch_one(model):
    """Every text method (two budgets where it takes one) on prompts of different lengths, all in one
    batch: each row's tokens, steps and cache equal its own generate_ids run."""
    configs = [(m, k) for m in TEXT_METHODS for k in ((0.3, 0.6) if get_policy_class(m).takes_budget else (None,))]
    lengths = [97, 130, 71, 112, 88, 150, 101, 77, 120, 93, 140]
    prompts = _prompts([lengths[i % len(lengths)] for i in range(len(configs))])
    policies = [_policy(m, k) for m, k in configs]
    together = generate_batch(model, None, prompts, policies, max_new_tokens=10, stop_at_eos=False)
    assert len(together) == len(configs)
    for key, ids, b in zip(configs, prompts, together):
        a = generate_ids(model, None, ids, _policy(*key), max_new_tokens=10, stop_at_eos=False)
        _same(a, b, key)
        assert a.decode_rows == 1.0 and b.decode_rows > 1.0, key  # really shared the batch
        assert b.method == key[0] and b.policy == a.policy
    assert any(r.compressed for r in together)


def test_one_policy_for_all_rows_per_row_limits_and_sampling(model):
    prompts = _prompts([90, 60, 128, 75])
    limits = [6, 0, 9, 1]
    pol = create_policy("snapkv", keep=0.4)
    together = generate_batch(model, None, prompts, pol, max_new_tokens=limits, do_sample=True, temperature=0.8,
                              top_p=0.9, seed=5, stop_at_eos=False, max_rows=3)
    for ids, limit, b in zip(prompts, limits, together):
        a = generate_ids(model, None, ids, create_policy("snapkv", keep=0.4), max_new_tokens=limit, do_sample=True,
                         temperature=0.8, top_p=0.9, seed=5, stop_at_eos=False)
        _same(a, b, limit)
        assert len(b.token_ids) == limit


def test_a_method_that_rewrites_the_forward_decodes_alone_with_a_warning(model, caplog):
    """hae (hidden-state pruning; with a budget it evicts on text) cannot share a forward: its row runs
    at batch 1, said in a warning, and still equals its own generate_ids run; the other rows batch."""
    rewriting = [m for m in method_names() if get_policy_class(m).rewrites_forward and get_policy_class(m).takes_budget]
    assert rewriting
    prompts = _prompts([100, 80, 120])
    pols = [create_policy(rewriting[0], keep=0.5), create_policy("snapkv", keep=0.3), create_policy("h2o", keep=0.3)]
    with caplog.at_level(logging.WARNING, logger="kvtrim"):
        together = generate_batch(model, None, prompts, pols, max_new_tokens=8, stop_at_eos=False)
    assert any("cannot share a batch" in r.getMessage() and rewriting[0] in r.getMessage() for r in caplog.records)
    for ids, b, (m, k) in zip(prompts, together, [(rewriting[0], 0.5), ("snapkv", 0.3), ("h2o", 0.3)]):
        a = generate_ids(model, None, ids, create_policy(m, keep=k), max_new_tokens=8, stop_at_eos=False)
        _same(a, b, m)
    assert together[0].decode_rows == 1.0 and together[1].decode_rows == 2.0


def test_sparse_prefill_statistics_are_per_row(model):
    from kvtrim.integrations.prefill import SparsePrefill

    prompts = _prompts([200, 70])
    sp = SparsePrefill("a_shape", sizes={"n_init": 16, "n_local": 64}, min_length=128, backend="reference")
    together = generate_batch(model, None, prompts, create_policy("full"), max_new_tokens=4, prefill=sp, stop_at_eos=False)
    for ids, b in zip(prompts, together):
        a = generate_ids(model, None, ids, create_policy("full"), max_new_tokens=4, prefill=sp, stop_at_eos=False)
        _same(a, b, len(ids))
        assert a.prefill == {**b.prefill, "estimate_seconds": a.prefill["estimate_seconds"],
                             "attention_seconds": a.prefill["attention_seconds"]}
    assert together[0].prefill["sparse_layers"] > 0 and together[1].prefill["fallback"]


@pytest.mark.parametrize("prompts, policies, kw, message", [
    ([], "full", {}, "no prompts given"),
    ([[5] * 10, []], "full", {}, "prompt 1 (of 2): the prompt is empty"),
    ([[5] * 10, [5] * 300], "full", {}, "prompt 1 (of 2): the prompt has 300 tokens"),
    ([[5] * 10, [5, 999]], "full", {}, "prompt 1 (of 2): the prompt: token id 999"),
    ([[5] * 10, [5] * 10], ["full"], {}, "2 prompts but 1 policies"),
    ([[5] * 10], "full", {"max_new_tokens": [1, 2]}, "1 prompts but 2 limits"),
    ([[5] * 10], "full", {"max_rows": 0}, "max_rows must be"),
])
def test_bad_input_is_one_clear_error(model, prompts, policies, kw, message):
    pols = create_policy(policies) if isinstance(policies, str) else [create_policy(p) for p in policies]
    with pytest.raises(KVTrimError) as e:
        generate_batch(model, None, prompts, pols, **kw)
    assert message in str(e.value)


# -- the command line -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, content, message", [
    ("p.jsonl", "", "is empty"),
    ("p.txt", "\n  \n", "is empty"),
    ("p.jsonl", '{"question": "a"}\n\n{"question": "b",}\n', "line 3: not valid JSON"),
    ("p.jsonl", '["a"]\n', "line 1: expected a JSON object"),
    ("p.jsonl", '{"question": "a", "temperature": 2}\n', "line 1: unknown field(s) temperature"),
    ("p.jsonl", '{"question": "a", "prompt": "b"}\n', 'line 1: give exactly one of "question"'),
    ("p.jsonl", '{"question": "  "}\n', 'line 1: "question" must be a non-empty string'),
    ("p.jsonl", '{"question": "a", "max_new_tokens": -1}\n', 'line 1: "max_new_tokens" must be an integer >= 0'),
    ("p.jsonl", '{"question": "a"}\n{"question": "b", "method": "nope"}\n', "line 2: unknown method 'nope'"),
    ("p.jsonl", '{"question": "a", "keep": 1.5}\n', "line 1: snapkv: keep must be a fraction"),
    ("p.jsonl", '{"question": "a", "keep": "half"}\n', 'line 1: "keep" must be a number'),
    ("p.jsonl", '{"question": "a", "method": "fastv"}\n', "line 1: method 'fastv' prunes"),
])
def test_prompts_file_errors_before_the_model_loads(tmp_path, capsys, name, content, message):
    f = tmp_path / name
    f.write_text(content, encoding="utf-8")
    assert main(["generate", "--prompts-file", str(f), "--method", "snapkv", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error:") and message in err and err.count("\n") == 1, err


def test_prompts_file_excludes_question_and_image(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("a\n")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompts-file", str(f), "--question", "q"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert main(["generate", "--prompts-file", str(f), "--image", "x.png"]) == 2
    assert "--prompts-file takes text prompts" in capsys.readouterr().err


@pytest.mark.model
def test_prompts_file_jsonl_and_lines_match_single_generate(tmp_path, capsys, real):
    """Each output line (in order, UTF-8) equals the answer ``kvtrim generate`` gives that prompt alone."""
    rows = [{"question": "Name a colour.", "id": "a"},
            {"prompt": "Die Hauptstadt von Frankreich ist", "method": "full", "max_new_tokens": 5},
            {"question": "Où est la tour Eiffel ? Réponds en une phrase.", "keep": 0.5, "id": 7}]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n", encoding="utf-8")
    assert main(["generate", "--prompts-file", str(f), "--method", "snapkv", "--max-tokens", "64",
                 "--max-new-tokens", "8", "--no-progress"]) == 0
    cap = capsys.readouterr()
    out = [json.loads(line) for line in cap.out.splitlines()]
    assert [d["line"] for d in out] == [1, 2, 3] and out[0]["id"] == "a" and out[2]["id"] == 7 and "id" not in out[1]
    assert "[batch] 3 prompts" in cap.err
    singles = [["--question", rows[0]["question"], "--method", "snapkv", "--max-tokens", "64", "--max-new-tokens", "8"],
               ["--prompt", rows[1]["prompt"], "--max-new-tokens", "5"],
               ["--question", rows[2]["question"], "--method", "snapkv", "--keep", "0.5", "--max-new-tokens", "8"]]
    for argv, d in zip(singles, out):
        assert main(["generate", *argv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["answer"] == d["answer"]
    # the plain format: one question per line; --json carries every field
    t = tmp_path / "p.txt"
    t.write_text(rows[0]["question"] + "\n" + rows[2]["question"] + "\n", encoding="utf-8")
    assert main(["generate", "--prompts-file", str(t), "--max-new-tokens", "4", "--json", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    d = json.loads(lines[1])
    assert d["line"] == 2 and d["method"] == "full" and d["decode_rows"] >= 1 and "kv_bytes" in d
    # a row that decodes no step prints strict JSON (null speed, not NaN)
    z = tmp_path / "z.jsonl"
    z.write_text(json.dumps({"question": "hi", "max_new_tokens": 0}) + "\n")
    assert main(["generate", "--prompts-file", str(z), "--json", "--no-progress"]) == 0

    def strict(name):
        raise AssertionError(f"not JSON: {name}")

    d = json.loads(capsys.readouterr().out, parse_constant=strict)
    assert d["new_tokens"] == 0 and d["decode_tokens_per_s"] is None


@pytest.mark.model
def test_prompts_file_prompt_over_context_names_its_line(tmp_path, capsys, real):
    f = tmp_path / "p.jsonl"
    long = "word " * 9000
    f.write_text(json.dumps({"question": "hi"}) + "\n" + json.dumps({"prompt": long}) + "\n")
    assert main(["generate", "--prompts-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error:") and "line 2:" in err and "more than the model's context" in err
