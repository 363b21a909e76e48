"""Bad inputs, one table: every command and the Python API answer a bad input with one clear error.

A command-line row runs ``kvtrim ARGV`` in-process and asserts exit status 2 and exactly one stderr
line ``kvtrim: error: ...`` holding the row's message fragment. Unless a row is marked ``LOADS``
(the bad input *is* the model), ``kvtrim.models.load_model`` fails the test if it is called: an
argument error must fire before the model loads. A Python row asserts a ``KVTrimError`` with the
fragment and a one-line message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import kvtrim
from kvtrim import models
from kvtrim.cli import main
from kvtrim.errors import KVTrimError

LOADS = "loads"  # the row's bad input is the model itself: load_model may (must) run

GOOD_LINE = {"task": "passkey", "length": 512, "sample": 0, "seed": 0, "depth": 0.5, "method": "full", "keep": None,
             "prefill": "dense", "score": 1.0, "correct": True, "answer": "12345", "prompt_tokens": 500,
             "new_tokens": 6, "kv_bytes": 1000, "kv_bytes_full": 1000, "prefill_seconds": 0.1, "decode_seconds": 0.05,
             "decode_steps": 6}


def _results(d: Path, lines: list) -> str:
    """An eval result directory whose one file holds ``lines`` (dicts are dumped, bytes written as they are)."""
    (d / "runs").mkdir(parents=True)
    data = b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)
    (d / "runs" / "passkey-512.jsonl").write_bytes(data)
    return str(d)


def _pattern_config(d: Path, name: str, body) -> str:
    p = d / name
    p.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(p)


def _pc(entry: dict, **model) -> dict:
    """A one-layer, one-head pattern config with ``entry`` as its head."""
    return {"format": "kvtrim-pattern-config/1", "model": {"num_hidden_layers": 1, "num_attention_heads": 1} | model,
            "layers": [[entry]]}


@pytest.fixture
def f(tmp_path) -> dict:
    """Scratch files the rows name as {key}."""
    t = tmp_path
    (t / "adir").mkdir()
    (t / "empty.txt").write_bytes(b"")
    (t / "blank.txt").write_text("  \n\t\n")
    (t / "text.txt").write_text("Some words of a text to read. " * 30)
    (t / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (t / "latin1.txt").write_bytes("Zürich café, the pass key is 4821.".encode("latin-1"))
    (t / "afile").write_text("x")
    (t / "README.md").write_text("# no report block here\n")
    (t / "fake.gguf").write_text("not a model\n")
    (t / "model.txt").write_text("not a model\n")
    (t / "m_badjson").mkdir()
    (t / "m_badjson" / "config.json").write_text("{not json")
    lines = [GOOD_LINE | {"sample": i} for i in range(3)]
    files = {
        "t": str(t), "adir": str(t / "adir"), "empty": str(t / "empty.txt"), "blank": str(t / "blank.txt"),
        "text": str(t / "text.txt"), "binary": str(t / "binary.bin"), "latin1": str(t / "latin1.txt"),
        "afile": str(t / "afile"), "nofile": str(t / "nope.txt"), "readme": str(t / "README.md"),
        "fake_gguf": str(t / "fake.gguf"), "model_txt": str(t / "model.txt"), "m_badjson": str(t / "m_badjson"),
        "undir": str(t / "afile" / "sub"),
        "pc_garbage": _pattern_config(t, "pc_garbage.json", '{"format": "kvtrim-pattern-config/1", model'),
        "pc_nomodel": _pattern_config(t, "pc_nomodel.json", {"format": "kvtrim-pattern-config/1"}),
        "pc_nolayers": _pattern_config(t, "pc_nolayers.json", {"format": "kvtrim-pattern-config/1", "model": {}}),
        "pc_types": _pattern_config(t, "pc_types.json", {"format": "kvtrim-pattern-config/1", "model": [], "layers": 5}),
        "pc_layers_int": _pattern_config(t, "pc_layers_int.json", _pc({}) | {"layers": 5}),
        "pc_counts_str": _pattern_config(t, "pc_counts_str.json", _pc({"pattern": "dense"}, num_hidden_layers="1")),
        "pc_badpattern": _pattern_config(t, "pc_badpattern.json", _pc({"pattern": "nosuch"})),
        "pc_unknown_keys": _pattern_config(t, "pc_unknown_keys.json", _pc({"pattern": "vertical_slash", "n_v": 8, "n_s": 8})),
        "pc_size_str": _pattern_config(t, "pc_size_str.json", _pc({"pattern": "block_sparse", "k_b": "abc"})),
        "pc_size_neg": _pattern_config(t, "pc_size_neg.json", _pc({"pattern": "a_shape", "n_init": -5})),
        "pc_entry_list": _pattern_config(t, "pc_entry_list.json", _pc({}) | {"layers": [[["a_shape"]]]}),
        "pc_shape": _pattern_config(t, "pc_shape.json", _pc({"pattern": "dense"}) | {"layers": [[], []]}),
        "pc_not_config": _pattern_config(t, "pc_not_config.json", {"layers": []}),
        "rep_empty": str((t / "rep_empty").mkdir() or t / "rep_empty"),
        "rep_cut": _results(t / "rep_cut", [lines[0], json.dumps(lines[1]).encode()[:40], lines[2]]),
        "rep_torn": str(t / "rep_torn"),
        "rep_emptyobj": _results(t / "rep_emptyobj", [*lines, {}]),
        "rep_score_str": _results(t / "rep_score_str", [lines[0], lines[1] | {"score": "abc"}]),
        "rep_list": _results(t / "rep_list", [lines[0], [1, 2, 3]]),
        "rep_length_str": _results(t / "rep_length_str", [lines[0] | {"length": "512"}]),
        "rep_many": _results(t / "rep_many", [{}, {}, {}, {}, {}, lines[0]]),
        "rep_ok": _results(t / "rep_ok", lines),
    }
    _torn(files)
    return files


def _torn(f):
    """A result file whose last line has no newline (an interrupted writer)."""
    d = Path(f["rep_torn"])
    (d / "runs").mkdir(parents=True)
    (d / "runs" / "passkey-512.jsonl").write_text(json.dumps(GOOD_LINE) + "\n" + json.dumps(GOOD_LINE | {"sample": 1})[:-9])


# (id, argv, message fragment[, LOADS]); {key} is a scratch path from the fixture ``f``
CLI_ROWS = [
    # --- generate: methods and budgets
    ("gen_unknown_method", "generate --method nosuch --question hi", "unknown method 'nosuch'"),
    ("gen_keep0", "generate --method snapkv --keep 0 --question hi", "keep must be a fraction in (0, 1]"),
    ("gen_keep_neg", "generate --method snapkv --keep -1 --question hi", "keep must be a fraction in (0, 1]"),
    ("gen_keep_1.5", "generate --method snapkv --keep 1.5 --question hi", "got 1.5"),
    ("gen_keep_nan", "generate --method snapkv --keep nan --question hi", "got nan"),
    ("gen_keep_inf", "generate --method snapkv --keep inf --question hi", "got inf"),
    ("gen_keep_abc", "generate --method snapkv --keep abc --question hi", "--keep must be a number, got 'abc'"),
    ("gen_keep_and_max", "generate --method snapkv --keep 0.5 --max-tokens 9 --question hi", "not allowed with argument"),
    ("gen_maxtok0", "generate --method snapkv --max-tokens 0 --question hi", "--max-tokens must be a positive integer, got 0"),
    ("gen_maxtok8", "generate --method snapkv --max-tokens 8 --question hi", "smaller than the 36 tokens"),
    ("gen_maxtok_neg", "generate --method h2o --max-tokens -5 --question hi", "--max-tokens must be a positive integer, got -5"),
    ("gen_full_budget", "generate --method full --max-tokens 100 --question hi", "full keeps every token"),
    ("gen_position", "generate --method h2o --keep 0.5 --position sideways --question hi", "unknown position policy 'sideways'"),
    ("gen_mnt_neg", "generate --method snapkv --keep 0.5 --question hi --max-new-tokens -3",
     "--max-new-tokens must be a non-negative number of tokens, got -3"),
    ("gen_mnt_float", "generate --max-new-tokens 1.5 --question hi", "--max-new-tokens must be an integer, got '1.5'"),
    ("gen_temperature0", "generate --sample --temperature 0 --question hi", "--temperature must be a finite number > 0"),
    ("gen_temperature_nan", "generate --sample --temperature nan --question hi", "got nan"),
    ("gen_empty_question", "generate --question '   '", "the question is empty"),
    ("gen_empty_prompt", "generate --prompt ''", "the prompt is empty"),
    ("gen_no_question", "generate --method full", "one of the arguments --question --prompt --prompts-file is required"),
    # --- generate: files
    ("gen_ctx_empty", "generate --context-file {empty} --question hi", "is empty"),
    ("gen_ctx_blank", "generate --context-file {blank} --question hi", "is empty"),
    ("gen_ctx_dir", "generate --context-file {adir} --question hi", "does not exist or is not a file"),
    ("gen_ctx_missing", "generate --context-file {nofile} --question hi", "does not exist or is not a file"),
    ("gen_ctx_binary", "generate --context-file {binary} --question hi", "is not text"),
    ("gen_ctx_latin1", "generate --context-file {latin1} --question hi", "is not UTF-8 text"),
    ("gen_image_missing", "generate --image {nofile} --question hi", "does not exist or is not a file"),
    # --- generate: sparse prefill and pattern configs
    ("pf_unknown", "generate --prefill sparse9 --question hi", "unknown --prefill 'sparse9'"),
    ("pf_size_abc", "generate --prefill a_shape --prefill-size k_b=abc --question hi", "--prefill-size must be KEY=VALUE with an integer VALUE, got 'k_b=abc'"),
    ("pf_size_noeq", "generate --prefill a_shape --prefill-size k_b --question hi", "--prefill-size must be KEY=VALUE (e.g. k_b=32), got 'k_b'"),
    ("pf_size_neg", "generate --prefill a_shape --prefill-size n_init=-5 --question hi", "--prefill-size must be KEY=VALUE with 1 <= VALUE < 2^31, got 'n_init=-5'"),
    ("pf_size_huge", "generate --prefill a_shape --prefill-size n_init=2147483648 --question hi", "1 <= VALUE < 2^31"),
    ("pf_size_key", "generate --prefill a_shape --prefill-size zz=5 --question hi", "does not take ['zz']"),
    ("pf_size_minference", "generate --prefill minference --prefill-size k_b=8 --question hi", "single-pattern modes"),
    ("pf_minlen0", "generate --prefill a_shape --prefill-min-length 0 --question hi",
     "--prefill-min-length must be a positive number of tokens, got 0"),
    ("pf_minlen0_minference", "generate --prefill minference --prefill-min-length 0 --question hi",
     "--prefill-min-length must be a positive number of tokens"),
    ("pc_missing", "generate --prefill minference --pattern-config {nofile} --question hi", "does not exist"),
    ("pc_garbage", "generate --prefill minference --pattern-config {pc_garbage} --question hi", "is not valid JSON"),
    ("pc_binary", "generate --prefill minference --pattern-config {binary} --question hi", "is not valid JSON"),
    ("pc_not_config", "generate --prefill minference --pattern-config {pc_not_config} --question hi",
     "is not a kvtrim-pattern-config/1 file"),
    ("pc_nomodel", "generate --prefill minference --pattern-config {pc_nomodel} --question hi", "has no 'model' or 'layers'"),
    ("pc_nolayers", "generate --prefill minference --pattern-config {pc_nolayers} --question hi", "has no 'layers'"),
    ("pc_types", "generate --prefill minference --pattern-config {pc_types} --question hi", "'model' must be an object"),
    ("pc_layers_int", "generate --prefill minference --pattern-config {pc_layers_int} --question hi",
     "'layers' must be a list"),
    ("pc_counts_str", "generate --prefill minference --pattern-config {pc_counts_str} --question hi",
     "model.num_hidden_layers must be a positive integer, got '1'"),
    ("pc_shape", "generate --prefill minference --pattern-config {pc_shape} --question hi", "is inconsistent"),
    ("pc_entry_list", "generate --prefill minference --pattern-config {pc_entry_list} --question hi",
     "layer 0 head 0: an entry must be an object"),
    ("pc_badpattern", "generate --prefill minference --pattern-config {pc_badpattern} --question hi",
     "layer 0 head 0: unknown sparse pattern 'nosuch'"),
    ("pc_unknown_keys", "generate --prefill minference --pattern-config {pc_unknown_keys} --question hi",
     "unknown key(s) ['n_s', 'n_v'] for pattern 'vertical_slash'; it takes k_v, k_s"),
    ("pc_size_str", "generate --prefill minference --pattern-config {pc_size_str} --question hi",
     "size k_b must be an integer, got 'abc'"),
    ("pc_size_neg", "generate --prefill minference --pattern-config {pc_size_neg} --question hi",
     "n_init must be a positive integer"),
    ("pc_with_dense", "generate --prefill dense --pattern-config {pc_size_neg} --question hi", "n_init must be"),
    # --- the model itself (load_model runs and refuses it)
    ("model_missing", "generate --model {nofile} --question hi", "does not exist", LOADS),
    ("model_txt", "generate --model {model_txt} --question hi", "is not a .gguf file", LOADS),
    ("model_fake_gguf", "generate --model {fake_gguf} --question hi", "is not a GGUF file", LOADS),
    ("model_dir_noconfig", "generate --model {adir} --question hi", "has no config.json", LOADS),
    ("model_badjson", "generate --model {m_badjson} --question hi", "is not valid JSON", LOADS),
    # --- argparse
    ("no_command", "", "the following arguments are required: command"),
    ("unknown_command", "nosuch", "invalid choice: 'nosuch'"),
    ("unknown_flag", "methods --nosuch", "unrecognized arguments: --nosuch"),
    # --- stream
    ("stream_chunk0", "stream --file {text} --chunk 0", "--chunk must be a positive number of tokens, got 0"),
    ("stream_chunk_many", "stream --file {text} --chunk many", "--chunk must be an integer, got 'many'"),
    ("stream_missing", "stream --file {nofile}", "does not exist or is not a file"),
    ("stream_empty", "stream --file {empty}", "is empty"),
    ("stream_binary", "stream --file {binary}", "is not text"),
    ("stream_budget0", "stream --file {text} --max-tokens 0", "--max-tokens must be a positive integer, got 0"),
    ("stream_budget8", "stream --file {text} --method inf_mllm --max-tokens 8", "smaller than the 36 tokens"),
    ("stream_budget4", "stream --file {text} --max-tokens 4", "smaller than the 5 tokens"),
    ("stream_snapkv", "stream --file {text} --method snapkv", "cannot stream"),
    ("stream_limit0", "stream --file {text} --limit 0", "--limit must be a positive number of tokens, got 0"),
    ("stream_limit_neg", "stream --file {text} --limit -1", "--limit must be a positive number of tokens, got -1"),
    ("stream_save_file", "stream --file {text} --save {afile}", "'{afile}' exists and is not a directory"),
    ("stream_save_under_file", "stream --file {text} --save {undir}", "Not a directory"),
    # --- chat
    ("chat_mnt0", "chat --max-new-tokens 0", "--max-new-tokens must be a positive number of tokens, got 0"),
    ("chat_budget", "chat --method inf_mllm --max-tokens 10", "smaller than the 36 tokens"),
    ("chat_budget_default", "chat --max-tokens 4", "smaller than the 5 tokens"),
    ("chat_unknown_method", "chat --method nosuch", "unknown method 'nosuch'"),
    ("chat_load_missing", "chat --load {nofile}", "does not exist"),
    ("chat_load_method", "chat --load {adir} --method h2o", "--load continues a saved session"),
    ("chat_load_budget", "chat --load {adir} --max-tokens 64", "--max-tokens cannot change them"),
    ("chat_temperature", "chat --sample --temperature -1", "--temperature must be a finite number > 0"),
    ("chat_save_file", "chat --save {afile}", "exists and is not a directory"),
    ("chat_save_under_file", "chat --save {undir}", "Not a directory"),
    # --- eval
    ("eval_unknown_task", "eval nosuch --methods snapkv --out {t}/ev", "unknown task 'nosuch'"),
    ("eval_len10", "eval passkey --methods snapkv --length 10 --out {t}/ev", "--length must be comma-separated integers >= 128 and < 2^31, got '10'"),
    ("eval_samples0", "eval passkey --methods snapkv --samples 0 --out {t}/ev", "--samples must be a positive integer"),
    ("eval_samples_ten", "eval passkey --samples ten --out {t}/ev", "--samples must be an integer, got 'ten'"),
    ("eval_out_file", "eval passkey --methods snapkv --out {afile}", "cannot write to the output directory"),
    ("eval_out_missing", "eval passkey --methods snapkv", "the following arguments are required: --out"),
    ("eval_keep1", "eval passkey --methods snapkv --keep 1.0 --out {t}/ev", "--keep must be comma-separated numbers in (0, 1), got '1.0' (1 is the full cache, run as method 'full')"),
    ("eval_fastv", "eval passkey --methods fastv --out {t}/ev", "compresses visual tokens only"),
    ("eval_empty_item", "eval passkey, --methods snapkv --out {t}/ev",
     "the tasks argument takes a comma-separated list without empty items"),
    ("eval_shard", "eval passkey --methods snapkv --shard 3/2 --out {t}/ev", "--shard must be I/N with 0 <= I < N"),
    ("eval_shard_abc", "eval passkey --methods snapkv --shard a/b --out {t}/ev", "--shard must be I/N"),
    ("eval_haystack", "eval passkey --methods snapkv --haystack nosuch --out {t}/ev", "unknown haystack 'nosuch'"),
    ("eval_seed_neg", "eval passkey --methods snapkv --seed -1 --out {t}/ev", "--seed must be a non-negative integer"),
    ("eval_prefill", "eval passkey --methods snapkv --prefill fast --out {t}/ev", "unknown --prefill"),
    # --- report (corrupted result lines are refused with file:line)
    ("report_missing", "report {t}/nosuch", "is not a directory of kvtrim eval results"),
    ("report_emptydir", "report {rep_empty}", "holds no result lines"),
    ("report_cut_line", "report {rep_cut} --no-plots", "passkey-512.jsonl:2 (not valid JSON"),
    ("report_torn_last", "report {rep_torn} --no-plots", "passkey-512.jsonl:2 (the last line, cut short: not valid JSON)"),
    ("report_emptyobj", "report {rep_emptyobj} --no-plots", "passkey-512.jsonl:4 (no task, length, sample"),
    ("report_score_str", "report {rep_score_str} --no-plots", "passkey-512.jsonl:2 (score is 'abc')"),
    ("report_json_list", "report {rep_list} --json", "passkey-512.jsonl:2 (a JSON list, not an object)"),
    ("report_length_str", "report {rep_length_str} --no-plots", "passkey-512.jsonl:1 (length is '512')"),
    ("report_many", "report {rep_many} --no-plots", "5 corrupted result lines"),
    ("report_out_file", "report {rep_ok} --no-plots --out {afile}", "--out '{afile}' is a file"),
    ("report_out_under_file", "report {rep_ok} --no-plots --out {undir}", "cannot create a directory"),
    ("report_readme_missing", "report {rep_ok} --no-plots --readme {nofile}", "does not exist or is not a file"),
    ("report_readme_noblock", "report {rep_ok} --no-plots --readme {readme}", "has no <!-- kvtrim-report:start -->"),
    # --- bench
    ("bench_len_abc", "bench --lengths abc", "--lengths must be comma-separated integers >= 128 and < 2^31, got 'abc'"),
    ("bench_len_small", "bench --lengths 10,20", "--lengths must be comma-separated integers >= 128 and < 2^31, got '10,20'"),
    ("bench_len_empty", "bench --lengths ''", "--lengths must be comma-separated integers >= 128 and < 2^31, got ''"),
    ("bench_len_neg", "bench --lengths -512", "--lengths must be comma-separated integers >= 128 and < 2^31, got '-512'"),
    ("bench_keep_nan", "bench --keep nan", "--keep must be a fraction in (0, 1]"),
    ("bench_out_dir", "bench --methods full --lengths 128 --out {adir}", "is a directory"),
    ("bench_out_exists", "bench --methods full --lengths 128 --out {afile}", "exists; name a new file"),
    ("bench_reps0", "bench --reps 0", "--reps must be a positive integer, got 0"),
    ("bench_new_tokens", "bench --new-tokens 1", "--new-tokens must be an integer >= 2"),
    ("bench_threads0", "bench --threads 0", "--threads must be an integer in [1, 4096], got 0"),
    ("bench_prefill", "bench --prefill nosuch", "unknown --prefill 'nosuch'"),
    ("bench_method", "bench --methods nosuch", "unknown method 'nosuch'"),
    # --- search-patterns
    ("search_density", "search-patterns --density 0,1.5 --out {t}/sp.json", "--density must be comma-separated numbers in (0, 1), got '0,1.5'"),
    ("search_density_abc", "search-patterns --density abc --out {t}/sp.json", "--density must be comma-separated numbers in (0, 1), got 'abc'"),
    ("search_length", "search-patterns --length 100 --out {t}/sp.json", "--length must be an integer >= 256, got 100"),
    ("search_max_error", "search-patterns --max-error 0 --out {t}/sp.json", "--max-error must be a finite number > 0, got 0.0"),
    ("search_out_nodir", "search-patterns --length 256 --out {t}/nodir/sp.json", "does not exist"),
    ("search_out_dir", "search-patterns --out {adir}", "is a directory; give a file name"),
    # --- demo
    ("demo_method", "demo --methods snapkv,nosuch", "unknown method 'nosuch'"),
    ("demo_len5", "demo --methods full --length 5", "--length must be an integer >= 128, got 5"),
    ("demo_depth5", "demo --methods full --length 200 --depth 5", "--depth must be a fraction in [0, 1], got 5.0"),
    ("demo_depth_nan", "demo --methods full --depth nan", "--depth must be a fraction in [0, 1], got nan"),
    ("demo_keep0", "demo --methods snapkv --keep 0", "keep must be a fraction in (0, 1]"),
]


def _argv(row_argv: str, f: dict) -> list[str]:
    import shlex

    return shlex.split(row_argv.format(**f))


@pytest.mark.parametrize("argv, fragment, loads",
                         [pytest.param(r[1], r[2], len(r) > 3, id=r[0]) for r in CLI_ROWS])
def test_cli_bad_input_is_one_line_exit_2(argv, fragment, loads, f, monkeypatch, capsys):
    import huggingface_hub.constants

    if loads:  # a private conversion cache and an empty Hugging Face cache
        monkeypatch.setenv("KVTRIM_CACHE_DIR", f["t"] + "/kvcache")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", f["t"] + "/hub")
    else:
        monkeypatch.setattr(models, "load_model", _refuse_load)
    try:
        rc = main(_argv(argv, f))
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("kvtrim: error: ") and err.count("\n") == 1, err
    assert fragment.format(**f) in err, err


def _refuse_load(*a, **k):
    raise AssertionError("the model was loaded before the argument error was found")


def test_the_table_is_large_enough():
    assert len(CLI_ROWS) >= 60
    assert len({r[0] for r in CLI_ROWS}) == len(CLI_ROWS)
    commands = {r[1].split()[0] for r in CLI_ROWS if r[1]}
    assert {"generate", "stream", "chat", "eval", "report", "bench", "search-patterns", "demo"} <= commands


# ----------------------------------------------------------------------------- the Python API
def _pattern_config_obj(**kw):
    from kvtrim.integrations.prefill import PatternConfig

    return PatternConfig(**({"model": {"num_hidden_layers": 1, "num_attention_heads": 1}, "layers": [[{"pattern": "dense"}]]}
                            | kw))


def _load_dirs(f, key):
    from kvtrim.eval.report import load_dirs

    return load_dirs([f[key]])


def _compress(model, method, **kw):
    with kvtrim.compress(model, method, **kw):
        pass


def _two_rows(model):
    ids = torch.randint(3, 100, (2, 12))
    with kvtrim.compress(model, "snapkv", keep=0.5) as cache:
        model(ids, past_key_values=cache)


def _beam_search(model):
    ids = torch.randint(3, 100, (1, 12))
    with kvtrim.compress(model, "snapkv", keep=0.5) as cache:
        model.generate(ids, past_key_values=cache, num_beams=2, max_new_tokens=2, do_sample=False)


def _oov(model):
    from kvtrim.generation import generate_ids
    from kvtrim.registry import create_policy

    generate_ids(model, None, [1, 2, 10**7], create_policy("full"), max_new_tokens=1)


def _make_plan(**kw):
    from kvtrim.eval.plan import make_plan

    make_plan(**({"tasks": "passkey", "lengths": "512", "methods": "snapkv", "keeps": "0.25"} | kw))


def _create(method, **kw):
    from kvtrim.registry import create_policy

    create_policy(method, **kw)


def _read_pattern_config(f, key):
    from kvtrim.integrations.prefill import PatternConfig

    PatternConfig.load(f[key])


def _make_pattern(name, **sizes):
    from kvtrim.integrations.prefill import make_pattern

    make_pattern(name, **sizes)


# (id, call(f, model), message fragment)
API_ROWS = [
    ("compress_unknown", lambda f, m: _compress(m, "nosuch"), "unknown method 'nosuch'"),
    ("compress_keep0", lambda f, m: _compress(m, "snapkv", keep=0), "keep must be a fraction in (0, 1]"),
    ("compress_keep_str", lambda f, m: _compress(m, "snapkv", keep="0.5"), "keep must be"),
    ("compress_unknown_param", lambda f, m: _compress(m, "snapkv", keep=0.5, nosuch=1), "nosuch"),
    ("policy_max_tokens_float", lambda f, m: _create("h2o", max_tokens=64.0), "max_tokens must be an integer"),
    ("policy_window_neg", lambda f, m: _create("snapkv", keep=0.5, window=-3), "window"),
    ("policy_position", lambda f, m: _create("h2o", keep=0.5, position="sideways"), "unknown position policy"),
    ("batch_of_two", lambda f, m: _two_rows(m), "supports batch size 1 (got 2 sequences"),
    ("beam_search", lambda f, m: _beam_search(m), "beam search (num_beams > 1)"),
    ("generate_ids_oov", lambda f, m: _oov(m), "10000000"),
    ("pattern_config_model_list", lambda f, m: _pattern_config_obj(model=[]), "'model' must be an object"),
    ("pattern_config_layers_int", lambda f, m: _pattern_config_obj(layers=3), "'layers' must be a list"),
    ("pattern_config_unknown_key", lambda f, m: _pattern_config_obj(layers=[[{"pattern": "a_shape", "k_v": 3}]]),
     "unknown key(s) ['k_v'] for pattern 'a_shape'"),
    ("pattern_config_size_float", lambda f, m: _pattern_config_obj(layers=[[{"pattern": "block_sparse", "k_b": 2.5}]]),
     "size k_b must be an integer, got 2.5"),
    ("pattern_config_load_nomodel", lambda f, m: _read_pattern_config(f, "pc_nomodel"), "has no 'model' or 'layers'"),
    ("pattern_config_load_unknown_keys", lambda f, m: _read_pattern_config(f, "pc_unknown_keys"),
     "pc_unknown_keys.json', layer 0 head 0: unknown key(s)"),
    ("make_pattern_unknown", lambda f, m: _make_pattern("nosuch"), "unknown sparse pattern 'nosuch'"),
    ("make_pattern_size", lambda f, m: _make_pattern("a_shape", k_b=3), "does not take ['k_b']"),
    ("load_dirs_cut", lambda f, m: _load_dirs(f, "rep_cut"), "passkey-512.jsonl:2 (not valid JSON"),
    ("load_dirs_emptyobj", lambda f, m: _load_dirs(f, "rep_emptyobj"), "passkey-512.jsonl:4 (no task"),
    ("load_dirs_score_str", lambda f, m: _load_dirs(f, "rep_score_str"), "(score is 'abc')"),
    ("make_plan_samples", lambda f, m: _make_plan(samples=0), "--samples"),
    ("make_plan_task", lambda f, m: _make_plan(tasks="nosuch"), "unknown task 'nosuch'"),
    ("load_model_missing", lambda f, m: models.load_model(f["nofile"]), "does not exist"),
]


@pytest.mark.parametrize("call, fragment", [pytest.param(r[1], r[2], id=r[0]) for r in API_ROWS])
def test_python_bad_input_is_a_kvtrim_error(call, fragment, f, model):
    with pytest.raises(KVTrimError) as e:
        call(f, model)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- corrupted result lines
def test_read_lines_warns_with_file_and_line(f, caplog):
    from kvtrim.eval.store import read_lines, result_files

    files = result_files(f["rep_emptyobj"])
    with caplog.at_level("WARNING", logger="kvtrim.eval.store"):
        rows = read_lines(files)
    assert len(rows) == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"{files[0]}:4: corrupted result line (no task, length, sample, method, score, kv_bytes, prefill_seconds); left out"]
    assert files[0].read_text().count("\n") == 4  # without repair the file is untouched


def test_load_dirs_refuses_with_every_corrupted_line(f):
    from kvtrim.errors import CorruptResultsError
    from kvtrim.eval.report import load_dirs

    with pytest.raises(CorruptResultsError) as e:
        load_dirs([f["rep_ok"], f["rep_many"]])
    path = str(Path(f["rep_many"]) / "runs" / "passkey-512.jsonl")
    assert [(p, no) for p, no, _ in e.value.bad] == [(path, no) for no in range(1, 6)]
    assert str(e.value).startswith(f"5 corrupted result lines: {path}:1 (no task, ") and "and 2 more" in str(e.value)


def test_load_dirs_not_strict_warns_and_leaves_the_line_out(f, caplog):
    from kvtrim.eval.report import load_dirs

    with caplog.at_level("WARNING", logger="kvtrim.eval.store"):
        rows = load_dirs([f["rep_score_str"]], strict=False)
    assert len(rows) == 1
    assert "passkey-512.jsonl:2: corrupted result line (score is 'abc')" in caplog.text


def test_repair_moves_corrupted_lines_out_with_their_line_numbers(tmp_path):
    from kvtrim.eval.store import read_lines, result_files

    good = [GOOD_LINE | {"sample": i} for i in range(4)]
    cut = json.dumps(good[1]).encode()[:30]
    d = _results(tmp_path / "r", [good[0], cut, good[2], {}, good[3]])
    p = result_files(d)[0]
    with open(p, "ab") as fh:
        fh.write(b'{"task": "pass')  # torn last line
    rows = read_lines([p], repair=True)
    assert rows == [good[0], good[2], good[3]]
    assert p.read_bytes() == b"".join(json.dumps(x).encode() + b"\n" for x in (good[0], good[2], good[3]))
    assert Path(f"{p}.corrupt").read_bytes() == b"line 2: " + cut + b'\nline 4: {}\nline 6: {"task": "pass\n'
    assert read_lines([p], repair=True) == rows  # nothing left to repair


def test_a_complete_last_line_without_newline_is_kept_and_repair_adds_the_newline(tmp_path):
    from kvtrim.eval.store import read_lines

    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(GOOD_LINE))
    assert read_lines([p]) == [GOOD_LINE] and p.read_text() == json.dumps(GOOD_LINE)
    assert read_lines([p], repair=True) == [GOOD_LINE]
    assert p.read_text() == json.dumps(GOOD_LINE) + "\n"  # the next appended line starts on its own line


def test_report_prints_one_line_without_a_traceback_in_a_subprocess(f):
    """The real entry point (logging configured, no pytest capture) prints exactly the one error line."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(kvtrim.__file__).parents[1]))
    r = subprocess.run([sys.executable, "-c", "import sys; from kvtrim.cli import main; sys.exit(main())", "report",
                        f["rep_emptyobj"], "--no-plots"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvtrim: error: 1 corrupted result line: "), r.stderr
