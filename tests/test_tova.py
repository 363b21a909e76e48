"""``tova``: the newest query's attention, averaged over heads and pooled, ranks the stored tokens at
each prompt and at every decoding step; one token set per layer; it holds its budget while decoding
and streams past the model's context (tiny random GQA Llama, CPU, fp32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import eager_attentions

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.decisions import DropSlots, Keep
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import SINKS
from kvtrim.policies.tova import TOVA
from kvtrim.registry import create_policy
from kvtrim.session import Session


def _pool(s: torch.Tensor, kernel: int) -> torch.Tensor:
    n = s.shape[-1]
    return F.max_pool1d(s.reshape(-1, 1, n), kernel, stride=1, padding=kernel // 2).reshape(s.shape)


def _decode(model, ids, cache, steps):
    with torch.no_grad(), kvtrim.attach(model):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("window, kernel", [(1, 7), (1, 1), (4, 5)])
def test_prefill_keeps_the_top_of_the_newest_rows_averaged_over_all_heads(model, prompt, window, kernel):
    cache = KVTrimCache(model, "tova", keep=0.3, window=window, kernel=kernel)
    _decode(model, prompt, cache, 0)
    t = prompt.shape[1]
    budget = math.floor(0.3 * t)
    for attn, layer in zip(eager_attentions(model, prompt), cache.compressed_layers):
        s = attn[:, :, -window:, :].sum(dim=2).mean(dim=1)  # [B, T]: every query head of the layer
        s = _pool(s, kernel) if kernel > 1 else s
        s[..., -window:] = float("inf")
        s[..., :SINKS] = float("inf")
        expect = torch.topk(s, budget, dim=-1).indices.sort(dim=-1).values  # [B, budget]
        kept = layer.positions.sort(dim=-1).values  # [B, Hkv, budget]
        for h in range(kept.shape[1]):  # one token set per layer: the same in every KV head
            assert torch.equal(kept[:, h], expect)


def test_every_decode_step_drops_the_least_attended_unprotected_token(model, prompt, monkeypatch):
    """At a step with a full budget the dropped slot is the minimum of the step's own attention row
    (computed here from the hook's query and keys), head-averaged and pooled, sinks and newest token spared."""
    seen = []
    orig = TOVA.on_decode

    def spy(self, layer, query, key, scaling):
        d = orig(self, layer, query, key, scaling)
        seen.append((query.clone(), key.clone(), layer.positions.clone(), layer.seen, scaling, d))
        return d

    monkeypatch.setattr(TOVA, "on_decode", spy)
    cache = KVTrimCache(model, "tova", max_tokens=40)
    _decode(model, prompt, cache, 5)
    assert all(layer.positions.shape[-1] == 40 for layer in cache.compressed_layers)
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    checked = 0
    for q, k, pos, n_seen, scaling, d in seen:
        assert d is not None  # 41 stored after the step's append: one must go
        kk = k.repeat_interleave(g, dim=1)  # [B, Hq, S, D]
        p = torch.softmax((q.double() @ kk.double().transpose(-1, -2)) * scaling, dim=-1)[:, :, 0]  # [B, Hq, S]
        s = _pool(p.mean(dim=1, keepdim=True), 7)[:, 0]  # [B, S]
        protected = (pos[:, 0] < SINKS) | (pos[:, 0] >= n_seen - 1)
        s = s.masked_fill(protected, float("inf"))
        if isinstance(d, DropSlots):
            dropped_set = set(d.slots[0, 0].tolist())
        else:  # a Keep: the complement of the kept slots
            assert isinstance(d, Keep)
            dropped_set = set(range(k.shape[-2])) - set(d.idx[0, 0].tolist())
        assert len(dropped_set) == 1
        # max pooling makes plateaus: the dropped slot holds the minimum (ties may pick another slot)
        (slot,) = dropped_set
        assert float(s[0, slot]) <= float(s[0].min()) * (1 + 1e-6)
        checked += 1
    assert checked == 5 * model.config.num_hidden_layers


def test_it_holds_its_budget_and_streams_past_the_context(model):
    """Reassigned positions and a fixed budget: a chat five times the model's context stays within the
    budget plus the reply being decoded, and its resident KV stops growing."""
    policy = create_policy("tova", max_tokens=48, position="reassigned")
    assert policy.can_stream()
    s = Session(model, None, policy)
    stored, kv = [], []
    for t in range(40):
        s.send_ids(torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(300 + t)).tolist(),
                   max_new_tokens=12, stop_ids=())
        stored.append(s.stored())
        kv.append(s.cache.kv_bytes())
    assert s.seen > 4 * s.max_context
    assert max(stored) <= 48 and stored[-1] == 48  # evicted at every step: never above the budget
    assert max(kv[5:]) <= kv[5]


@pytest.mark.parametrize("kw, message", [
    ({"kernel": 4}, "tova: kernel"),
    ({"window": 0}, "tova: window"),
    ({"pooling": "median"}, "tova: pooling"),
])
def test_bad_parameters(kw, message):
    with pytest.raises(KVTrimError, match=message):
        create_policy("tova", keep=0.5, **kw)
