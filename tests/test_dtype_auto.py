"""``dtype="auto"`` / ``--dtype auto``: the per-phase plan (kvtrim.models.plan_dtype) and, on a CPU
without bfloat16 arithmetic, bfloat16 weights and KV with a float32 prefill (kvtrim.mixed_precision).

This machine's CPU may well have bfloat16 arithmetic; the CPU flags and the probe's result are
injected, so both plans are tested here whatever the CPU is.
"""
from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from conftest import cli_status, tiny_llama
from test_model_loading import private_caches, save_tiny_llama  # noqa: F401 - the fixture is autouse
from torch import nn

import kvtrim
from kvtrim import mixed_precision
from kvtrim.cache import KVTrimCache
from kvtrim.cpu_linear import PackedLinear
from kvtrim.errors import KVTrimError
from kvtrim.mixed_precision import MixedLinear
from kvtrim.models import AUTO_ENV, DTYPE_CHOICES, check_dtype, load_model, plan_dtype

NO_BF16 = ["avx2", "fma"]  # an AVX2-only CPU (the issue's)
BF16 = torch.bfloat16


@pytest.fixture
def no_bf16_cpu(monkeypatch):
    """This process sees an AVX2-only CPU on which the probe measured bfloat16 slower."""
    import kvtrim.models as models

    monkeypatch.setattr(models, "cpu_matrix_flags", lambda: list(NO_BF16))
    monkeypatch.setattr(mixed_precision, "bf16_matmul_fast", lambda threads: False)
    monkeypatch.delenv(AUTO_ENV, raising=False)


# ---- the plan --------------------------------------------------------------------------------------
def test_an_explicit_dtype_is_that_dtype_in_every_phase():
    for name, dt in (("float32", torch.float32), ("bfloat16", BF16), (torch.float16, torch.float16), (None, torch.float32)):
        p = plan_dtype(name, "cpu", flags=NO_BF16, bf16_fast=False)
        assert (p.storage, p.prefill, p.decode, p.mixed) == (dt, dt, dt, False)


@pytest.mark.parametrize("flags, fast, prefill", [
    (["amx_bf16", "avx2"], None, BF16),          # bfloat16 arithmetic: no probe needed
    (["avx2", "avx512_bf16"], None, BF16),
    (NO_BF16, False, torch.float32),             # AVX2 only, bfloat16 measured slower: float32 prefill
    (["avx2", "avx512f"], True, BF16),           # AVX-512 without BF16 where bfloat16 measured as fast
    ([], False, torch.float32),                  # no flag the OS names (or none known): the probe decides
])
def test_auto_on_a_cpu(monkeypatch, flags, fast, prefill):
    monkeypatch.delenv(AUTO_ENV, raising=False)

    def probe(threads):
        assert fast is not None, "the probe ran on a CPU whose flags already decide"
        return fast

    p = plan_dtype("auto", "cpu", flags=flags, bf16_fast=probe)
    assert (p.storage, p.prefill, p.decode) == (BF16, prefill, BF16)
    assert p.mixed == (prefill == torch.float32) and p.reason.startswith("auto")
    assert json.loads(json.dumps(p.names()))["prefill"] == str(prefill).removeprefix("torch.")


def test_the_environment_forces_either_plan_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv(AUTO_ENV, "mixed")
    assert plan_dtype("auto", "cpu", flags=["amx_bf16"]).mixed
    monkeypatch.setenv(AUTO_ENV, "bfloat16")
    assert not plan_dtype("auto", "cpu", flags=NO_BF16, bf16_fast=False).mixed
    monkeypatch.setenv(AUTO_ENV, "fast")
    with pytest.raises(KVTrimError, match=f"{AUTO_ENV}='fast'"):
        plan_dtype("auto", "cpu")
    monkeypatch.setenv(AUTO_ENV, "mixed")
    assert not plan_dtype("float32", "cpu").mixed  # an explicit dtype is never overridden


def test_a_bad_dtype_names_auto_among_the_choices():
    assert check_dtype(" AUTO ") == "auto" and check_dtype("bfloat16") is BF16
    for bad in ("int8", "half", torch.int8, 3):
        with pytest.raises(KVTrimError, match="dtype must be one of float32, bfloat16, float16, auto"):
            check_dtype(bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_cuda():
    p = plan_dtype("auto", "cuda")
    want = BF16 if torch.cuda.is_bf16_supported() else torch.float32
    assert (p.storage, p.prefill, p.decode) == (want, want, want)


def test_the_probe_answers_and_is_measured_once():
    mixed_precision.bf16_matmul_fast.cache_clear()
    first = mixed_precision.bf16_matmul_fast(1)
    assert isinstance(first, bool) and mixed_precision.bf16_matmul_fast(1) is first
    assert mixed_precision.bf16_matmul_fast.cache_info().hits == 1


# ---- loading -----------------------------------------------------------------------------------------
def test_auto_on_a_cpu_with_bf16_arithmetic_is_the_bfloat16_load(tmp_path, monkeypatch):
    import kvtrim.models as models

    monkeypatch.setattr(models, "cpu_matrix_flags", lambda: ["amx_bf16", "avx2", "avx512_bf16"])
    monkeypatch.delenv(AUTO_ENV, raising=False)
    d = save_tiny_llama(tmp_path / "m")
    auto, bf16 = load_model(d, dtype="auto"), load_model(d, dtype="bfloat16")
    assert auto.dtypes is not None and not auto.dtypes.mixed and auto.dtypes.storage == BF16
    assert [type(m) for m in auto.model.modules()] == [type(m) for m in bf16.model.modules()]
    assert not any(isinstance(m, MixedLinear) for m in auto.model.modules())
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(auto.model(ids).logits, bf16.model(ids).logits)


def test_the_default_float32_load_is_untouched(tmp_path, monkeypatch, no_bf16_cpu):
    lm = load_model(save_tiny_llama(tmp_path / "m"))
    assert lm.dtypes is not None and lm.dtypes.names()["storage"] == "float32" and not lm.dtypes.mixed
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32}
    assert not mixed_precision.installed(lm.model) and mixed_precision.storage_dtype(lm.model) is None
    assert all(type(m) is not MixedLinear for m in lm.model.modules())


def test_auto_on_a_cpu_without_bf16_arithmetic_loads_bfloat16_with_a_float32_prefill(tmp_path, no_bf16_cpu, caplog):
    with caplog.at_level(logging.INFO, logger="kvtrim.models"):
        lm = load_model(save_tiny_llama(tmp_path / "m"), dtype="auto")
    assert lm.dtypes is not None and lm.dtypes.mixed
    assert {p.dtype for p in lm.model.parameters()} == {BF16}
    lins = [m for m in lm.model.modules() if isinstance(m, (nn.Linear, MixedLinear, PackedLinear))]
    assert lins and all(type(m) is MixedLinear for m in lins)  # not packed: the float32 prefill reads the plain weights
    said = [r for r in caplog.records if "dtype auto" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and "prefill float32" in said[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # auto chose it: nothing to warn about


def test_pack_linears_asked_under_the_mixed_plan_is_not_silently_dropped(tmp_path, no_bf16_cpu, caplog):
    """An explicit pack_linears=True that auto's mixed plan cannot honour says so in one warning line;
    the plan's record names the float32 prefill, so its results are never pooled with bfloat16's."""
    with caplog.at_level(logging.INFO, logger="kvtrim.models"):
        lm = load_model(save_tiny_llama(tmp_path / "m"), dtype="auto", pack_linears=True)
    assert not [m for m in lm.model.modules() if isinstance(m, PackedLinear)]
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "pack_linears=True not applied" in warned[0].getMessage()
    assert lm.dtypes is not None and lm.dtypes.label() == "bfloat16, prefill float32"
    assert plan_dtype("bfloat16", "cpu").label() == "bfloat16"


# ---- what the mixed plan computes --------------------------------------------------------------------
def _pair(seed=0):
    """A bfloat16 model with mixed precision installed, and the float32 model with the same (bfloat16-rounded) weights."""
    mixed = tiny_llama(seed=seed, vocab_size=300).to(BF16)
    ref = copy.deepcopy(mixed).float()
    mixed_precision.install(mixed)
    return mixed, ref


def test_a_prompt_without_a_cache_computes_exactly_the_float32_model():
    """Without a cache that rounds the keys, a long forward is the float32 model's forward on the same
    weights, bit for bit: every product, norm, rotary table and attention ran in float32."""
    mixed, ref = _pair()
    ids = torch.randint(0, 300, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = mixed(ids, use_cache=False).logits, ref(ids, use_cache=False).logits
    assert a.dtype == torch.float32 and torch.equal(a, b)


def _prefill(model, ids, cache):
    with torch.no_grad(), kvtrim.attach(model):
        return model(input_ids=ids, **cache.kwargs(), use_cache=True).logits[:, -1].double()


@pytest.mark.parametrize("length", [65, 200])
def test_the_prefill_stores_bf16_keys_rounded_from_float32_and_beats_pure_bfloat16(length):
    mixed, ref = _pair()
    pure = copy.deepcopy(ref).to(BF16)
    ids = torch.randint(0, 300, (1, length), generator=torch.Generator().manual_seed(2))
    caches = {name: KVTrimCache(m, "full") for name, m in (("mixed", mixed), ("ref", ref), ("pure", pure))}
    out = {name: _prefill(m, ids, caches[name]) for name, m in (("mixed", mixed), ("ref", ref), ("pure", pure))}
    layers = caches["mixed"].compressed_layers
    assert all(layer.keys.dtype == BF16 and layer.values.dtype == BF16 for layer in layers)
    assert 2 * caches["mixed"].kv_bytes() == caches["ref"].kv_bytes() == 2 * caches["pure"].kv_bytes()
    # the first layer's keys and values are the float32 model's, rounded once when stored
    first_ref = caches["ref"].compressed_layers[0]
    assert torch.equal(layers[0].keys, first_ref.keys.to(BF16)) and torch.equal(layers[0].values, first_ref.values.to(BF16))
    # the error against the float32 computation on the same weights is below that of the same model
    # computed in bfloat16: the one rounding left is the stored K/V (measured 2.9-7.1x smaller than pure
    # bfloat16's over seeds 0-2 and lengths 65 and 200; 6.6-7.1x on this seed), so half is a bound that fails
    # if the prefill ran in bfloat16
    err_mixed = (out["mixed"] - out["ref"]).abs().max().item()
    err_pure = (out["pure"] - out["ref"]).abs().max().item()
    assert err_pure > 0 and err_mixed <= err_pure / 2, (err_mixed, err_pure)


def test_prefill_in_float32_and_decode_in_bfloat16():
    mixed, _ = _pair()
    seen: list[tuple[int, torch.dtype]] = []
    q = mixed.model.layers[0].self_attn.q_proj
    h = q.register_forward_hook(lambda mod, args, out: seen.append((out.shape[-2], out.dtype)))
    try:
        from kvtrim.generation import generate_ids

        r = generate_ids(mixed, None, list(range(3, 120)), kvtrim.create_policy("snapkv", keep=0.5), max_new_tokens=4,
                         stop_at_eos=False)
    finally:
        h.remove()
    assert r.new_tokens == 4 and r.compressed
    assert seen[0] == (117, torch.float32)
    assert seen[1:] and all(s == (1, BF16) for s in seen[1:])  # every decode step in bfloat16


def test_a_short_turn_stays_bfloat16_and_a_long_one_is_float32():
    mixed, _ = _pair()
    cache = KVTrimCache(mixed, "full")
    _prefill(mixed, torch.arange(3, 103)[None], cache)
    seen: list[torch.dtype] = []
    h = mixed.model.layers[1].mlp.down_proj.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    try:
        _prefill(mixed, torch.arange(3, 13)[None], cache)     # 10 tokens
        _prefill(mixed, torch.arange(3, 103)[None], cache)    # 100 tokens: float32 over the stored bfloat16 keys
    finally:
        h.remove()
    assert seen == [BF16, torch.float32]
    assert all(layer.keys.dtype == BF16 and layer.length == 210 for layer in cache.compressed_layers)


def test_install_is_reversible_and_keeps_the_parameters():
    plain = tiny_llama(seed=0, vocab_size=300).to(BF16)
    assert mixed_precision.storage_dtype(plain) is None and not mixed_precision.installed(plain)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    params = {id(p) for p in plain.parameters()}
    n = mixed_precision.install(plain)
    assert n == sum(isinstance(m, MixedLinear) for m in plain.modules()) > 0
    assert {id(p) for p in plain.parameters()} == params  # the very same parameters (tied ones stay tied)
    assert plain.state_dict().keys() == before.keys()
    with pytest.raises(ValueError, match="already installed"):
        mixed_precision.install(plain)
    assert mixed_precision.remove(plain) == n and mixed_precision.remove(plain) == 0
    assert not any(isinstance(m, MixedLinear) for m in plain.modules())
    assert {id(p) for p in plain.parameters()} == params
    assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())
    ids = torch.arange(3, 203)[None]
    with torch.no_grad():  # a plain bfloat16 model again: the embedding hook is gone too
        assert plain(ids, use_cache=False).logits.dtype == BF16
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mixed_precision.install(tiny_llama())


def test_a_session_records_the_storage_dtype(tmp_path):
    from kvtrim.session import Session

    mixed, _ = _pair()
    s = Session(mixed, None, "snapkv", keep=0.5)
    s.send_ids(list(range(3, 110)), max_new_tokens=3, stop_ids=())
    s.save(tmp_path / "s")
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["dtype"] == "bfloat16"
    b = Session.load(tmp_path / "s", mixed)
    assert b.seen == s.seen


# ---- the command line --------------------------------------------------------------------------------
def test_every_dtype_option_takes_auto():
    from kvtrim.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    with_dtype = [name for name, sp in sub.choices.items() if name != "serve"
                  and any(a.dest == "dtype" for a in sp._actions)]
    assert with_dtype
    for name in with_dtype:
        opt = next(a for a in sub.choices[name]._actions if a.dest == "dtype")
        assert opt.choices == DTYPE_CHOICES and "auto" in opt.choices and opt.default == "float32", name


def test_cli_generate_with_dtype_auto(tiny_dir, no_bf16_cpu, capsys):
    assert cli_status(["generate", "--model", tiny_dir, "--dtype", "auto", "--question", "hi", "--max-new-tokens", "3"]) == 0


def test_cli_bench_plan_records_auto_and_a_bad_dtype_is_one_line(capsys):
    from kvtrim.eval.bench import make_bench_plan

    assert make_bench_plan("full", 0.25, "256", dtype="auto").dtype == "auto"
    assert cli_status(["generate", "--dtype", "int8", "--question", "q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtrim: error:") and "auto" in err[0]
