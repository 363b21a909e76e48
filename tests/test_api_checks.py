"""The Python API refuses misuse with one KVTrimError: a cache that served a sequence refuses a new
prompt (and says to make a new cache or call ``reset()``); ``KVTrimCache`` refuses a module that is
not a causal LM; the samplers refuse top_p outside (0, 1], a temperature that is not a finite
number > 0 (greedy or not, as the command line's --temperature), and a seed a generator cannot take."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_llama

import kvtrim
from kvtrim.decoding import Sampler
from kvtrim.errors import KVTrimError

METHODS = [("full", {}), ("h2o", {"keep": 0.5}), ("snapkv", {"keep": 0.5}),
           ("streaming_llm", {"max_tokens": 16, "position": "reassigned"})]


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(vocab_size=128, max_position_embeddings=512)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _gen(model, ids, cache, n=5):
    return model.generate(ids, **cache.kwargs(), max_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("method, kw", METHODS, ids=[m for m, _ in METHODS])
def test_a_used_cache_refuses_a_new_prompt_and_reset_starts_over(lm, method, kw):
    first, second = _ids(40, 1), _ids(30, 2)
    with kvtrim.compress(lm, method, **kw) as cache:
        out = _gen(lm, first, cache)
        seen = cache.get_seq_length()
        for other in (second, first, _ids(seen, 3)):  # shorter, the same again, exactly as long
            with pytest.raises(KVTrimError, match=r"does not continue it .*make a new cache .*or call cache.reset\(\)"):
                _gen(lm, other, cache)
            assert cache.get_seq_length() == seen  # refused before any layer changed
        cont = _gen(lm, torch.cat([out, second], 1), cache, 3)  # the whole sequence and a new turn: a continuation
        assert cont.shape[1] == out.shape[1] + second.shape[1] + 3
        cache.reset()
        again = _gen(lm, second, cache)
    with kvtrim.compress(lm, method, **kw) as fresh:
        assert torch.equal(again, _gen(lm, second, fresh))


def test_a_hand_loop_restarting_at_position_zero_is_refused(lm):
    with kvtrim.compress(lm, "snapkv", keep=0.5) as cache:
        lm(_ids(20, 4), **cache.kwargs(), use_cache=True)
        lm(_ids(1, 5), **cache.kwargs(), use_cache=True)  # a decode step continues
        with pytest.raises(KVTrimError, match="holds a sequence of 21 tokens"):
            lm(_ids(8, 6), position_ids=torch.arange(8)[None], **cache.kwargs(), use_cache=True)
        lm(_ids(8, 6), **cache.kwargs(), use_cache=True)  # positions from the cache: a continuation
        assert cache.get_seq_length() == 29


@pytest.mark.parametrize("thing", [torch.nn.Linear(4, 4), object(), "snapkv"])
def test_a_cache_on_something_that_is_not_a_causal_lm_is_one_line(thing):
    with pytest.raises(KVTrimError, match="needs a transformers causal language model"):
        kvtrim.KVTrimCache(thing, "snapkv", keep=0.5)


def test_a_cache_on_an_encoder_is_refused():
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=37))
    with pytest.raises(KVTrimError, match=r"needs a decoder-only causal language model; BertForMaskedLM \(model_type 'bert'\)"):
        kvtrim.KVTrimCache(bert, "full")


@pytest.mark.parametrize("kw, message", [
    ({"top_p": 1.5}, r"top_p must be a fraction in \(0, 1\], got 1.5"),
    ({"top_p": 0}, r"top_p must be a fraction in \(0, 1\]"),
    ({"top_p": math.nan}, "top_p must be"),
    ({"top_p": "0.9"}, "top_p must be"),
    ({"do_sample": True, "temperature": math.nan}, r"temperature must be a finite number > 0, got nan"),
    ({"do_sample": True, "temperature": 0.0}, "temperature must be a finite number > 0"),
    ({"do_sample": True, "temperature": -1}, "temperature must be a finite number > 0"),
    ({"do_sample": True, "temperature": math.inf}, "temperature must be a finite number > 0"),
    ({"do_sample": "yes"}, "do_sample must be True or False"),
])
def test_samplers_check_their_arguments(lm, kw, message):
    with pytest.raises(KVTrimError, match=message):
        Sampler(**kw)
    policy = kvtrim.create_policy("full")
    with pytest.raises(KVTrimError, match=message):
        kvtrim.generate_ids(lm, None, [5, 6, 7], policy, max_new_tokens=2, **kw)
    with pytest.raises(KVTrimError, match=message):
        kvtrim.generate_batch(lm, None, [[5, 6, 7]], policy, max_new_tokens=2, **kw)


def test_greedy_decoding_refuses_a_bad_temperature_too(lm):
    """A sampler's values are checked greedy or not (as the command line checks --temperature without
    --sample), so a bad one is refused where it is given rather than ignored."""
    with pytest.raises(KVTrimError, match="temperature must be a finite number > 0, got nan"):
        kvtrim.generate_ids(lm, None, [5, 6, 7], kvtrim.create_policy("full"), max_new_tokens=2, temperature=math.nan)
    r = kvtrim.generate_ids(lm, None, [5, 6, 7], kvtrim.create_policy("full"), max_new_tokens=2, temperature=0.5)
    assert r.new_tokens == 2


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.5, True])
def test_a_seed_a_generator_cannot_take_is_one_line(lm, seed):
    from kvtrim.session import Session

    with pytest.raises(KVTrimError, match="seed must be an integer in"):
        kvtrim.generate_ids(lm, None, [5, 6, 7], kvtrim.create_policy("full"), max_new_tokens=2, seed=seed)
    with pytest.raises(KVTrimError, match="seed must be an integer in"):
        Session(lm, None, "inf_mllm", seed=seed)


def test_token_ids_and_counts_of_every_entry_point_are_checked(lm):
    """Found by tests/test_fuzz_api.py: each used to end in a torch or Python traceback."""
    from kvtrim.session import Session

    policy = kvtrim.create_policy("full")
    with pytest.raises(KVTrimError, match=r"max_new_tokens must be a non-negative integer, got 0\.0"):
        kvtrim.generate_batch(lm, None, [[5, 6, 7]], policy, max_new_tokens=0.0)
    with pytest.raises(KVTrimError, match="max_new_tokens must be a non-negative integer"):
        kvtrim.generate_ids(lm, None, [5, 6, 7], policy, max_new_tokens="3")
    s = Session(lm, None, "inf_mllm", max_tokens=48)
    with pytest.raises(KVTrimError, match="the turn: token 0 is None"):
        s.send_ids([None], max_new_tokens=1)
    with pytest.raises(KVTrimError, match=r"the stream: token 0 is 2\.5"):
        s.feed_ids([2.5], chunk=1)
    with pytest.raises(KVTrimError, match="outside the model's vocabulary"):
        s.send_ids([128], max_new_tokens=1)
    assert s.seen == 0


@pytest.mark.parametrize("method", ["fastv", "hae"])
def test_a_session_of_a_method_that_needs_image_spans_refuses_every_text_turn(lm, method):
    """Found by tests/test_fuzz_api.py: after FastV refused a text turn midway, the next turn failed in SDPA."""
    from kvtrim.session import Session

    s = Session(lm, None, method)
    for turn in ([3], [3, 3], [5, 6, 7]):
        with pytest.raises(KVTrimError, match=f"method '{method}' prunes|left incomplete"):
            s.send_ids(turn, max_new_tokens=1)


def test_a_cache_left_half_updated_by_a_refused_forward_refuses_to_go_on(lm):
    """Found by tests/test_fuzz_api.py: a refusal raised inside a forward (Elastic Cache's prompt too
    short for its sinks) left the first layer a token ahead, and the next forward failed in SDPA."""
    from kvtrim.session import Session

    s = Session(lm, None, "elastic")
    with pytest.raises(KVTrimError, match="fewer than the 5 it always keeps"):
        s.send_ids([3], max_new_tokens=1)
    with pytest.raises(KVTrimError, match="left incomplete by a forward that failed midway"):
        s.feed_ids([3, 3, 3, 3], chunk=4)
    s.cache.reset()
    s.feed_ids([3, 4, 5, 6, 7, 8], chunk=6)  # reset: a whole cache again
    assert s.seen == 6
