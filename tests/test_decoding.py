"""The decoding stepper (kvtrim.decoding): programs, the chunk rule, sampling, the context check."""

from __future__ import annotations

import re

import pytest
import torch

import kvtrim
from kvtrim import decoding
from kvtrim.errors import KVTrimError
from kvtrim.registry import create_policy


class _Fake:
    """Serves a program's steps with scripted logits, recording what it was fed."""

    def __init__(self, vocab: int = 10):
        self.fed: list[list[int]] = []
        self.vocab = vocab

    def serve(self, step: decoding.Step) -> torch.Tensor:
        self.fed.append(list(step.ids))
        nxt = (step.ids[-1] + 1) % self.vocab  # the "model" predicts the next integer
        return torch.nn.functional.one_hot(torch.tensor(nxt), self.vocab).float()


def _run(program, fake):
    return decoding.run(None, program, serve=fake.serve)


def test_decode_feeds_every_chosen_token_but_the_last_and_stops_at_a_stop_id():
    fake = _Fake()
    first = torch.nn.functional.one_hot(torch.tensor(3), 10).float()
    out, steps = _run(decoding.decode(None, first, 10, stop_ids=(6,)), fake)
    assert out == [3, 4, 5, 6] and steps == 3 and fake.fed == [[3], [4], [5]]
    fake2 = _Fake()
    out, steps = _run(decoding.decode(None, first, 2), fake2)
    assert out == [3, 4] and steps == 1 and fake2.fed == [[3]]
    out, _ = _run(decoding.decode(None, first, 10, finished=lambda ids: len(ids) == 2), _Fake())
    assert out == [3, 4]


def test_prefill_feeds_chunks_in_order_and_returns_the_last_logits():
    fake = _Fake()
    logits = _run(decoding.prefill(None, list(range(7)), chunk=3), fake)
    assert fake.fed == [[0, 1, 2], [3, 4, 5], [6]] and int(logits.argmax()) == 7
    with pytest.raises(KVTrimError, match="empty"):
        _run(decoding.prefill(None, []), _Fake())


def test_sampler_greedy_is_argmax_and_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert decoding.Sampler().choose(logits) == 1
    g = torch.Generator().manual_seed(0)
    picks = {decoding.Sampler(True, 1.0, 0.5).choose(logits, g) for _ in range(50)}
    assert picks == {1}  # token 1 alone holds more than half of the mass
    picks = {decoding.Sampler(True, 1.0, 1.0).choose(logits, g) for _ in range(200)}
    assert {1, 2} <= picks


def test_sampler_top_k_keeps_only_the_k_likeliest_tokens():
    logits = torch.tensor([1.0, 1.2, 0.9, 1.1, -2.0])  # flat enough that every token would be drawn without a filter
    g = torch.Generator().manual_seed(0)
    assert {decoding.Sampler(True, top_k=1).choose(logits, g) for _ in range(50)} == {1}
    assert {decoding.Sampler(True, top_k=2).choose(logits, g) for _ in range(300)} == {1, 3}
    assert {decoding.Sampler(True, top_k=0).choose(logits, g) for _ in range(300)} == {0, 1, 2, 3, 4}
    # top-k first, then top-p of what is left (renormalised): of tokens 1 and 3, token 1 alone passes 0.5
    assert {decoding.Sampler(True, top_p=0.5, top_k=2).choose(logits, g) for _ in range(100)} == {1}
    assert decoding.Sampler(True, top_k=10).choose(logits, g) in range(5)  # k above the vocabulary: all


@pytest.mark.parametrize("kw, message", [
    ({"top_k": -1}, "top_k must be a non-negative integer"),
    ({"top_k": 2.5}, "top_k must be a non-negative integer"),
    ({"top_p": 0.0}, "top_p must be a fraction in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be a fraction in (0, 1]"),
    ({"temperature": 0.0}, "temperature must be a finite number > 0"),
    ({"temperature": float("nan")}, "temperature must be a finite number > 0"),
    ({"temperature": 10**400}, "temperature must be a finite number > 0"),  # beyond a float
    ({"top_p": 10**400}, "top_p must be a fraction in (0, 1]"),
])
def test_sampler_refuses_bad_settings_greedy_or_not(kw, message):
    for do_sample in (True, False):
        with pytest.raises(KVTrimError, match=re.escape(message)):
            decoding.Sampler(do_sample, **kw)


def test_sampler_takes_an_int_temperature_beyond_int64():
    # found by tests/test_fuzz_api.py (10,000-example profile): 2**64 is a valid temperature but
    # dividing a tensor by it raised OverflowError; the sampler holds it as a float
    s = decoding.Sampler(True, temperature=2**64)
    assert isinstance(s.temperature, float) and s.temperature == float(2**64)
    logits = torch.tensor([0.0, 5.0, 1.0])
    assert s.choose(logits, torch.Generator().manual_seed(0)) in range(3)


def test_chunk_rule_feeds_a_fitting_prompt_whole_and_never_degrades_to_tiny_chunks():
    stream = create_policy("streaming_llm", max_tokens=512, position="reassigned")
    assert stream.can_stream()
    # a 642-token prompt with 7700 tokens to generate: a streaming method evicts while it decodes
    assert decoding.chunk_size(stream, held=0, seen=0, n=642, extra=7700, max_ctx=8192) is None
    # a prompt past the context is fed in pieces that fit next to the budget
    assert decoding.chunk_size(stream, held=0, seen=0, n=9000, extra=8, max_ctx=8192) == 1024
    big = create_policy("streaming_llm", max_tokens=8100, position="reassigned")
    with pytest.raises(KVTrimError, match="Use a smaller budget"):
        decoding.chunk_size(big, held=0, seen=0, n=9000, extra=8, max_ctx=8192)
    full = create_policy("full")
    assert decoding.chunk_size(full, held=0, seen=0, n=100, extra=10, max_ctx=8192) is None


def test_streaming_generation_with_many_new_tokens_prefills_in_one_forward(model):
    """The performance cliff of the old rule: room reserved for new tokens a streaming method does not need."""
    ids = torch.randint(3, 128, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        res = kvtrim.generate_ids(model, None, ids, create_policy("streaming_llm", max_tokens=64, position="reassigned"),
                                  max_new_tokens=300, stop_at_eos=False)
    finally:
        hook.remove()
    assert calls[0] == 200 and all(c == 1 for c in calls[1:])
    assert res.new_tokens == 300 and res.stored_tokens <= 64 + 1


def test_context_check_refuses_a_non_streaming_method_past_the_context():
    with pytest.raises(KVTrimError, match="more than the model's context of 100"):
        decoding.check_context(create_policy("snapkv", keep=0.5), 150, 100)
    decoding.check_context(create_policy("streaming_llm", max_tokens=64, position="reassigned"), 150, 100)


@pytest.mark.parametrize("bad, message", [([1, 2, 10**7], "token id 10000000 at index 2 is outside"),
                                          ([1, -1], "token id -1 at index 1"), ([1, "a"], "not an integer token id")])
def test_generate_ids_refuses_ids_outside_the_vocabulary(model, bad, message):
    with pytest.raises(KVTrimError, match=message):
        kvtrim.generate_ids(model, None, bad, create_policy("full"), max_new_tokens=2)
