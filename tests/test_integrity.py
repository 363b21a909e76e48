"""What kvtrim installs and caches is what it was: an installed reference model's GGUF is checked
against its SHA-256 on every load (cheaply, by a digest record) and fully on install and on
``kvtrim models verify``; the conversion cache records its source's digest and its own files'
digests, and a damaged one is converted again with one warning; a model directory whose
config.json does not fit its weights is refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_reference_models import _fake_model

from kvtrim import gguf
from kvtrim import reference_models as rm
from kvtrim.errors import KVTrimError, ModelLoadError


def _flip(path: Path, offset: int, keep_times: bool = False) -> None:
    """Change one byte of ``path`` in place (same size); with ``keep_times`` its times put back."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(data))
    if keep_times:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# ----------------------------------------------------------------------------- installed reference models
def test_an_install_records_the_digest_and_a_load_finds_a_flipped_byte(tmp_path, monkeypatch, caplog):
    chunks = [b"GGUF" + bytes(range(200)), bytes(range(50, 250)) * 3]
    m = _fake_model(tmp_path, monkeypatch, chunks)
    out = rm.assemble(m)
    rec = json.loads(rm.digest_record(m).read_text())
    assert rec["sha256"] == m.sha256 and rec["stat"][0] == m.size
    assert rm.check_installed(m) is None and rm.check_installed(m, full=True) is None
    _flip(out, 100)  # same size, one byte: what `models install` used to call verified
    assert "has SHA-256" in rm.check_installed(m)
    with caplog.at_level("WARNING", logger="kvtrim.reference_models"):
        assert rm.gguf_for  # a load goes through assemble
        rm.assemble(m)
    assert "is damaged" in caplog.text and "assembling it again" in caplog.text
    assert out.read_bytes() == b"".join(chunks) and rm.check_installed(m, full=True) is None


def test_install_and_verify_hash_the_whole_file_whatever_the_record_says(tmp_path, monkeypatch, capsys):
    from kvtrim.cli import main

    m = _fake_model(tmp_path, monkeypatch, [b"GGUF" + b"x" * 300])
    monkeypatch.setitem(rm.REFERENCE_MODELS, m.key, m)
    out = rm.assemble(m)
    _flip(out, 10)
    # a damage the cheap check cannot see: the record rewritten to the damaged file's stat
    rm.digest_record(m).write_text(json.dumps({"sha256": m.sha256, "stat": rm._stamp(out.stat())}))
    assert rm.check_installed(m) is None  # cheap: taken as recorded
    assert "has SHA-256" in rm.check_installed(m, full=True)
    assert main(["models", "verify", "fake", "--quiet"]) == 2
    cap = capsys.readouterr()
    assert f"fake: {out}: {out} has SHA-256" in cap.out
    assert cap.err.startswith("kvtrim: error: damaged: fake") and cap.err.count("\n") == 1
    assert rm.install(m, progress=False) == out  # install verifies fully: assembles it again
    assert rm.check_installed(m, full=True) is None
    assert main(["models", "verify", "fake", "--quiet"]) == 0
    assert f"fake: {out}: ok" in capsys.readouterr().out
    assert main(["models", "verify", "nosuch"]) == 2
    assert "unknown reference model 'nosuch'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the conversion cache
@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """converted_dir on a fake GGUF, the conversion replaced by one that writes two files (counted)."""
    monkeypatch.setenv("KVTRIM_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + os.urandom(64))
    calls = []

    def convert(g, out_dir):
        calls.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "model.safetensors").write_bytes(b"tensors" * 100)
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        gguf.record_conversion(out_dir, g)
        return out_dir

    monkeypatch.setattr(gguf, "convert_gguf", convert)
    monkeypatch.setattr(gguf, "_check_gguf_complete", lambda p: None)
    return src, calls


def test_the_conversion_records_its_source_and_files(fake_conversion):
    src, calls = fake_conversion
    out = gguf.converted_dir(src, "Fake")
    rec = json.loads((out / "kvtrim-converted.json").read_text())
    assert rec["sha256"] == gguf.file_digest(src) and set(rec["files"]) == {"model.safetensors", "config.json"}
    assert gguf.check_converted(out) is None and gguf.check_converted(out, full=True) is None
    assert gguf.converted_dir(src, "Fake") == out and len(calls) == 1  # whole: used as it is


@pytest.mark.parametrize("damage", ["flip", "cut", "remove", "marker"])
def test_a_damaged_conversion_is_converted_again_with_one_warning(fake_conversion, caplog, damage):
    src, calls = fake_conversion
    out = gguf.converted_dir(src, "Fake")
    st = out / "model.safetensors"
    if damage == "flip":
        _flip(st, 3)
    elif damage == "cut":
        st.write_bytes(st.read_bytes()[:50])
    elif damage == "remove":
        st.unlink()
    else:
        (out / "kvtrim-converted.json").write_text("{cut")
    assert gguf.check_converted(out) is not None
    with caplog.at_level("WARNING", logger="kvtrim.gguf"):
        assert gguf.converted_dir(src, "Fake") == out
    assert len(calls) == 2 and gguf.check_converted(out, full=True) is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "is damaged" in warnings[0].getMessage()


def test_a_damage_that_keeps_the_file_times_is_found_by_the_full_check(fake_conversion):
    src, _ = fake_conversion
    out = gguf.converted_dir(src, "Fake")
    _flip(out / "model.safetensors", 5, keep_times=True)
    assert gguf.check_converted(out) is None  # cheap: size and time as recorded
    assert gguf.check_converted(out, full=True) == "model.safetensors does not match its SHA-256"


def test_a_conversion_by_an_earlier_kvtrim_gets_its_record_without_converting_again(fake_conversion):
    src, calls = fake_conversion
    out = gguf.converted_dir(src, "Fake")
    marker = out / "kvtrim-converted.json"
    marker.write_text(json.dumps({"source": str(src), "sha256": gguf.file_digest(src)}))
    assert gguf.check_converted(out) == "no file digests recorded"
    assert gguf.converted_dir(src, "Fake") == out and len(calls) == 1
    assert set(json.loads(marker.read_text())["files"]) == {"model.safetensors", "config.json"}


# ----------------------------------------------------------------------------- config.json against the weights
@pytest.mark.parametrize("edit, message", [
    ({"num_hidden_layers": 2}, "the weights hold 3 decoder layers but the config says num_hidden_layers = 2"),
    ({"num_hidden_layers": 5}, "the weights hold 3 decoder layers but the config says num_hidden_layers = 5"),
    ({"vocab_size": 1000}, "model.embed_tokens.weight is .* but the config says .vocab_size, hidden_size. = .1000, 96."),
    ({"num_key_value_heads": 3}, r"model.layers.0.self_attn.k_proj.weight is \[32, 96\]"),
])
def test_a_config_that_does_not_fit_its_weights_is_refused(tmp_path, tiny_dir, edit, message):
    from kvtrim.models import load_model

    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | edit))
    with pytest.raises(ModelLoadError, match=f"config.json in .* does not fit its weights: {message}") as e:
        load_model(str(d))
    assert "\n" not in str(e.value)


def test_a_fitting_config_loads(tiny_dir):
    from kvtrim.models import load_model

    lm = load_model(tiny_dir)
    assert lm.model.config.num_hidden_layers == 3


def test_models_verify_is_a_known_action(capsys):
    from kvtrim.cli import main

    with pytest.raises(SystemExit):
        main(["models", "nosuch-action"])
    assert "verify" in capsys.readouterr().err
    assert issubclass(ModelLoadError, KVTrimError)
