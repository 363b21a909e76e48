"""Modality spans: validation, detection from token ids, explicit spans on a text model's cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.spans import Span, SpanSet, find_spans


def test_overlapping_spans_are_refused():
    with pytest.raises(KVTrimError, match=r"spans overlap: \[0, 10\) \(text\) and \[5, 20\) \(image\)"):
        SpanSet([Span(0, 10, "text"), Span(5, 20, "image")], 30)


def test_span_outside_the_prompt_is_refused():
    with pytest.raises(KVTrimError, match=r"lies outside the prompt of 30 tokens"):
        SpanSet([(20, 31, "image")], 30)
    with pytest.raises(KVTrimError, match="empty or negative"):
        Span(-1, 4, "text")
    with pytest.raises(KVTrimError, match="empty or negative"):
        Span(4, 4, "text")


def test_unknown_modality_is_refused():
    with pytest.raises(KVTrimError, match=r"unknown modality 'audio'.*allowed: system, text, image, video, document"):
        Span(0, 4, "audio")
    with pytest.raises(KVTrimError, match="unknown modality 'pixels'"):
        SpanSet([], 5).mask(torch.arange(5), ["pixels"])


def test_spans_from_token_ids_and_mask():
    cfg = SimpleNamespace(image_token_id=7, video_token_id=8)
    ids = torch.tensor([[1, 2, 7, 7, 7, 3, 8, 8, 4, 7, 5]])
    s = find_spans(cfg, ids)
    assert [(x.start, x.end, x.modality) for x in s] == [
        (0, 2, "text"), (2, 5, "image"), (5, 6, "text"), (6, 8, "video"), (8, 9, "text"), (9, 10, "image"), (10, 11, "text"),
    ]
    pos = torch.arange(14)  # 11 prompt tokens + 3 generated
    assert s.mask(pos, ["image", "video"]).nonzero().flatten().tolist() == [2, 3, 4, 6, 7, 9]
    assert s.mask(pos, ["text"]).nonzero().flatten().tolist() == [0, 1, 5, 8, 10, 11, 12, 13]


def test_text_model_has_one_text_span(model):
    s = find_spans(model, torch.arange(3, 40))
    assert [(x.start, x.end, x.modality) for x in s] == [(0, 37, "text")]


def test_explicit_spans_on_a_text_model_cache(model, prompt):
    cache = KVTrimCache(model, "full", spans=[(10, 60, "document")])
    with kvtrim.attach(model), torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    assert isinstance(cache.spans, SpanSet) and cache.spans.n_tokens == prompt.shape[1]
    assert [(x.start, x.end) for x in cache.spans.of("document")] == [(10, 60)]


def test_explicit_spans_longer_than_the_prompt_fail_at_prefill(model, prompt):
    cache = KVTrimCache(model, "full", spans=[(10, 200, "document")])
    with kvtrim.attach(model), torch.no_grad(), pytest.raises(KVTrimError, match="outside the prompt of 97 tokens"):
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
