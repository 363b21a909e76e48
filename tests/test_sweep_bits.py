"""kvtrim eval --kv-bits: the replay of a low-bit cache equals the plain path, lines record the bit
width, 16-bit lines keep the keys they had before bit widths (tiny random models)."""

from __future__ import annotations

import json

import pytest
from conftest import cli_status

from kvtrim.decoding import decode
from kvtrim.errors import KVTrimError
from kvtrim.eval.plan import make_plan
from kvtrim.eval.replay import make_policy, record_prefill, replay
from kvtrim.eval.store import line_key, line_problem, read_lines, result_files
from kvtrim.generation import generate_ids
from kvtrim.integrations.batched import drive
from kvtrim.integrations.hf import attach
from kvtrim.registry import create_policy


@pytest.mark.parametrize("method,params", [("snapkv", {"keep": 0.4}), ("h2o", {"keep": 0.4}), ("full", {})])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_lowbit_replay_equals_plain_generation(model, prompt, method, params, bits):
    """A replayed low-bit cache decodes the tokens of a plain low-bit run and holds the same bytes."""
    ids = prompt[0].tolist()
    plain = generate_ids(model, None, ids, create_policy(method, **params), max_new_tokens=10, stop_at_eos=False,
                         kv_bits=bits)
    rec = record_prefill(model, ids)
    cache = replay(model, make_policy(method, params, {}), rec, kv_bits=bits)
    assert cache.kv_bits == bits
    with attach(model):
        out, steps = drive(model, {0: decode(cache, rec.logits, 10)}, batch=False)[0]
    assert out == plain.token_ids and steps == plain.decode_steps
    assert cache.kv_bytes() == plain.kv_bytes
    # and the low-bit storage was used: fewer bytes than the same configuration at 16 bits
    cache16 = replay(model, make_policy(method, params, {}), rec)
    assert cache.kv_bytes() < cache16.kv_bytes()


def test_bit_list_validation():
    assert make_plan("passkey", "256", "snapkv", "0.5").kv_bits == [16]
    assert make_plan("passkey", "256", "snapkv", "0.5", kv_bits="4,8").kv_bits == [16, 4, 8]
    assert make_plan("passkey", "256", "snapkv", "0.5", kv_bits=4).kv_bits == [16, 4]
    plan = make_plan("passkey", "256", "snapkv", "0.5", kv_bits="16,4")
    assert plan.bit_configs() == [("full", None, 16), ("snapkv", 0.5, 16), ("full", None, 4), ("snapkv", 0.5, 4)]
    for bad in ("3", "16,", "four", "-4", "", True):
        with pytest.raises(KVTrimError, match="--kv-bits"):
            make_plan("passkey", "256", "snapkv", "0.5", kv_bits=bad)


def test_line_key_of_a_16_bit_line_is_unchanged():
    """The key of a line written before bit widths, of the same line with kv_bits 16, and today's tuple agree."""
    old = {"task": "passkey", "length": 256, "sample": 1, "seed": 7, "haystack": "prose", "samples": 2, "weights": "w",
           "method": "snapkv", "keep": 0.5, "prefill": "dense", "params": {"keep": 0.5, "window": 8}}
    expected = ("passkey", 256, 1, 7, "prose", 2, "w", "snapkv", 0.5, "dense", json.dumps(old["params"], sort_keys=True))
    assert line_key(old) == expected
    assert line_key(old | {"kv_bits": 16}) == expected
    assert line_key(old | {"kv_bits": 4}) == (*expected, 4)
    assert line_key(old | {"kv_bits": 4}) != line_key(old | {"kv_bits": 8})


def test_a_line_with_a_bad_bit_width_is_corrupted():
    base = {"task": "passkey", "length": 256, "sample": 0, "method": "snapkv", "score": 1.0, "kv_bytes": 10,
            "prefill_seconds": 0.1}
    assert line_problem(json.dumps(base | {"kv_bits": 4}).encode())[1] is None
    assert "kv_bits" in line_problem(json.dumps(base | {"kv_bits": 3}).encode())[1]
    assert "kv_bits" in line_problem(json.dumps(base | {"kv_bits": "4"}).encode())[1]


@pytest.fixture(scope="module")
def tiny_lm(embedded_tokenizer):
    from conftest import tiny_llama

    from kvtrim.models import LoadedModel

    tok = embedded_tokenizer
    return LoadedModel(tiny_llama(vocab_size=len(tok), max_position_embeddings=1024), tok, "tiny-test-model")


def test_sweep_at_three_bit_widths(tiny_lm, tmp_path, monkeypatch):
    """16-bit lines equal a 16-bit-only sweep's (same keys, same answers, so a committed sweep resumes
    with nothing recomputed); low-bit lines record kv_bits and their real resident bytes; the report
    shows them as cells of their own."""
    from kvtrim.eval.report import summarize
    from kvtrim.eval.sweep import run_eval

    args = ("passkey,labelfree", "256", "snapkv", "0.5")
    only16 = tmp_path / "a"
    run_eval(tiny_lm, make_plan(*args, samples=2), only16, progress=False)
    lines16 = read_lines(result_files(only16))
    plan = make_plan(*args, samples=2, kv_bits="16,8,4")
    both = tmp_path / "b"
    run_eval(tiny_lm, plan, both, progress=False)
    lines = read_lines(result_files(both))
    keys = [line_key(d) for d in lines]
    assert len(keys) == len(set(keys)) == len(plan.units()) * len(plan.bit_configs())
    assert {d["kv_bits"] for d in lines} == {16, 8, 4}
    by = {line_key(d): d for d in lines}
    for d in lines16:
        twin = by[line_key(d)]
        assert twin["kv_bits"] == 16 and twin["answer"] == d["answer"] and twin["kv_bytes"] == d["kv_bytes"]
    per = {(d["task"], d["sample"], d["method"], d["kv_bits"]): d for d in lines}
    for (task, i, m, b), d in per.items():
        if b != 16:
            d16 = per[(task, i, m, 16)]
            assert d["kv_bytes"] < d16["kv_bytes"]  # the low-bit storage's bytes, scales included
            assert d["kv_bytes_full"] == d16["kv_bytes_full"]  # the reference: the 16-bit full cache
            assert d["stored_tokens"] == d16["stored_tokens"]
    # resuming the 16-bit-only directory with bit widths adds only the low-bit lines
    import kvtrim.eval.sweep as sweep

    monkeypatch.setattr(sweep, "config_program", _only_lowbit(sweep.config_program))
    run_eval(tiny_lm, plan, only16, progress=False)
    assert len(read_lines(result_files(only16))) == len(lines)
    cells = summarize(lines)["cells"]
    names = {(c["task"], c["method"]) for c in cells}
    assert ("passkey", "snapkv@4bit") in names and ("passkey", "full@8bit") in names and ("passkey", "snapkv") in names
    c4 = next(c for c in cells if c["method"] == "snapkv@4bit" and c["task"] == "passkey")
    assert c4["kv_bits"] == 4 and c4["base_method"] == "snapkv" and c4["kv_frac"] < 0.5


def _only_lowbit(real):
    def program(*a, kv_bits=16, **kw):
        if kv_bits == 16:
            pytest.fail("recomputed a 16-bit line that was already there")
        return real(*a, kv_bits=kv_bits, **kw)
    return program


def test_eval_cli_refuses_bad_bits(tmp_path, capsys):
    code = cli_status(["eval", "passkey", "--kv-bits", "16,5", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kvtrim: error:") and err.count("\n") == 1 and "--kv-bits" in err


def test_labelfree_full_cache_at_fewer_bits_is_scored_against_the_16_bit_answer(tiny_lm):
    """On labelfree the full cache's 16-bit answer is every configuration's reference, the full cache's
    own low-bit runs included (it is not its own reference: its agreement would be 1 by construction)."""
    from kvtrim.eval.longtext import labelfree
    from kvtrim.eval.metrics import rouge_l
    from kvtrim.eval.programs import config_program

    tok = tiny_lm.tokenizer
    sample = labelfree(tok, 256)
    ids = prompt_ids_of(tok, sample)
    rec = record_prefill(tiny_lm.model, ids)
    reference = list(tok("a reference answer the random model does not write", add_special_tokens=False)["input_ids"])
    with attach(tiny_lm.model):
        res = drive(tiny_lm.model, {b: config_program(tiny_lm.model, tok, sample, rec, "full", None, {}, reference=reference,
                                                      kv_bits=b) for b in (16, 4)}, batch=False)
    ref_text = tok.decode(reference, skip_special_tokens=True).strip()
    assert res[16]["score"] == 1.0  # the 16-bit full cache is the reference itself
    assert res[4]["score"] == rouge_l(res[4]["answer"], ref_text) < 1.0


def prompt_ids_of(tok, sample):
    from kvtrim.models import build_prompt_ids

    return build_prompt_ids(tok, sample.prompt)
