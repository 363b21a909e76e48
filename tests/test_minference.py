"""MInference inside a model: the prefill hook, pattern configs, the search, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli_status

from kvtrim.cache import KVTrimCache, cache_keyword
from kvtrim.cli import main
from kvtrim.errors import KVTrimError
from kvtrim.generation import generate_ids
from kvtrim.integrations.hf import attach
from kvtrim.integrations.prefill import PatternConfig, SparsePrefill, make_pattern, make_prefill, model_identity
from kvtrim.policies.full import Full
from kvtrim.tools.search_patterns import head_candidates


@pytest.fixture(scope="module")
def long_prompt():
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 128, (1, 250), generator=g)


def _logits(model, ids, hook):
    cache = KVTrimCache(model, "full")
    with attach(model, prefill_attention=hook), torch.inference_mode():
        return model(input_ids=ids, **{cache_keyword(): cache}).logits


def _config(model, entry: dict) -> PatternConfig:
    ident = model_identity(model)
    rows = [[dict(entry) for _ in range(ident["num_attention_heads"])] for _ in range(ident["num_hidden_layers"])]
    return PatternConfig(model=ident, layers=rows)


def test_all_blocks_selected_equals_dense_through_the_model(model, long_prompt):
    dense = _logits(model, long_prompt, None)
    hook = SparsePrefill("block_sparse", sizes={"k_b": 100}, min_length=1)
    sparse = _logits(model, long_prompt, hook)
    assert hook.stats()["sparse_layers"] == model.config.num_hidden_layers
    assert hook.stats()["density"] == pytest.approx(1.0)
    torch.testing.assert_close(sparse, dense, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mode, sizes", [("a_shape", {"n_init": 16, "n_local": 64}), ("vertical_slash", {"k_v": 40, "k_s": 60}), ("block_sparse", {"k_b": 2})])
def test_sparse_prefill_cpu_path_equals_reference_through_the_model(model, long_prompt, mode, sizes):
    ref = _logits(model, long_prompt, SparsePrefill(mode, sizes=sizes, min_length=1, backend="reference"))
    hook = SparsePrefill(mode, sizes=sizes, min_length=1, backend="cpu")
    fast = _logits(model, long_prompt, hook)
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-4)
    dense = _logits(model, long_prompt, None)
    assert hook.stats()["density"] < 1.0
    assert not torch.allclose(fast, dense, atol=1e-4)  # it really is sparse


def test_per_head_config_mixes_patterns(model, long_prompt):
    ident = model_identity(model)
    kinds = [{"pattern": "a_shape", "n_init": 16, "n_local": 64}, {"pattern": "vertical_slash", "k_v": 40, "k_s": 60}, {"pattern": "block_sparse", "k_b": 2}]
    rows = [[kinds[(li + h) % 3] for h in range(ident["num_attention_heads"])] for li in range(ident["num_hidden_layers"])]
    cfg = PatternConfig(model=ident, layers=rows)
    hook = SparsePrefill("minference", config=cfg, min_length=1)
    out = _logits(model, long_prompt, hook)
    ref = _logits(model, long_prompt, SparsePrefill("minference", config=cfg, min_length=1, backend="reference"))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert type(hook.pattern_for(0, 0)).__name__ == "AShape" and type(hook.pattern_for(0, 1)).__name__ == "VerticalSlash"


def test_mixed_layer_with_dense_heads_equals_the_reference(model, long_prompt):
    """Dense heads (SDPA per KV head), several vertical-slash heads of different sizes (one shared
    estimation), A-shape and block-sparse heads in the same layer, as the searched configs have."""
    ident = model_identity(model)
    kinds = [{"pattern": "dense"}, {"pattern": "vertical_slash", "k_v": 40, "k_s": 60},
             {"pattern": "vertical_slash", "k_v": 90, "k_s": 50}, {"pattern": "a_shape", "n_init": 16, "n_local": 64},
             {"pattern": "vertical_slash", "k_v": 30, "k_s": 120}, {"pattern": "block_sparse", "k_b": 2}]
    rows = [[kinds[(li + h) % len(kinds)] for h in range(ident["num_attention_heads"])] for li in range(ident["num_hidden_layers"])]
    cfg = PatternConfig(model=ident, layers=rows)
    hook = SparsePrefill("minference", config=cfg, min_length=1)
    out = _logits(model, long_prompt, hook)
    ref = _logits(model, long_prompt, SparsePrefill("minference", config=cfg, min_length=1, backend="reference"))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert hook.stats()["kernel"] in ("cpu-native", "cpu-torch")
    assert 0.0 < hook.stats()["density"] < 1.0


def test_shared_vertical_slash_estimation_equals_each_heads_own(model):
    """The layer-wide estimation (one scores pass, one layout build) gives every head the layout
    its own ``VerticalSlash.layout`` gives."""
    from kvtrim.attention.reference import layout_to_mask

    ident = model_identity(model)
    hq, hkv = ident["num_attention_heads"], ident["num_key_value_heads"]
    sizes = [(40, 60), (90, 50), (30, 120), (200, 200), (35, 55)]
    rows = [[{"pattern": "vertical_slash", "k_v": sizes[h % 5][0], "k_s": sizes[h % 5][1]} if h % 4 else {"pattern": "dense"}
             for h in range(hq)] for _ in range(ident["num_hidden_layers"])]
    hook = SparsePrefill("minference", config=PatternConfig(model=ident, layers=rows), min_length=1)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, hq, 333, ident["head_dim"], generator=g), torch.randn(1, hkv, 333, ident["head_dim"], generator=g)
    got = hook._layouts(0, q, k, 0.125)
    grp = hq // hkv
    for h in range(hq):
        pat = hook.pattern_for(0, h)
        if pat is None:
            assert got[h] is None
            continue
        own = pat.layout(q[:, h : h + 1], k[:, h // grp : h // grp + 1], 0.125)
        assert torch.equal(layout_to_mask(got[h]), layout_to_mask(own)), f"head {h}"
        assert got[h].density() == pytest.approx(own.density())


def test_decode_stays_dense_and_only_the_first_prefill_is_sparse(model, long_prompt):
    calls = []

    class Spy(SparsePrefill):
        def __call__(self, module, query, key, *a, **kw):
            calls.append((query.shape[-2], key.shape[-2]))
            return super().__call__(module, query, key, *a, **kw)

    hook = Spy("block_sparse", sizes={"k_b": 2}, min_length=1)
    res = generate_ids(model, None, long_prompt[0].tolist(), Full(), max_new_tokens=5, stop_at_eos=False, prefill=hook)
    assert res.new_tokens == 5
    assert calls and all(q == k == 250 for q, k in calls)  # only the prefill forward, every layer
    assert len(calls) == model.config.num_hidden_layers
    assert res.prefill["sparse_layers"] == model.config.num_hidden_layers


def test_short_prompt_falls_back_to_dense_and_says_so(model, long_prompt):
    hook = SparsePrefill("block_sparse", sizes={"k_b": 1}, min_length=1000)
    out = _logits(model, long_prompt, hook)
    torch.testing.assert_close(out, _logits(model, long_prompt, None), atol=0, rtol=0)
    st = hook.stats()
    assert st["sparse_layers"] == 0 and st["density"] == 1.0
    assert "shorter than min_length=1000" in st["fallback"]


def test_composes_with_a_kv_policy(model, long_prompt):
    from kvtrim.policies.snapkv import SnapKV

    hook = SparsePrefill("vertical_slash", sizes={"k_v": 40, "k_s": 60}, min_length=1)
    res = generate_ids(model, None, long_prompt[0].tolist(), SnapKV(keep=0.3), max_new_tokens=4, stop_at_eos=False, prefill=hook)
    assert res.stored_tokens < 250 and res.prefill["density"] < 1.0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: make_pattern("diagonal"), "unknown sparse pattern 'diagonal'"),
        (lambda: make_pattern("block_sparse", k_b=0), "k_b must be a positive integer"),
        (lambda: make_pattern("a_shape", n_init=-4), "n_init must be a positive integer"),
        (lambda: make_pattern("block_sparse", k_v=3), "does not take ['k_v']"),
        (lambda: SparsePrefill("sparse"), "unknown prefill mode 'sparse'"),
        (lambda: SparsePrefill("minference"), "needs a pattern config"),
        (lambda: SparsePrefill("block_sparse", min_length=0), "min_length must be a positive integer"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(KVTrimError, match=None) as e:
        call()
    assert message in str(e.value)


def test_config_for_another_model_is_refused(model, tmp_path):
    from conftest import tiny_llama

    other = tiny_llama(layers=2)
    cfg = _config(other, {"pattern": "block_sparse", "k_b": 4})
    path = tmp_path / "cfg.json"
    cfg.save(path)
    with pytest.raises(KVTrimError) as e:
        make_prefill(model, "minference", path)
    assert "made for another model" in str(e.value) and "num_hidden_layers: config 2 vs model 3" in str(e.value)
    other_heads = tiny_llama(n_kv=1, groups=4)
    with pytest.raises(KVTrimError, match="num_attention_heads: config 4 vs model 6"):
        make_prefill(model, "minference", _config(other_heads, {"pattern": "block_sparse", "k_b": 4}))


def test_config_round_trip_and_bad_files(model, tmp_path):
    cfg = _config(model, {"pattern": "vertical_slash", "k_v": 40, "k_s": 60, "error": 0.1})
    path = tmp_path / "c.json"
    cfg.save(path)
    back = PatternConfig.load(path)
    assert back.layers == cfg.layers and back.model == cfg.model
    assert back.counts() == {"vertical_slash": 3 * 6}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(KVTrimError, match="not valid JSON"):
        PatternConfig.load(bad)
    with pytest.raises(KVTrimError, match="does not exist"):
        PatternConfig.load(tmp_path / "missing.json")
    d = cfg.to_json()
    d["layers"][1][2] = {"pattern": "block_sparse", "k_b": 0}
    bad.write_text(json.dumps(d))
    with pytest.raises(KVTrimError, match="layer 1 head 2: bad sizes"):
        PatternConfig.load(bad)


def test_minference_without_a_config_for_the_model(model):
    with pytest.raises(KVTrimError, match="no pattern config ships for this model"):
        make_prefill(model, "minference")


def test_configs_searched_at_several_lengths_are_picked_per_prompt(model, long_prompt):
    from kvtrim.integrations.prefill import pick_config

    short = _config(model, {"pattern": "block_sparse", "k_b": 1})
    short.search["length"] = 64
    long = _config(model, {"pattern": "dense"})
    long.search["length"] = 4096
    assert pick_config([short, long], 250) is short  # log distance: 250/64 < 4096/250
    assert pick_config([short, long], 600) is long
    assert pick_config([short, long], 512) is long  # the geometric middle goes to the longer (denser) one
    hook = SparsePrefill("minference", config=[long, short], min_length=1)
    assert hook.configs == [short, long]
    sparse = _logits(model, long_prompt, hook)
    assert hook.stats()["config_length"] == 64 and hook.stats()["density"] < 0.5
    hook.reset_stats()
    longer = torch.cat([long_prompt] * 3, dim=1)  # 750 tokens: the dense config, the dense answer
    torch.testing.assert_close(_logits(model, longer, hook), _logits(model, longer, None), atol=1e-5, rtol=1e-4)
    assert hook.stats()["config_length"] == 4096 and hook.stats()["density"] == pytest.approx(1.0)
    assert not torch.allclose(sparse, _logits(model, long_prompt, None), atol=1e-3)
    with pytest.raises(KVTrimError, match="a PatternConfig or a sequence"):
        SparsePrefill("minference", config=[short, "x.json"])


def test_search_candidates_share_one_executed_cost():
    torch.manual_seed(0)
    t, d = 1500, 32
    q, k = torch.randn(1, 1, t, d), torch.randn(1, 1, t, d)
    target = 0.3
    cands = head_candidates(q, k, d**-0.5, target)
    kinds = {c[0] for c in cands}
    assert kinds == {"a_shape", "vertical_slash", "block_sparse"}
    for name, sizes, lay in cands:
        assert lay.density() <= target * 1.05, (name, sizes, lay.density())
        assert lay.density() >= target * 0.6, (name, sizes, lay.density())  # sized up to the budget, not trivially small
    vs = [s for n, s, _ in cands if n == "vertical_slash"]
    assert all(s["k_v"] >= 30 and s["k_s"] >= 50 for s in vs)  # recorded sizes are the sizes that run


def test_sampled_query_blocks_spread_over_the_prompt():
    from kvtrim.tools.search_patterns import block_rows, sampled_blocks

    keep = sampled_blocks(512, 32)
    assert int(keep.sum()) == 32 and bool(keep[-1]) and bool(keep[0])
    gaps = torch.diff(torch.nonzero(keep).flatten())
    assert int(gaps.min()) >= 15 and int(gaps.max()) <= 17  # evenly spread
    assert sampled_blocks(512, None) is None and sampled_blocks(8, 8) is None
    with pytest.raises(KVTrimError, match="query_blocks must be >= 1"):
        sampled_blocks(8, 0)
    rows = block_rows(sampled_blocks(16, 2), 1000)  # blocks 0 and 15 (the last, partial: 1000 - 960 rows)
    assert rows.tolist() == list(range(64)) + list(range(960, 1000))


def test_restricted_layout_computes_the_kept_rows_only():
    from kvtrim.attention import VerticalSlash, sparse_attention_cpu
    from kvtrim.tools.search_patterns import block_rows, restrict, sampled_blocks

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 1000, 32) for _ in range(3))
    lay = VerticalSlash(k_v=40, k_s=60).layout(q, k)
    keep = sampled_blocks(16, 4)
    full = sparse_attention_cpu(q, k, v, lay)
    part = sparse_attention_cpu(q, k, v, restrict(lay, keep))
    rows = block_rows(keep, 1000)
    torch.testing.assert_close(part[:, :, rows], full[:, :, rows], rtol=0, atol=0)
    others = torch.ones(1000, dtype=torch.bool)
    others[rows] = False
    assert bool((part[:, :, others] == 0).all())
    assert restrict(lay, None) is lay


def test_search_with_sampled_rows_scores_the_same_candidates(model, long_prompt):
    from kvtrim.tools.search_patterns import SearchHook

    every = SearchHook(model.config.num_hidden_layers, model.config.num_attention_heads, 0.6)
    some = SearchHook(model.config.num_hidden_layers, model.config.num_attention_heads, 0.6, query_blocks=2)
    _logits(model, long_prompt, every)
    out = _logits(model, long_prompt, some)
    torch.testing.assert_close(out, _logits(model, long_prompt, None), atol=1e-5, rtol=1e-4)  # the model ran dense
    differ = 0
    for ra, rb in zip(every.rows, some.rows):
        for a, b in zip(ra, rb):
            assert a["candidates"].keys() == b["candidates"].keys()  # the same candidates, measured on fewer rows
            assert [c["density"] for c in a["candidates"].values()] == [c["density"] for c in b["candidates"].values()]
            differ += any(x["error"] != y["error"] for x, y in zip(a["candidates"].values(), b["candidates"].values()))
    assert differ > 0  # the sampled errors are measured on other rows


def test_search_picks_the_lowest_error_candidate(model, long_prompt):
    from kvtrim.tools.search_patterns import SearchHook

    hook = SearchHook(model.config.num_hidden_layers, model.config.num_attention_heads, 0.6)
    out = _logits(model, long_prompt, hook)
    torch.testing.assert_close(out, _logits(model, long_prompt, None), atol=1e-5, rtol=1e-4)  # the model ran dense
    for row in hook.rows:
        assert len(row) == model.config.num_attention_heads
        for e in row:
            errs = [c["error"] for c in e["candidates"].values()]
            assert e["error"] == min(errs)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prefill", "sparse", "--question", "q"], "unknown --prefill 'sparse'"),
        (["generate", "--prefill", "block_sparse", "--prefill-size", "k_b=0", "--question", "q"], "--prefill-size must be KEY=VALUE with 1 <= VALUE < 2^31"),
        (["generate", "--prefill", "block_sparse", "--prefill-size", "k_b", "--question", "q"], "must be KEY=VALUE (e.g. k_b=32)"),
        (["generate", "--prefill", "a_shape", "--prefill-size", "k_b=3", "--question", "q"], "does not take ['k_b']"),
        (["generate", "--prefill", "block_sparse", "--pattern-config", "/nonexistent.json", "--question", "q"], "does not exist"),
        (["search-patterns", "--density", "1.5", "--out", "/tmp/x.json"], "--density must be comma-separated numbers in (0, 1)"),
        (["search-patterns", "--length", "100", "--out", "/tmp/x.json"], "--length must be an integer >= 256"),
        (["search-patterns", "--query-blocks", "-1", "--out", "/tmp/x.json"], "--query-blocks must be"),
        (["search-patterns", "--out", "/nonexistent/dir/x.json"], "does not exist"),
    ],
)
def test_cli_bad_input(argv, message, capsys):
    assert cli_status(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error:") and message in err


@pytest.mark.model
def test_shipped_config_fits_the_embedded_model(real):
    from kvtrim.integrations.prefill import shipped_config

    cfg = shipped_config(real.model)
    assert cfg is not None
    cfg.check(real.model)
    assert sum(cfg.counts().values()) == 30 * 9


@pytest.mark.model
def test_cli_generate_json_reports_prefill(real, tmp_path, capsys):
    from kvtrim.data import essays_text

    ctx = tmp_path / "ctx.txt"
    ctx.write_text(essays_text()[:12000])
    argv = ["generate", "--context-file", str(ctx), "--question", "Who wrote this?", "--max-new-tokens", "4", "--json",
            "--method", "snapkv", "--keep", "0.3", "--prefill", "block_sparse", "--prefill-size", "k_b=8", "--prefill-min-length", "512"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["prefill"]["mode"] == "block_sparse" and d["prefill"]["fallback"] is None
    assert d["prefill"]["kernel"] in ("cpu-native", "cpu-torch")
    assert 0.0 < d["attention_density"] < 0.8
    argv[-1] = "100000"  # longer than the prompt: dense, and the JSON says why
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["attention_density"] == 1.0 and "shorter than min_length=100000" in d["prefill"]["fallback"]
    other = tmp_path / "other.json"
    from conftest import tiny_llama

    _config(tiny_llama(), {"pattern": "block_sparse", "k_b": 4}).save(other)
    assert main(["generate", "--prefill", "minference", "--pattern-config", str(other), "--question", "q"]) == 2
    assert "made for another model" in capsys.readouterr().err


def test_compress_takes_a_prefill_and_reports_its_stats(model, long_prompt):
    import kvtrim

    hook = SparsePrefill("block_sparse", sizes={"k_b": 2}, min_length=1)
    with kvtrim.compress(model, "snapkv", keep=0.5, prefill=hook) as cache:
        out = model.generate(long_prompt, past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == 253
    st = cache.prefill_stats()
    assert st["sparse_layers"] == model.config.num_hidden_layers and st["density"] < 1.0
    with pytest.raises(KVTrimError, match="no pattern config ships"), kvtrim.compress(model, "full", prefill="minference"):
        pass


def test_dense_entries_of_a_config_run_dense(model, long_prompt):
    cfg = _config(model, {"pattern": "dense"})
    hook = SparsePrefill("minference", config=cfg, min_length=1)
    torch.testing.assert_close(_logits(model, long_prompt, hook), _logits(model, long_prompt, None), atol=1e-5, rtol=1e-4)
    assert hook.stats()["density"] == pytest.approx(1.0) and cfg.counts() == {"dense": 18}


def test_search_takes_the_cheapest_level_within_the_error_tolerance(model, long_prompt):
    from kvtrim.tools.search_patterns import SearchHook, parse_candidate_label

    eps = 0.3
    hook = SearchHook(model.config.num_hidden_layers, model.config.num_attention_heads, [0.7, 0.4], max_error=eps)
    _logits(model, long_prompt, hook)
    assert hook.levels == [0.4, 0.7]
    seen_sparse = False
    for row in hook.rows:
        for e in row:
            best = {}
            for label, c in e["candidates"].items():
                lvl = parse_candidate_label(label)[0]
                best[lvl] = min(best.get(lvl, 1e9), c["error"])
            if e["pattern"] == "dense":
                assert all(v > eps for v in best.values())
            else:
                seen_sparse = True
                assert best[e["level"]] == e["error"] <= eps
                assert all(best[lv] > eps for lv in best if lv < e["level"])
                assert all(lv <= e["level"] for lv in best)  # stopped at the first level that met it
    assert seen_sparse


def test_a_loosened_config_is_the_one_a_looser_search_makes(model, long_prompt):
    """with_tolerance reads the candidates a search recorded (their labels, through
    parse_candidate_label) and picks what a search at the looser tolerance picks."""
    from kvtrim.integrations.prefill import PatternConfig
    from kvtrim.tools.search_patterns import SearchHook, candidate_label, parse_candidate_label, with_tolerance

    assert parse_candidate_label(candidate_label(0.25, "vertical_slash", {"n_vertical": 64, "n_slash": 8})) == \
        (0.25, "vertical_slash", {"n_vertical": 64, "n_slash": 8})
    hooks = {}
    for eps in (0.3, 0.5):
        hooks[eps] = SearchHook(model.config.num_hidden_layers, model.config.num_attention_heads, [0.7, 0.4], max_error=eps)
        _logits(model, long_prompt, hooks[eps])
    counts = {k: getattr(model.config, k) for k in ("num_hidden_layers", "num_attention_heads")}
    tight = PatternConfig(model=counts, layers=hooks[0.3].rows, search={"max_error": 0.3})
    loose = with_tolerance(tight, 0.5)
    keys = ("pattern", "level", "error")
    got = [[{k: e[k] for k in keys} for e in row] for row in loose.layers]
    want = [[{k: e[k] for k in keys} for e in row] for row in hooks[0.5].rows]
    assert got == want
    with pytest.raises(KVTrimError, match="can only be loosened"):
        with_tolerance(tight, 0.2)


def test_bad_cpu_kernel_choice_is_refused_when_the_hook_is_made(monkeypatch):
    monkeypatch.setenv("KVTRIM_CPU_KERNEL", "fastest")
    with pytest.raises(KVTrimError, match="KVTRIM_CPU_KERNEL"):
        SparsePrefill("block_sparse", sizes={"k_b": 2}, min_length=1, backend="cpu")
    assert SparsePrefill("dense").stats()["kernel"] is None  # dense never touches the kernel
