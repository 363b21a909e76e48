"""Chunked prefill (``generate_ids(prefill_chunk=)``, ``--prefill-chunk``): bounded memory, equality, errors.

A compressing method evicts down to its budget after every chunk (each later chunk is a policy
"turn"), so while a chunk is fed the cache holds at most the budget after the previous chunk plus
the chunk, and the policy scores at most that many keys with at most one chunk of queries.
"""

from __future__ import annotations

import pytest
import torch
from conftest import cli_status

from kvtrim import decoding
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.generation import generate_batch, generate_ids
from kvtrim.integrations.hf import attach
from kvtrim.registry import create_policy, get_policy_class, method_names

#: text methods that compress between chunks (every registered method that takes a budget and
#: keeps the prefill forward as it is)
#: (``kvzip`` reconstructs the prompt after one whole prefill and refuses chunks: tests/test_kvzip.py)
CHUNKED = [m for m in method_names()
           if get_policy_class(m).takes_budget and not get_policy_class(m).rewrites_forward
           and not get_policy_class(m).needs_reconstruction]
#: methods that rewrite the prefill forward: refused
REFUSED = [m for m in method_names() if get_policy_class(m).rewrites_forward]


def test_the_matrix_is_not_empty():
    assert {"snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic"} <= set(CHUNKED)
    assert {"fastv", "hae"} <= set(REFUSED)


def _ids(n: int, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


@pytest.mark.parametrize("budget", [dict(keep=0.1), dict(keep=0.3), dict(max_tokens=40)])
@pytest.mark.parametrize("method", CHUNKED)
def test_cache_never_exceeds_budget_plus_one_chunk(model, method, budget):
    """During every chunk's forward each layer stores at most the previous budget + the chunk, the
    policy sees at most one chunk of queries against those keys, and after the chunk it holds its budget."""
    policy = create_policy(method, **budget)
    n, chunk = 230, 37
    ids = _ids(n)
    cache = KVTrimCache(model, policy)
    seen_during: list[tuple[int, int, int, int]] = []  # (stored, budget before the chunk, n_new, key length)
    hook = cache.after_attention

    def spy(layer, query, key, scaling):
        before = layer.seen - layer.n_new
        seen_during.append((layer.length, policy.budget(before) if before else 0, layer.n_new, key.shape[-2]))
        assert query.shape[-2] <= chunk
        hook(layer, query, key, scaling)

    cache.after_attention = spy  # type: ignore[method-assign]

    def after_step(step, seconds):
        for layer in cache.compressed_layers:
            assert layer.length <= policy.budget(layer.seen), (method, layer.layer_idx, layer.length, layer.seen)
            # resident buffers shrink back: no more than the stored tokens plus the slack of a chunk's growth
            assert layer.capacity <= policy.budget(layer.seen) + chunk + layer.slack(policy.budget(layer.seen) + chunk)

    with torch.inference_mode(), attach(model):
        decoding.run(model, decoding.prefill(cache, ids, chunk=chunk), on_step=after_step)
    assert len(seen_during) == model.config.num_hidden_layers * -(-n // chunk)
    for stored, prev_budget, n_new, n_keys in seen_during:
        assert n_new <= chunk
        assert stored <= prev_budget + n_new and n_keys == stored
    assert cache.get_seq_length() == n
    assert max(cache.stored_tokens()) == policy.budget(n)


@pytest.mark.parametrize("method", CHUNKED)
def test_keep_one_chunked_equals_one_forward(model, method):
    ids = _ids(150, seed=5)
    kw = dict(max_new_tokens=6, stop_at_eos=False)
    one = generate_ids(model, None, ids, create_policy(method, keep=1.0), **kw)
    chunked = generate_ids(model, None, ids, create_policy(method, keep=1.0), prefill_chunk=32, **kw)
    assert chunked.token_ids == one.token_ids
    assert chunked.stored_tokens == one.stored_tokens == 150 + 5


def test_keep_one_chunked_logits_match(model):
    """The last prompt logits of a chunked prefill with nothing evicted equal one forward's within rounding."""
    ids = _ids(150, seed=7)
    out = []
    for chunk in (None, 23):
        cache = KVTrimCache(model, create_policy("snapkv", keep=1.0))
        with torch.inference_mode(), attach(model):
            out.append(decoding.run(model, decoding.prefill(cache, ids, chunk=chunk)))
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)


def test_chunked_changes_what_snapkv_keeps(model):
    """Between chunks SnapKV scores with each chunk's own last window, so the kept set differs from
    one forward's (the quality effect docs/memory.md measures); the stored count is the same."""
    ids = _ids(200, seed=11)
    kept = []
    for chunk in (None, 50):
        cache = KVTrimCache(model, create_policy("snapkv", keep=0.25))
        with torch.inference_mode(), attach(model):
            decoding.run(model, decoding.prefill(cache, ids, chunk=chunk))
        kept.append(cache.compressed_layers[-1].positions.clone())
    assert kept[0].shape == kept[1].shape
    assert not torch.equal(kept[0], kept[1])


def test_generate_batch_takes_prefill_chunk(model):
    ids = [_ids(120, seed=1), _ids(90, seed=2)]
    policy = create_policy("snapkv", keep=0.2)
    rows = generate_batch(model, None, ids, policy, max_new_tokens=4, stop_at_eos=False, prefill_chunk=32)
    for p, row in zip(ids, rows):
        alone = generate_ids(model, None, p, policy, max_new_tokens=4, stop_at_eos=False, prefill_chunk=32)
        assert row.token_ids == alone.token_ids and row.stored_tokens == alone.stored_tokens


# --- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [0, 1, -4, 2.5, True, "64"])
def test_bad_chunk_values(model, chunk):
    with pytest.raises(KVTrimError, match="prefill_chunk must be an integer >= 2"):
        generate_ids(model, None, _ids(20), create_policy("snapkv", keep=0.5), prefill_chunk=chunk, max_new_tokens=1)


@pytest.mark.parametrize("method", REFUSED)
def test_methods_that_rewrite_the_forward_are_refused(method):
    policy = create_policy(method, keep=0.5)
    with pytest.raises(KVTrimError, match="needs the whole prompt in one forward"):
        decoding.check_prefill_chunk(policy, 64)
    assert decoding.check_prefill_chunk(policy, None) is None  # the default stays allowed


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prefill-chunk", "0", "--question", "hi"], "--prefill-chunk must be an integer >= 2"),
    (["generate", "--prefill-chunk", "1", "--method", "snapkv", "--question", "hi"], "--prefill-chunk must be an integer >= 2"),
    (["generate", "--prefill-chunk", "512", "--method", "hae", "--keep", "0.5", "--question", "hi"],
     "needs the whole prompt in one forward"),
])
def test_cli_refuses_before_loading(argv, message, capsys):
    assert cli_status(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error: ") and err.count("\n") == 1 and message in err, err


def test_chunked_prefill_trims_the_heap_after_every_module_with_the_same_result(model, monkeypatch):
    """Inside a chunked prefill the heap is trimmed after each module's forward (the activations
    freed by one layer go back to the OS before the next allocates); the hooks are gone afterwards,
    the result is the one without trimming, and a one-forward prefill installs none."""
    import kvtrim.machine as machine

    hooks = [len(m._forward_hooks) for m in model.modules()]  # transformers may keep hooks of its own
    policy = create_policy("h2o", keep=0.2)
    monkeypatch.setattr(machine, "_malloc_trim", lambda: None)  # no malloc_trim: nothing installed
    plain = generate_ids(model, None, _ids(100), policy, max_new_tokens=4, stop_at_eos=False, prefill_chunk=30)
    calls: list[int] = []
    monkeypatch.setattr(machine, "_malloc_trim", lambda: calls.append)
    trimmed = generate_ids(model, None, _ids(100), policy, max_new_tokens=4, stop_at_eos=False, prefill_chunk=30)
    assert trimmed.token_ids == plain.token_ids and trimmed.kv_bytes == plain.kv_bytes
    layers = model.config.num_hidden_layers
    # 4 chunks; per chunk at least every decoder layer, its attention and its MLP; the 3 between-chunk trims
    assert len(calls) >= 4 * 3 * layers + 3 and set(calls) == {0}
    assert [len(m._forward_hooks) for m in model.modules()] == hooks
    n = len(calls)
    generate_ids(model, None, _ids(100), policy, max_new_tokens=4, stop_at_eos=False)  # one forward
    assert len(calls) == n


def test_heap_trimming_hooks_are_removed_on_an_error(model, monkeypatch):
    import kvtrim.machine as machine

    monkeypatch.setattr(machine, "_malloc_trim", lambda: lambda pad: None)
    hooks = [len(m._forward_hooks) for m in model.modules()]
    with pytest.raises(RuntimeError, match="boom"), machine.heap_trimmed_per_module(model):
        assert [len(m._forward_hooks) for m in model.modules()] == [n + 1 for n in hooks]
        raise RuntimeError("boom")
    assert [len(m._forward_hooks) for m in model.modules()] == hooks


def test_heap_trimming_skips_a_model_that_is_not_on_the_cpu(monkeypatch):
    import kvtrim.machine as machine

    monkeypatch.setattr(machine, "_malloc_trim", lambda: lambda pad: None)
    meta = torch.nn.Linear(4, 4, device="meta")  # stands for weights on an accelerator
    with machine.heap_trimmed_per_module(meta):
        assert not meta._forward_hooks
    cpu = torch.nn.Linear(4, 4)
    with machine.heap_trimmed_per_module(cpu):
        assert len(cpu._forward_hooks) == 1


def test_generate_trims_the_heap_after_every_chunk(model, monkeypatch):
    """glibc keeps freed activation blocks in its heap; generate hands them back after each chunk
    (and never for a one-forward prefill, whose timing stays as it was)."""
    import kvtrim.generation as generation

    calls = []
    monkeypatch.setattr(generation, "release_memory", lambda: calls.append(1))
    policy = create_policy("snapkv", keep=0.2)
    generate_ids(model, None, _ids(100), policy, max_new_tokens=2, stop_at_eos=False, prefill_chunk=30)
    assert len(calls) == 4  # 30 + 30 + 30 + 10
    generate_ids(model, None, _ids(100), policy, max_new_tokens=2, stop_at_eos=False)
    assert len(calls) == 4


def test_heap_trimming_yields_the_count_of_its_trims(monkeypatch):
    import kvtrim.machine as machine

    calls: list[int] = []
    monkeypatch.setattr(machine, "_malloc_trim", lambda: calls.append)
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with machine.heap_trimmed_per_module(lin) as count:
        assert count.trims == 0
        lin(torch.ones(1, 4))  # three modules: the Sequential, the Linear, the ReLU
        assert count.trims == len(calls) == 3
    monkeypatch.setattr(machine, "_malloc_trim", lambda: None)
    with machine.heap_trimmed_per_module(lin) as count:  # no malloc_trim: nothing counted
        lin(torch.ones(1, 4))
    assert count.trims == 0
