"""``kvzip``: reconstruction scores (the attention the model gives the prompt while repeating it)
against an independent oracle (transformers' eager attention over prompt + instruction + chunk),
the kept tokens, memory freed, the budget-independent memo, and the refusals where kvtrim does not
drive the forwards (tiny random GQA Llama, CPU, fp32)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import eager_attentions

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.eval.replay import record_prefill, replay
from kvtrim.policies.base import SINKS
from kvtrim.reconstruction import prepare, reconstruction_scores, recorded_kv
from kvtrim.registry import create_policy

INSTR = [5, 6, 7, 8, 9]


class _CharTokenizer:
    """Characters to the tiny model's ids; no chat template (kvtrim's plain format)."""

    eos_token_id = None
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + ord(c) % 120 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def _oracle(model, ids: list[int], chunk: int) -> list[torch.Tensor]:
    """Per layer ``[Hkv, n]``: for each chunk, eager attention over prompt + INSTR + chunk; the
    largest probability any row after the prompt gives each prompt column, max over the query heads
    of each KV head and over the chunks."""
    n, hkv = len(ids), model.config.num_key_value_heads
    out = None
    for s in range(0, n, chunk):
        x = torch.tensor([ids + INSTR + ids[s:s + chunk]])
        att = eager_attentions(model, x)  # per layer [1, Hq, T, T]
        per = []
        for a in att:
            m = a[0, :, n:, :n].amax(dim=1)  # [Hq, n]
            per.append(m.view(hkv, -1, n).amax(dim=1))  # [Hkv, n]
        out = per if out is None else [torch.maximum(o, p) for o, p in zip(out, per)]
    assert out is not None
    return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recomputed"])
@pytest.mark.parametrize("chunk", [97, 40])
def test_scores_equal_eager_attention_over_the_reconstruction(model, prompt, chunk, fused, monkeypatch):
    """Both ways of scoring: the column maxima computed by the attention itself (the native kernel,
    checked to run once per layer and chunk) and the probe's own computation where no fused kernel is."""
    import kvtrim.integrations.hf as hf

    calls = []
    if fused:
        if hf.fused_backend(torch.zeros(1)) is None:
            pytest.skip("kvtrim's native CPU kernel is not available")
        real = hf.causal_attention_scores
        monkeypatch.setattr(hf, "causal_attention_scores", lambda *a, **k: calls.append(k) or real(*a, **k))
    else:
        monkeypatch.setattr(hf, "fused_backend", lambda q: None)
    ids = prompt[0].tolist()
    rec = record_prefill(model, ids)
    got = reconstruction_scores(model, recorded_kv(rec), ids, INSTR, chunk=chunk)
    want = _oracle(model, ids, chunk)
    n_chunks = -(-len(ids) // chunk)
    assert len(calls) == (model.config.num_hidden_layers * n_chunks if fused else 0)
    assert all(k["column_max"] and not k["column_sums"] for k in calls)
    assert sorted(got) == list(range(len(want)))
    for i, w in enumerate(want):
        torch.testing.assert_close(got[i][0].double(), w, atol=1e-5, rtol=1e-4)


def test_uniform_scope_keeps_each_kv_heads_top_scores_and_the_sinks(model, prompt):
    ids = prompt[0].tolist()
    rec = record_prefill(model, ids)
    policy = create_policy("kvzip", keep=0.3, chunk=48, scope="uniform")
    prepare(policy, model, recorded_kv(rec), ids, INSTR)
    cache = replay(model, policy, rec)
    budget = math.floor(0.3 * len(ids))
    want = _oracle(model, ids, 48)
    for layer, w in zip(cache.compressed_layers, want):
        s = w.clone()
        s[:, :SINKS] = float("inf")
        s[:, -1] = float("inf")  # the window: the newest prompt token
        expect = torch.topk(s, budget, dim=-1).indices.sort(dim=-1).values  # [Hkv, budget]
        assert torch.equal(layer.positions[0].sort(dim=-1).values, expect)
        assert layer.keys.shape[-2] == budget  # freed, not masked
    full = replay(model, create_policy("full"), rec)
    assert cache.kv_bytes_stored() < 0.35 * full.kv_bytes_stored()


def test_global_scope_keeps_the_top_scores_over_every_layer_and_head(model, prompt):
    """One threshold over all (layer, KV head, token) scores: the kept sets are exactly the global
    top ``L * H * budget`` (sinks forced in), the heads hold different numbers, the total is the
    uniform budget's, and the bytes stored are those of the kept tokens only."""
    ids = prompt[0].tolist()
    rec = record_prefill(model, ids)
    policy = create_policy("kvzip", keep=0.3, chunk=48)
    assert policy.scope == "global" and not policy.uniform_heads
    prepare(policy, model, recorded_kv(rec), ids, INSTR)
    cache = replay(model, policy, rec)
    budget = math.floor(0.3 * len(ids))
    want = torch.stack(_oracle(model, ids, 48))  # [L, H, S]
    want[..., :SINKS] = float("inf")
    want[..., -1] = float("inf")  # the window: the newest prompt token
    n_total = want.shape[0] * want.shape[1] * budget
    thr = torch.topk(want.flatten(), n_total).values[-1]
    lengths = []
    for layer, w in zip(cache.compressed_layers, want):
        for h in range(w.shape[0]):
            kept = layer.head_tensors(h)[2].flatten().sort().values
            assert torch.equal(kept, (w[h] >= thr).nonzero()[:, 0])  # no ties among random-model scores
            lengths.append(kept.numel())
    assert sum(lengths) == n_total and len(set(lengths)) > 1 and min(lengths) >= SINKS + 1
    full = replay(model, create_policy("full"), rec)
    per_token = full.kv_bytes_stored() // (len(lengths) * len(ids))
    assert cache.kv_bytes_stored() == n_total * per_token


def test_generate_ids_runs_it_and_saves_nothing_where_nothing_is_evicted(model, prompt):
    ids = prompt[0].tolist()
    calls = []
    orig = kvtrim.reconstruction.reconstruction_scores

    def spy(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    kvtrim.reconstruction.reconstruction_scores = spy
    try:
        full = kvtrim.generate_ids(model, _CharTokenizer(), ids, create_policy("full"), max_new_tokens=6, stop_at_eos=False)
        whole = kvtrim.generate_ids(model, _CharTokenizer(), ids, create_policy("kvzip", keep=1.0), max_new_tokens=6,
                                    stop_at_eos=False)
        assert not calls  # keep 1: no reconstruction, the full cache's answer
        assert whole.token_ids == full.token_ids and not whole.compressed
        some = kvtrim.generate_ids(model, _CharTokenizer(), ids, create_policy("kvzip", keep=0.3), max_new_tokens=6,
                                   stop_at_eos=False)
        assert calls == [1]
        assert some.compressed and some.kv_bytes_stored < 0.5 * full.kv_bytes_stored
    finally:
        kvtrim.reconstruction.reconstruction_scores = orig


def test_one_reconstruction_per_prompt_for_several_budgets(model, prompt):
    ids = prompt[0].tolist()
    rec = record_prefill(model, ids)
    memo: dict = {}
    a = prepare(create_policy("kvzip", keep=0.2), model, recorded_kv(rec), ids, INSTR, memo=memo)
    b = prepare(create_policy("kvzip", keep=0.5), model, recorded_kv(rec), ids, INSTR, memo=memo)
    assert a.reconstruction is b.reconstruction and len(memo) == 1


def test_refused_where_kvtrim_does_not_drive_the_forwards(model, prompt):
    cache = KVTrimCache(model, "kvzip", keep=0.3)
    with kvtrim.attach(model), torch.no_grad(), pytest.raises(KVTrimError, match="reconstructs it"):
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    from kvtrim.integrations.vllm.config import parse

    with pytest.raises(KVTrimError, match="'kvzip' scores the prompt by a second forward"):
        parse({"kvtrim": {"method": "kvzip", "keep": 0.3}})


def test_model_generate_and_streamed_sessions_refuse_it_before_any_work(model):
    from kvtrim.session import Session

    with pytest.raises(KVTrimError, match="needs the tokenizer"):
        Session(model, None, "kvzip", keep=0.3)
    with pytest.raises(KVTrimError, match=r"model\.generate does not run"), kvtrim.compress(model, "kvzip", keep=0.3):
        pass
    s = Session(model, _CharTokenizer(), "kvzip", keep=0.3)
    with pytest.raises(KVTrimError, match="stream fed in chunks"):
        s.feed_ids(list(range(3, 60)))
    assert s.seen == 0  # nothing was fed


def test_a_session_compresses_its_first_message_once_and_keeps_the_later_turns(model, prompt):
    """A chat about one document: the first message is reconstructed and evicted as generate_ids
    does (the same first reply and bytes), later turns are appended and not evicted."""
    from kvtrim.session import Session

    ids = prompt[0].tolist()
    tok = _CharTokenizer()
    one = kvtrim.generate_ids(model, tok, ids, create_policy("kvzip", keep=0.3), max_new_tokens=6, stop_at_eos=False)
    s = Session(model, tok, "kvzip", keep=0.3, chat=False)
    first = s.send_ids(ids, max_new_tokens=6, stop_ids=())
    assert first == one.token_ids
    after_first = s.cache.kv_bytes_stored()
    assert after_first == one.kv_bytes_stored
    s.send_ids([5, 6, 7, 8], max_new_tokens=3, stop_ids=())
    full = Session(model, tok, "full", chat=False)
    full.send_ids(ids, max_new_tokens=6, stop_ids=())
    before = full.cache.kv_bytes_stored()
    full.send_ids([5, 6, 7, 8], max_new_tokens=3, stop_ids=())
    # the second turn added what it adds to a full cache: nothing evicted
    assert s.cache.kv_bytes_stored() - after_first == full.cache.kv_bytes_stored() - before > 0
    assert s.seen == full.seen


def test_generate_refuses_a_chunked_prefill_and_a_given_cache(model, prompt):
    ids = prompt[0].tolist()
    with pytest.raises(KVTrimError, match="chunked prefill"):
        kvtrim.generate_ids(model, _CharTokenizer(), ids, create_policy("kvzip", keep=0.3), prefill_chunk=32)
    with pytest.raises(KVTrimError, match="do not pass a cache"):
        kvtrim.generate_ids(model, _CharTokenizer(), ids, create_policy("kvzip", keep=0.3),
                            cache=KVTrimCache(model, "kvzip", keep=0.3))
    with pytest.raises(KVTrimError, match="needs the tokenizer"):
        kvtrim.generate_ids(model, None, ids, create_policy("kvzip", keep=0.3))


@pytest.mark.parametrize("scope", ["global", "uniform"])
def test_replayed_in_eval_equals_generate_ids(model, prompt, scope):
    """kvtrim eval's path (one recorded prefill, the reconstruction, the replayed cache) gives the
    tokens and bytes of ``generate_ids``; a second budget reuses the memo's scores."""
    from kvtrim.decoding import decode
    from kvtrim.eval.replay import make_policy
    from kvtrim.integrations.batched import drive
    from kvtrim.reconstruction import repeat_ids

    ids = prompt[0].tolist()
    tok = _CharTokenizer()
    plain = kvtrim.generate_ids(model, tok, ids, create_policy("kvzip", keep=0.3, scope=scope), max_new_tokens=10,
                                stop_at_eos=False)
    rec = record_prefill(model, ids)
    memo: dict = {}
    for keep, want in ((0.3, plain), (0.6, None)):
        policy = prepare(make_policy("kvzip", {"keep": keep, "scope": scope}, memo), model, recorded_kv(rec), ids,
                         repeat_ids(tok), memo=memo)
        cache = replay(model, policy, rec)
        with kvtrim.attach(model):
            out, steps = drive(model, {0: decode(cache, rec.logits, 10)}, batch=False)[0]
        if want is not None:
            assert out == want.token_ids and steps == want.decode_steps
            assert cache.kv_bytes_stored() == want.kv_bytes_stored
    assert len(memo) == 1


def test_cli_eval_runs_it_on_a_tiny_model(tiny_dir, tmp_path):
    from conftest import cli_status

    from kvtrim.eval.store import read_lines, result_files

    out = tmp_path / "e"
    # labelfree replays each configuration twice (its answer, then the full cache's answer's perplexity)
    argv = ["eval", "passkey,labelfree", "--model", tiny_dir, "--length", "256", "--samples", "1", "--methods", "kvzip",
            "--keep", "0.25,0.5", "--haystack", "pydoc", "--quiet", "--out", str(out)]
    assert cli_status(argv) == 0
    every = read_lines(result_files(out))
    for task in ("passkey", "labelfree"):
        lines = [r for r in every if r["method"] == "kvzip" and r["task"] == task]
        assert sorted(r["keep"] for r in lines) == [0.25, 0.5]
        full = next(r for r in every if r["method"] == "full" and r["task"] == task)
        for r in lines:
            assert r["kv_bytes"] < full["kv_bytes"]
    assert all(r.get("ref_nll_sum") is not None for r in every if r["task"] == "labelfree" and r["method"] == "kvzip")
    # the reconstruction runs once per prompt for both budgets, and each budget's line counts it in its prefill
    for task in ("passkey", "labelfree"):
        lines = [r for r in every if r["method"] == "kvzip" and r["task"] == task]
        assert len({r["reconstruct_seconds"] for r in lines}) == 1 and lines[0]["reconstruct_seconds"] > 0
        assert all(r["compress_seconds"] >= r["reconstruct_seconds"] for r in lines)
        assert all(abs(r["prefill_seconds"] - r["record_seconds"] - r["compress_seconds"]) < 1e-9 for r in lines)
    assert not any("reconstruct_seconds" in r for r in every if r["method"] != "kvzip")


def test_bfloat16_scores_in_float32_and_stores_the_models_dtype(prompt):
    from conftest import tiny_llama

    model = tiny_llama().to(torch.bfloat16)
    ids = prompt[0].tolist()
    rec = record_prefill(model, ids)
    scores = reconstruction_scores(model, recorded_kv(rec), ids, INSTR, chunk=50)
    assert {s.dtype for s in scores.values()} == {torch.float32}
    res = kvtrim.generate_ids(model, _CharTokenizer(), ids, create_policy("kvzip", keep=0.3), max_new_tokens=4,
                              stop_at_eos=False)
    f32 = kvtrim.generate_ids(tiny_llama(), _CharTokenizer(), ids, create_policy("kvzip", keep=0.3), max_new_tokens=4,
                              stop_at_eos=False)
    assert res.compressed and res.kv_bytes_stored * 2 == f32.kv_bytes_stored  # the same count, half the bytes


def test_low_bit_cache_with_the_uniform_scope_and_a_clear_refusal_with_the_global_one(model, prompt):
    ids = prompt[0].tolist()
    tok = _CharTokenizer()
    # 90 kept + 40 decoded: past the low-bit storage's residual group, so most tokens are quantized
    full16 = kvtrim.generate_ids(model, tok, ids, create_policy("kvzip", scope="uniform", keep=0.93), max_new_tokens=40,
                                 stop_at_eos=False)
    low = kvtrim.generate_ids(model, tok, ids, create_policy("kvzip", scope="uniform", keep=0.93), max_new_tokens=40,
                              stop_at_eos=False, kv_bits=4)
    assert low.stored_tokens == full16.stored_tokens and low.kv_bytes < full16.kv_bytes
    with pytest.raises(KVTrimError, match="scope='uniform'"):
        kvtrim.generate_ids(model, tok, ids, create_policy("kvzip", keep=0.3), max_new_tokens=4, kv_bits=4)
    with pytest.raises(KVTrimError, match="position='true'"):
        create_policy("kvzip", keep=0.3, position="reassigned")


def test_a_long_prompt_shows_the_reconstruction_progress(model, prompt, capsys):
    ids = prompt[0].tolist()
    kvtrim.generate_ids(model, _CharTokenizer(), ids, create_policy("kvzip", keep=0.3, chunk=40), max_new_tokens=2,
                        stop_at_eos=False)
    err = capsys.readouterr().err
    assert "kvzip: reconstructing the prompt" in err and "3/3" in err  # 97 tokens in chunks of 40
    kvtrim.generate_ids(model, _CharTokenizer(), ids, create_policy("kvzip", keep=0.3), max_new_tokens=2,
                        stop_at_eos=False)
    assert "reconstructing" not in capsys.readouterr().err  # one chunk: no bar
