"""Every attention implementation and RoPE layout kvtrim accepts gives the model's own results.

At keep 1 (``full``) a model under kvtrim must produce the logits of the same model without it,
for SDPA and eager attention, including eager-only architectures (Gemma2: soft-capping and
sliding layers live in its own eager function). Re-rotating cached keys must agree with the
model's own rotary code for every layout kvtrim accepts (rotate_half, interleaved, partial
rotary); a RoPE it cannot re-rotate is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import kvtrim
from kvtrim.errors import KVTrimError
from kvtrim.rope import find_rotary

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)

# model_type -> (extra config, rotary layout kvtrim must find, attention implementations the model has)
ARCHS = {
    "llama": ({}, "half", ("sdpa", "eager")),
    "qwen2": ({}, "half", ("sdpa", "eager")),
    "phi": ({"partial_rotary_factor": 0.5}, "half", ("sdpa", "eager")),
    "cohere": ({}, "interleaved", ("sdpa", "eager")),
    "gemma2": ({"sliding_window": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}, "half", ("eager",)),
    # one RoPE per layer type (local theta 1e4, global 1e6): kvtrim re-rotates the full-attention layers' keys
    "gemma3_text": ({"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]}, "half", ("sdpa", "eager")),
}


def tiny(model_type: str, impl: str):
    torch.manual_seed(0)
    extra, _, _ = ARCHS[model_type]
    cfg = AutoConfig.for_model(model_type, **(SMALL | extra))
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.set_attn_implementation(impl)
    return model


CASES = [(a, i) for a, (_, _, impls) in ARCHS.items() for i in impls]


@pytest.mark.parametrize("arch, impl", CASES, ids=[f"{a}-{i}" for a, i in CASES])
def test_full_cache_gives_the_models_own_logits(arch, impl):
    model = tiny(arch, impl)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = DynamicCache(config=model.config)
        ref = [model(ids, past_key_values=plain, use_cache=True).logits[0, -1]]
        nxt = ref[0].argmax().view(1, 1)
        for _ in range(3):
            ref.append(model(nxt, past_key_values=plain, use_cache=True).logits[0, -1])
            nxt = ref[-1].argmax().view(1, 1)
        with kvtrim.compress(model, "full") as cache:
            got = [model(ids, past_key_values=cache, use_cache=True).logits[0, -1]]
            nxt = got[0].argmax().view(1, 1)
            for _ in range(3):
                got.append(model(nxt, past_key_values=cache, use_cache=True).logits[0, -1])
                nxt = got[-1].argmax().view(1, 1)
    assert model.config._attn_implementation == impl  # restored
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)  # float32 defaults: rtol 1.3e-6, atol 1e-5


@pytest.mark.parametrize("arch", list(ARCHS))
def test_rotary_layout_found_and_rerotation_matches_the_models_keys(arch):
    """Keys the model caches at positions p.. equal kvtrim's rotation of its keys at 0.. by p."""
    model = tiny(arch, ARCHS[arch][2][0])
    rotary = find_rotary(model)
    assert rotary is not None and rotary.layout == ARCHS[arch][1]
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    shift = 37

    def keys(start: int) -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True, position_ids=pos)
        return cache.layers[0].keys

    at0, at_shift = keys(0), keys(shift)
    moved = rotary.rotate(at0.double(), torch.full(at0.shape[:-1], shift)).float()
    torch.testing.assert_close(moved, at_shift, rtol=1e-4, atol=1e-5)


def test_streaming_eviction_on_an_interleaved_rope_model_keeps_keys_exact():
    """After a reassigned-position eviction on Cohere (interleaved RoPE) the kept keys sit at
    in-cache positions 0..K-1 exactly as the model itself would have rotated them there."""
    model = tiny("cohere", "sdpa")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), kvtrim.compress(model, "streaming_llm", max_tokens=24) as cache:
        model(ids, past_key_values=cache, use_cache=True)
        layer = cache.compressed_layers[0]
        kept = layer.positions[0, 0]
    assert layer.length == 24
    # the model's own keys for the kept tokens, computed at positions 0..K-1
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        # keys depend only on the token (layer 0's input is the embedding) and its position
        model(ids[:, kept], past_key_values=plain, use_cache=True, position_ids=torch.arange(len(kept)).unsqueeze(0))
    torch.testing.assert_close(layer.keys, plain.layers[0].keys, rtol=1e-4, atol=1e-5)


def test_a_rope_kvtrim_cannot_rerotate_is_refused_by_name():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gptj", vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(KVTrimError, match=r"finds no rotary embedding|cannot be re-rotated exactly"):
        kvtrim.KVTrimCache(model, "streaming_llm", max_tokens=32)


@pytest.mark.parametrize("impl", ["flex_attention", "flash_attention_2"])
def test_flash_and_flex_run_as_sdpa_with_a_warning_and_are_restored(impl, caplog):
    """kvtrim wraps SDPA (or eager) only: a model set to flash/flex attention gets, under ``full``,
    the logits of the same model on SDPA without kvtrim, a warning naming its setting, and its own
    setting back afterwards. flash_attention_2 needs the flash-attn package and a GPU; flex
    attention is constructible on CPU (forward only)."""
    try:
        model = tiny("llama", impl)
    except (ImportError, ValueError) as e:
        pytest.skip(f"{impl} cannot be set on this machine: {e}")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        with caplog.at_level("WARNING", logger="kvtrim.integrations.hf"), kvtrim.compress(model, "full") as cache:
            got = model(ids, past_key_values=cache, use_cache=True).logits[0]
            nxt = got[-1].argmax().view(1, 1)
            got_next = model(nxt, past_key_values=cache, use_cache=True).logits[0, -1]
        assert model.config._attn_implementation == impl  # the model's own setting is restored
        assert any(impl in r.getMessage() and "SDPA" in r.getMessage() for r in caplog.records), caplog.text
        model.set_attn_implementation("sdpa")
        plain = DynamicCache(config=model.config)
        ref = model(ids, past_key_values=plain, use_cache=True).logits[0]
        ref_next = model(nxt, past_key_values=plain, use_cache=True).logits[0, -1]
    torch.testing.assert_close(got, ref)  # float32 defaults: rtol 1.3e-6, atol 1e-5
    torch.testing.assert_close(got_next, ref_next)
