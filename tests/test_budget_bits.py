"""One budget for both axes: ``--quality`` picks the (keep, bits) pair with the least resident memory
among calibrated pairs that meet the target (``kvtrim.budget``, calibration format 2)."""

from __future__ import annotations

import copy
import json

import pytest

from kvtrim.budget import FORMAT, Calibration, keep_for_quality, lowbit_share
from kvtrim.cli import main
from kvtrim.errors import KVTrimError
from kvtrim.eval.calibrate import agreement_points, build_calibration


def pt(length, keep, agreement, bits=16, kv=None, n=6):
    return {"length": length, "keep": keep, "agreement": agreement, "n": n, "bits": bits, "kv_frac": kv}


def cal_of(points, fmt=2, fingerprint=None):
    return Calibration.from_dict({"format": fmt, "model": {"key": "synthetic", "source": "Synthetic-1",
                                                           "fingerprint": fingerprint or {"model_type": "llama"}},
                                  "methods": {"snapkv": copy.deepcopy(points)}})


# a float32 model's shares: 8 bits about 0.28 of the 16-bit configuration's bytes, 4 bits about 0.16
MIXED = [
    pt(1024, 0.25, 0.90, 16, 0.26), pt(1024, 0.5, 0.95, 16, 0.51),
    pt(1024, 0.25, 0.85, 8, 0.075), pt(1024, 0.5, 0.93, 8, 0.142),
    pt(1024, 0.25, 0.70, 4, 0.044), pt(1024, 0.5, 0.96, 4, 0.082),  # 4 bits at 0.5: a lucky 0.96, credited 0.96
]


@pytest.mark.parametrize("quality, keep, bits", [
    (0.95, 0.5, 4),   # 0.5 at 4 bits (0.082) beats 0.5 at 16 (0.51), the smallest 16-bit keep reaching 0.95
    (0.93, 0.5, 4),
    (0.90, 0.5, 4),   # 0.25 at 16 bits reaches it too, at 0.26: more memory
    (0.85, 0.25, 8),  # 0.25 at 8 bits (0.075) is less than 0.5 at 4 bits (0.082)
    (0.70, 0.25, 4),
])
def test_least_memory_pair_meeting_the_target(quality, keep, bits):
    c = cal_of(MIXED).choose("snapkv", quality, 1024)
    assert (c.keep, c.kv_bits) == (keep, bits)
    assert c.expected is not None and c.expected >= quality
    assert c.memory_source == "measured" and c.bit_widths == (16, 8, 4)
    mem = {(p["keep"], p["bits"]): p["kv_frac"] for p in MIXED}
    assert c.memory == mem[(keep, bits)]
    # no other pair meeting Q holds less
    meeting = [(p["keep"], p["bits"]) for p in MIXED if _credited(MIXED, p) >= quality]
    assert min(mem[m] for m in meeting) == c.memory
    assert f"{bits}-bit KV" in c.reason and "measured" in c.reason
    assert ("the smallest 16-bit keep reaching it is" in c.reason) == (quality <= 0.95)


def _credited(points, p):
    """The monotone credit of a point: the lowest agreement at its keep or larger, same length and bits."""
    return min(q["agreement"] for q in points if q["bits"] == p["bits"] and q["length"] == p["length"]
               and q["keep"] >= p["keep"])


def test_credit_is_monotone_per_bit_width():
    """A dip above a budget lowers its credit at its own bit width only."""
    pts = [pt(1024, 0.25, 0.95, 8, 0.07), pt(1024, 0.5, 0.80, 8, 0.14), pt(1024, 0.25, 0.95, 16, 0.25),
           pt(1024, 0.5, 0.96, 16, 0.5)]
    c = cal_of(pts).choose("snapkv", 0.9, 1024)
    assert (c.keep, c.kv_bits) == (0.25, 16)  # 8 bits at 0.25 measured 0.95 but 0.5 measured 0.80: credited 0.80


def test_ties_go_to_more_bits():
    pts = [pt(1024, 0.25, 0.95, 16, 0.25), pt(1024, 0.5, 0.95, 8, 0.25), pt(1024, 0.1, 0.5, 16, 0.1)]
    c = cal_of(pts).choose("snapkv", 0.9, 1024)
    assert (c.keep, c.kv_bits) == (0.25, 16)
    # and among equal memory and bits... only one pair per (keep, bits): the credit breaks nothing here
    pts2 = [pt(1024, 0.5, 0.95, 8, 0.25), pt(1024, 0.25, 0.95, 16, 0.25)]
    assert cal_of(pts2).choose("snapkv", 0.9, 1024).kv_bits == 16


def test_formula_when_a_share_is_missing():
    """Without a measured share for every candidate the formula ranks them all (keep x lowbit_share)."""
    pts = [pt(1024, 0.25, 0.95, 16, None), pt(1024, 0.5, 0.95, 4, 0.2), pt(1024, 0.5, 0.95, 8, 0.4)]
    c = cal_of(pts, fingerprint={"hidden_size": 576, "num_attention_heads": 9}).choose("snapkv", 0.9, 1024)
    assert c.memory_source == "formula" and "formula" in c.reason
    # head_dim 64, per token and KV head: 4-bit codes 64 bytes, group id and value scales 8, key scales
    # 4 * 64 / 32 = 8; a 16-bit token 256 bytes
    assert lowbit_share(4, 64) == pytest.approx(80 / 256) and lowbit_share(16, 64) == 1.0
    assert lowbit_share(8, 64) == pytest.approx(144 / 256)
    assert (c.keep, c.kv_bits) == (0.5, 4) and c.memory == pytest.approx(0.5 * 80 / 256)
    # a larger head dimension spreads the group id and value scales over more elements
    assert lowbit_share(4, 128) < lowbit_share(4, 64) < lowbit_share(8, 64) < 1.0


def test_fallback_is_the_full_cache_at_16_bits():
    c = cal_of(MIXED).choose("snapkv", 0.99, 1024)
    assert c.full and c.keep == 1.0 and c.kv_bits == 16 and c.expected is None
    assert "full cache" in c.reason and "(keep, bits)" in c.reason


def test_a_pair_must_meet_the_target_at_every_length_used():
    """Between two calibrated lengths a pair is picked only where it meets Q at both."""
    pts = [pt(1024, 0.25, 0.95, 4, 0.05), pt(1024, 0.5, 0.96, 4, 0.1), pt(1024, 0.5, 0.97, 16, 0.5),
           pt(4096, 0.25, 0.60, 4, 0.05), pt(4096, 0.5, 0.95, 4, 0.1), pt(4096, 0.5, 0.97, 16, 0.5)]
    cal = cal_of(pts)
    assert (cal.choose("snapkv", 0.9, 1024).keep, cal.choose("snapkv", 0.9, 1024).kv_bits) == (0.25, 4)
    both = cal.choose("snapkv", 0.9, 2048)  # between: 0.25 at 4 bits misses at 4096
    assert (both.keep, both.kv_bits) == (0.5, 4) and both.lengths == (1024, 4096)
    assert both.memory == pytest.approx(0.1)  # measured at both lengths, averaged
    assert cal.choose("snapkv", 0.9, None).keep == 0.5  # length unknown: every length


SIXTEEN = [pt(1024, 0.1, 0.50), pt(1024, 0.2, 0.96), pt(1024, 0.3, 0.90), pt(1024, 0.5, 1.0),
           pt(2048, 0.1, 0.95), pt(2048, 0.2, 0.97), pt(2048, 0.5, 0.99)]


@pytest.mark.parametrize("quality", [0.5, 0.9, 0.95, 0.96, 0.98, 0.995, 1.0])
@pytest.mark.parametrize("n", [None, 700, 1024, 1500, 1800, 2048, 4096])
def test_only_16_bit_points_pick_as_before(quality, n):
    """A format-1 file (no bits) and a format-2 file of 16-bit points give the same choice, as before."""
    old = [{k: v for k, v in p.items() if k not in ("bits", "kv_frac")} for p in SIXTEEN]
    c1 = cal_of(old, fmt=1).choose("snapkv", quality, n)
    c2 = cal_of(SIXTEEN).choose("snapkv", quality, n)
    assert c1 == c2 and c1.kv_bits == 16 and c1.memory is None and c1.bit_widths == (16,)


def test_at_bits_keeps_one_bit_width_and_drops_methods_left_without_points():
    d = {"format": 2, "model": {"key": "synthetic", "source": "Synthetic-1", "fingerprint": {"model_type": "llama"}},
         "methods": {"snapkv": copy.deepcopy(MIXED), "full": [pt(1024, 1.0, 0.99, 8, 0.28)]}}
    cal = Calibration.from_dict(d)
    only16 = cal.at_bits(16)
    assert set(only16.methods) == {"snapkv"} and {p.bits for p in only16.methods["snapkv"]} == {16}
    assert len(only16.methods["snapkv"]) == 2 and len(cal.methods["snapkv"]) == 6  # the original is untouched
    assert {p.keep for p in cal.at_bits(8).methods["full"]} == {1.0}
    assert only16.choose("snapkv", 0.95).kv_bits == 16  # picks as a calibration made without --kv-bits
    with pytest.raises(KVTrimError, match="no point at 2 bits"):
        cal.at_bits(2)


def test_old_files_are_read_as_16_bit_and_written_as_format_2(tmp_path):
    old = {"format": 1, "model": {"key": "m", "source": "S", "fingerprint": {}},
           "methods": {"snapkv": [{"length": 1024, "keep": 0.5, "agreement": 0.9, "n": 3}]}}
    f = tmp_path / "old.json"
    f.write_text(json.dumps(old))
    cal = Calibration.load(f)
    assert [p.bits for p in cal.methods["snapkv"]] == [16]
    cal.save(tmp_path / "new.json")
    d = json.loads((tmp_path / "new.json").read_text())
    assert d["format"] == FORMAT == 2 and d["methods"]["snapkv"][0]["bits"] == 16
    assert Calibration.load(tmp_path / "new.json").methods == cal.methods


@pytest.mark.parametrize("bits", [3, "8", True, None, 4.0])
def test_a_bad_bit_width_is_refused(bits, tmp_path):
    d = {"format": 2, "model": {"key": "m"}, "methods": {"snapkv": [pt(1024, 0.5, 0.9, bits)]}}
    f = tmp_path / "c.json"
    f.write_text(json.dumps(d))
    with pytest.raises(KVTrimError, match="bits must be one of 16, 8, 4, 2"):
        Calibration.load(f)


def test_same_keep_at_two_bit_widths_is_two_points_but_not_twice_the_same():
    cal_of([pt(1024, 0.5, 0.9, 16), pt(1024, 0.5, 0.8, 8)])
    with pytest.raises(KVTrimError, match=r"a second point for length 1024, keep 0\.5, 8 bits"):
        cal_of([pt(1024, 0.5, 0.9, 8), pt(1024, 0.5, 0.8, 8)])


def line(task, sample, method, keep, score, kv, bits=None):
    d = {"task": task, "length": 1024, "sample": sample, "method": method, "keep": keep, "prefill": "dense",
         "score": score, "kv_bytes": kv, "kv_bytes_full": 100.0}
    return d if bits is None else d | {"kv_bits": bits}


def test_agreement_points_per_bit_width():
    """Each (keep, bits) is its own point scored against the 16-bit full cache; a low-bit full line is no reference."""
    lines = [
        line("passkey", 0, "full", None, 1.0, 100.0), line("passkey", 0, "full", None, 0.0, 28.0, 8),
        line("passkey", 0, "snapkv", 0.5, 1.0, 50.0), line("passkey", 0, "snapkv", 0.5, 0.0, 14.0, 8),
        line("passkey", 1, "full", None, 1.0, 100.0, 16), line("passkey", 1, "snapkv", 0.5, 1.0, 50.0, 16),
        line("passkey", 1, "snapkv", 0.5, 1.0, 14.0, 8),
    ]
    pts = {(p.keep, p.bits): p for p in agreement_points(lines)["snapkv"]}
    assert set(pts) == {(0.5, 16), (0.5, 8)}
    assert pts[(0.5, 16)].agreement == 1.0 and pts[(0.5, 16)].kv_frac == 0.5 and pts[(0.5, 16)].n == 2
    assert pts[(0.5, 8)].agreement == 0.5 and pts[(0.5, 8)].kv_frac == 0.14
    # the full cache at 8 bits: keep 1, scored against the 16-bit full cache (sample 0 lost the answer)
    (full8,) = agreement_points(lines)["full"]
    assert (full8.keep, full8.bits, full8.agreement, full8.n, full8.kv_frac) == (1.0, 8, 0.0, 1, 0.28)
    cal = build_calibration(lines, {"key": "k", "source": "S", "fingerprint": {}})
    assert cal.made["kv_bits"] == [16, 8]
    assert Calibration.from_dict(cal.to_dict()).methods == cal.methods


# ----------------------------------------------------------------------------- the command line
@pytest.fixture
def bits_cal(tmp_path):
    """A calibration whose pick at 0.9 is keep 0.5 at 8 bits (fingerprint left empty: any model)."""
    d = {"format": 2, "model": {"key": "tiny", "source": "tiny", "fingerprint": {}},
         "methods": {"snapkv": [pt(64, 0.25, 0.5, 16, 0.25), pt(64, 0.5, 0.95, 16, 0.5), pt(64, 0.5, 0.92, 8, 0.27)]}}
    f = tmp_path / "bits.json"
    f.write_text(json.dumps(d))
    return str(f)


def _generate_json(argv, capsys) -> tuple[dict, str]:
    assert main(argv + ["--max-new-tokens", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    return json.loads(out.strip().splitlines()[-1]), err


PROMPT = "one two three four five six seven eight nine ten " * 30


def test_generate_builds_the_cache_at_the_picked_bit_width(tiny_dir, bits_cal, capsys):
    base = ["generate", "--model", tiny_dir, "--method", "snapkv", "--prompt", PROMPT]
    d, err = _generate_json(base + ["--quality", "0.9", "--calibration", bits_cal], capsys)
    assert "kvtrim: --quality 0.9: snapkv keep 0.5, 8-bit KV (" in err
    assert d["budget_choice"]["kv_bits"] == 8 and d["budget_choice"]["keep"] == 0.5
    # the cache is the one --keep 0.5 --kv-bits 8 builds, and smaller than keep 0.5 at 16 bits
    at8, _ = _generate_json(base + ["--keep", "0.5", "--kv-bits", "8"], capsys)
    at16, _ = _generate_json(base + ["--keep", "0.5"], capsys)
    assert d["kv_bytes"] == at8["kv_bytes"] < at16["kv_bytes"]
    assert d["answer"] == at8["answer"]
    py = keep_for_quality("snapkv", None, 0.9, d["prompt_tokens"], calibration=bits_cal)  # the same pick in Python
    assert (py.keep, py.kv_bits) == (0.5, 8)


def test_kv_bits_against_the_pick_is_refused(tiny_dir, bits_cal, capsys):
    code = main(["generate", "--model", tiny_dir, "--method", "snapkv", "--quality", "0.9", "--calibration", bits_cal,
                 "--kv-bits", "4", "--prompt", PROMPT,
                 "--max-new-tokens", "2"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2
    errors = [e for e in err if e.startswith("kvtrim: error:")]
    assert len(errors) == 1 and "--kv-bits 4 and --quality" in errors[0] and "8 bits" in errors[0]


@pytest.mark.parametrize("given, want", [(None, 8), (16, 8), (8, 8)])
def test_chat_takes_the_picked_bit_width(bits_cal, given, want, capsys):
    """A session (kvtrim chat / stream) is made with the pick's kv_bits (_policy sets args.kv_bits)."""
    import argparse

    from kvtrim.cli.session import _policy

    args = argparse.Namespace(method="snapkv", keep=None, quality=0.9, max_tokens=None, position=None, model=None,
                              calibration=bits_cal, kv_bits=given)
    pol = _policy(args, streaming=False)
    assert pol.keep == 0.5 and args.kv_bits == want
    assert "snapkv keep 0.5, 8-bit KV" in capsys.readouterr().err
    args.kv_bits = 2
    with pytest.raises(KVTrimError, match="--kv-bits 2 and --quality"):
        _policy(args, streaming=False)


def test_heldout_script_scores_the_pick_against_the_16_bit_pick():
    """benchmarks/autobudget_bits_heldout.py on synthetic held-out lines: the pick's lines are the ones scored."""
    from kvtrim.tools.docs_tables import load_script

    h = load_script("benchmarks/autobudget_bits_heldout.py")
    cal = cal_of([pt(2048, 0.25, 0.6, 16, 0.26), pt(2048, 0.5, 0.95, 16, 0.51), pt(2048, 0.25, 0.5, 4, 0.05),
                  pt(2048, 0.5, 0.93, 4, 0.09)])
    lines = []
    for i in range(2):
        lines.append(line("passkey", i, "full", None, 1.0, 100.0, 16) | {"length": 2048, "prompt_tokens": 2050, "seed": 100003 + i})
        for keep, bits, score, kv in ((0.25, 16, 0.0, 26.0), (0.5, 16, 1.0, 51.0), (0.25, 4, 0.0, 5.0),
                                      (0.5, 4, float(i == 0), 9.0)):
            lines.append(line("passkey", i, "snapkv", keep, score, kv, bits) | {"length": 2048, "seed": 100003 + i})
    r = {row["quality"]: row for row in h.evaluate(cal, lines, (0.9, 0.99))["rows"]}
    assert r[0.9]["pick"]["picks"] == ["0.5@4"] and r[0.9]["pick"]["kv_share"] == 0.09
    assert r[0.9]["pick"]["agreement"] == 0.5 and not r[0.9]["met"]  # one of two held-out samples kept the answer
    assert r[0.9]["pick_16bit"]["picks"] == ["0.5@16"] and r[0.9]["pick_16bit"]["kv_share"] == 0.51 and r[0.9]["met_16bit"]
    assert r[0.9]["hindsight_16bit_keep"] == 0.5
    assert r[0.99]["pick"]["picks"] == ["full"] and r[0.99]["pick"]["kv_share"] == 1.0


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "passkey", "--kv-bits", "16,3", "--out", "x.json"], "--kv-bits takes comma-separated bit widths"),
    (["calibrate", "passkey", "--kv-bits", "8,,4", "--out", "x.json"], "--kv-bits takes a comma-separated list"),
    (["eval", "passkey", "--kv-bits", "sixteen", "--out", "x"], "--kv-bits takes comma-separated bit widths"),
])
def test_cli_refuses_bad_bit_lists(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kvtrim: error:") and message in err and err.count("\n") == 1


def test_a_short_prompt_is_kept_whole_at_16_bits():
    c = cal_of(MIXED).choose("snapkv", 0.9, 10)
    assert c.full and c.kv_bits == 16 and c.bit_widths == (16, 8, 4) and "kept whole" in c.reason



def with_full(points, full_points):
    d = {"format": 2, "model": {"key": "synthetic", "source": "Synthetic-1", "fingerprint": {}},
         "methods": {"snapkv": copy.deepcopy(points), "full": copy.deepcopy(full_points)}}
    return Calibration.from_dict(d)


def test_the_full_cache_at_a_low_bit_width_is_a_candidate():
    """Where no eviction budget meets Q, the full cache quantized may: less memory than the 16-bit full cache."""
    cal = with_full(MIXED, [pt(1024, 1.0, 0.99, 8, 0.28), pt(1024, 1.0, 0.97, 4, 0.16)])
    c = cal.choose("snapkv", 0.97, 1024)
    assert (c.keep, c.kv_bits, c.memory) == (1.0, 4, 0.16) and c.whole and not c.full
    assert "the full cache, nothing evicted" in c.reason and "4-bit KV" in c.reason
    assert cal.choose("snapkv", 0.98, 1024).kv_bits == 8 and cal.choose("snapkv", 0.995, 1024).full
    # below, an eviction budget with less memory still wins
    assert (cal.choose("snapkv", 0.95, 1024).keep, cal.choose("snapkv", 0.95, 1024).kv_bits) == (0.5, 4)
    # the full cache at 4 bits is the largest keep at 4 bits: a dip there lowers the 4-bit eviction budgets' credit
    low = with_full(MIXED, [pt(1024, 1.0, 0.80, 4, 0.16)])
    assert low.choose("snapkv", 0.9, 1024).kv_bits != 4
    # a policy for the pick: the full cache, to be built at 4 bits
    from kvtrim.budget import policy_for_quality

    pol, choice = policy_for_quality("snapkv", None, 0.97, 1024, calibration=cal)
    assert pol.name == "full" and choice.kv_bits == 4


@pytest.mark.parametrize("bits, ok", [(16, False), (8, True)])
def test_keep_1_only_at_a_low_bit_width(bits, ok):
    if ok:
        with_full(MIXED, [pt(1024, 1.0, 0.9, bits, 0.3)])
    else:
        with pytest.raises(KVTrimError, match="keep must be"):
            with_full(MIXED, [pt(1024, 1.0, 0.9, bits, 1.0)])


def test_generate_with_the_full_cache_quantized(tiny_dir, tmp_path, capsys):
    d = {"format": 2, "model": {"key": "tiny", "source": "tiny", "fingerprint": {}},
         "methods": {"snapkv": [pt(64, 0.5, 0.5, 16, 0.5)], "full": [pt(64, 1.0, 0.95, 4, 0.2)]}}
    f = tmp_path / "c.json"
    f.write_text(json.dumps(d))
    base = ["generate", "--model", tiny_dir, "--prompt", PROMPT]
    got, err = _generate_json(base + ["--method", "snapkv", "--quality", "0.9", "--calibration", str(f)], capsys)
    assert "kvtrim: --quality 0.9: snapkv full cache, 4-bit KV (" in err
    want, _ = _generate_json(base + ["--method", "full", "--kv-bits", "4"], capsys)
    assert got["kv_bytes"] == want["kv_bytes"] and got["answer"] == want["answer"] and got["method"] == "full"


def test_demo_runs_each_method_at_its_picked_bit_width(tiny_dir, bits_cal, capsys):
    code = main(["demo", "--model", tiny_dir, "--methods", "snapkv,full", "--quality", "0.9",
                 "--calibration", bits_cal, "--length", "512"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "snapkv keep 0.5, 8-bit KV" in err
    names = [line.split()[0] for line in out.splitlines() if line.startswith(("snapkv", "full"))]
    assert names == ["snapkv@8bit", "full"]  # a width --quality picked is named; full runs at --kv-bits (16)


def test_full_bits_table_compares_each_width_with_16_bits_sample_by_sample(tmp_path):
    """kv_bits_quality.py --full-bits: per task the full cache's score at each width and how many
    samples give the 16-bit answer (a changed answer counts even when it scores the same)."""
    import json

    from kvtrim.tools.docs_tables import load_script

    q = load_script("benchmarks/kv_bits_quality.py")
    runs = tmp_path / "sweep" / "runs"
    runs.mkdir(parents=True)
    lines = []
    for s in range(3):
        for bits, ans, score in ((16, f"a{s}", 1.0), (8, f"a{s}", 1.0), (4, {1: "x", 2: "y"}.get(s, f"a{s}"), 1.0 if s != 2 else 0.0)):
            lines.append({"task": "passkey", "length": 64, "sample": s, "seed": 0, "sweep_seed": 0, "method": "full",
                          "keep": None, "kv_bits": bits, "prefill": "dense", "answer": ans, "score": score, "kv_bytes": 100 * bits,
                          "prefill_seconds": 0.1})
    (runs / "passkey-64.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = q.full_bits_table([str(tmp_path / "sweep")])
    row = next(x for x in out.splitlines() if x.startswith("| passkey"))
    assert row == "| passkey (0) | 3 | 1.00 | 1.00 | 3/3 | 0.67 | 1/3 |"
    assert "3 of 3 samples give the 16-bit answer at 8 bits; 1 of 3 samples give the 16-bit answer at 4 bits" in out
