"""The real embedded model (SmolLM2-135M-Instruct, 30 layers, GQA 3:1): the marked slower tier."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.eval.tasks import passkey
from kvtrim.generation import generate_ids
from kvtrim.models import build_prompt_ids
from kvtrim.registry import create_policy, method_names, spans_error

pytestmark = pytest.mark.model


def test_embedded_model_shape(real):
    cfg = real.model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert real.max_context == 8192


def test_keep_everything_equals_full_on_real_model(real):
    ids = torch.tensor([build_prompt_ids(real.tokenizer, "Name three rivers in Europe and say one thing about each.")])
    with torch.no_grad():
        ref = real.model(input_ids=ids, past_key_values=DynamicCache(config=real.model.config), use_cache=True).logits
    for name in method_names():
        if spans_error(create_policy(name, keep=1.0)):  # fastv acts on image tokens: its keep-all oracle is in test_vlm.py
            with kvtrim.attach(real.model), torch.no_grad(), pytest.raises(KVTrimError, match="would run as 'full'"):
                real.model(input_ids=ids, past_key_values=KVTrimCache(real.model, name, keep=1.0), use_cache=True)
            continue
        with kvtrim.attach(real.model), torch.no_grad():
            got = real.model(input_ids=ids, past_key_values=KVTrimCache(real.model, name, keep=1.0), use_cache=True).logits
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_snapkv_retrieves_passkey_at_keep_02(real):
    """Every ~3k-token sample the full cache answers, snapkv at keep 0.2 answers too.

    The full cache is the reference: the 135M model itself misses some samples (e.g. seed 1 at
    depth 0.25 with this needle), so those cannot judge compression; at least 3 of 5 must count.
    """
    judged = 0
    for seed, depth in enumerate([0.1, 0.3, 0.5, 0.7, 0.9]):
        s = passkey(real.tokenizer, 3000, depth=depth, seed=seed)
        key = s.answers[0]
        ids = build_prompt_ids(real.tokenizer, s.prompt)
        full = generate_ids(real.model, real.tokenizer, ids, create_policy("full"), max_new_tokens=14)
        if key not in full.answer:
            continue
        judged += 1
        res = generate_ids(real.model, real.tokenizer, ids, create_policy("snapkv", keep=0.2), max_new_tokens=14)
        assert key in res.answer, (seed, depth, res.answer)
        assert res.kv_bytes <= 0.2 * res.kv_bytes_full + 0.02 * res.kv_bytes_full
    assert judged >= 3, f"the full cache retrieved only {judged} of 5 samples"
