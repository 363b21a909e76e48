"""kvtrim.models.extend_context (``--rope-scaling``): transformers' YaRN / linear RoPE on a loaded model."""

from __future__ import annotations

import pytest
import torch
from conftest import cli_status, tiny_llama

from kvtrim.errors import KVTrimError
from kvtrim.models import extend_context


def test_yarn_stretches_the_context_and_changes_the_rotation():
    model = tiny_llama()
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    before = model(ids).logits
    inv = model.model.rotary_emb.inv_freq.clone()
    assert extend_context(model, 4.0) == 1024
    cfg = model.config
    assert cfg.max_position_embeddings == 1024
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["original_max_position_embeddings"] == 256
    rot = model.model.rotary_emb
    assert rot.rope_type == "yarn" and rot.attention_scaling > 1.0  # YaRN's attention temperature
    assert torch.allclose(rot.inv_freq[0], inv[0]) and bool(rot.inv_freq[-1] < inv[-1])  # high frequencies kept, low ones stretched
    after = model(ids).logits
    assert torch.isfinite(after).all() and not torch.allclose(before, after)


def test_linear_divides_every_frequency():
    model = tiny_llama()
    inv = model.model.rotary_emb.inv_freq.clone()
    extend_context(model, 2, "linear")
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv / 2)


@pytest.mark.parametrize("factor, kind, message", [
    (0.5, "yarn", "must be a number in \\[1, 64\\]"),
    (True, "yarn", "must be a number"),
    (2.0, "ntk", "unknown RoPE scaling 'ntk'"),
])
def test_bad_scaling_is_refused(factor, kind, message):
    with pytest.raises(KVTrimError, match=message):
        extend_context(tiny_llama(), factor, kind)


def test_scaling_twice_is_refused():
    model = tiny_llama()
    extend_context(model, 2.0)
    with pytest.raises(KVTrimError, match="already scaled"):
        extend_context(model, 2.0)


@pytest.mark.parametrize("value", ["yarn", "yarn:0", "ntk:4", "yarn:x", "yarn:100"])
def test_cli_bad_rope_scaling(value, capsys):
    assert cli_status(["generate", "--rope-scaling", value, "--question", "q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error: --rope-scaling must be KIND:FACTOR")


def test_calibrate_build_only_refuses_rope_scaling(tmp_path, capsys):
    argv = ["calibrate", "passkey", "--build-only", "--rope-scaling", "yarn:2", "--out", str(tmp_path / "c.json")]
    assert cli_status(argv) == 2
    assert "--build-only runs none" in capsys.readouterr().err


def test_a_search_records_the_rope_scaling_it_ran_under(embedded_tokenizer):
    """A config searched past the trained context says under which scaling (it only fits that one)."""
    from kvtrim.tools.search_patterns import search_patterns

    model = tiny_llama(vocab_size=len(embedded_tokenizer), max_position_embeddings=256)
    plain = search_patterns(model, embedded_tokenizer, length=256, target_density=0.5, progress=False)
    assert "rope_scaling" not in plain.search
    extend_context(model, 2.0)
    cfg = search_patterns(model, embedded_tokenizer, length=512, target_density=0.5, progress=False)
    assert cfg.search["rope_scaling"] == "yarn:2" and cfg.search["length"] > 256  # past the trained 256


def test_shipped_configs_follow_the_models_rope_scaling(tmp_path, monkeypatch):
    """A model run with --rope-scaling yarn:2 gets the configs searched under yarn:2; a plain model
    never does; a scaling nothing was searched under falls back to the plain configs."""
    import json

    import kvtrim.integrations.prefill as prefill
    from kvtrim.integrations.prefill import model_identity, rope_scaling_of, shipped_configs

    model = tiny_llama()
    ident = model_identity(model)
    (tmp_path / "configs").mkdir()
    for name, length, scaling in (("plain8k", 8192, None), ("plain32k", 32768, None), ("yarn64k", 65536, "yarn:2")):
        search = {"length": length, "model_tags": [ident["name"]], **({"rope_scaling": scaling} if scaling else {})}
        rows = [[{"pattern": "dense"}] * ident["num_attention_heads"]] * ident["num_hidden_layers"]
        (tmp_path / "configs" / f"{name}.json").write_text(json.dumps({"model": ident, "layers": rows, "search": search}))
    monkeypatch.setattr(prefill.resources, "files", lambda package: tmp_path)
    assert rope_scaling_of(model) is None
    assert [c.search["length"] for c in shipped_configs(model)] == [8192, 32768]
    extend_context(model, 2.0)
    assert rope_scaling_of(model) == "yarn:2"
    assert [c.search["length"] for c in shipped_configs(model)] == [65536]
    other = tiny_llama()
    extend_context(other, 4.0, "linear")
    assert [c.search["length"] for c in shipped_configs(other)] == [8192, 32768]
