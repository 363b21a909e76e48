"""benchmarks/bench_kv_bits_decode.py on a tiny model: its random fill leaves the state a real prompt
leaves, a low-bit decode step runs kvtrim's native kernel once per layer, and the script runs end to
end (JSON and --table)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_benchmark, tiny_llama

import kvtrim.attention.lowbit as lowbit_mod
from kvtrim import decoding
from kvtrim.cache import KVTrimCache
from kvtrim.integrations.hf import attach
from kvtrim.lowbit_storage import LowBitLayer
from kvtrim.persistence import state_dict
from kvtrim.registry import create_policy


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_kv_bits_decode")


def _layout(cache: KVTrimCache) -> dict:
    """What a stored state is made of, without its values: counts, bytes and every tensor's shape and dtype."""
    out = {"stored": cache.stored_tokens(), "seen": cache.seen_tokens(), "kv_bytes": cache.kv_bytes(),
           "tensors": {k: (tuple(t.shape), t.dtype) for k, t in state_dict(cache).items()}}
    out["layers"] = [(layer.n_quantized, layer.n_res, layer.lowbit.groups) if isinstance(layer, LowBitLayer) else None
                     for layer in cache.layers]
    return out


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
@pytest.mark.parametrize("stored", [100, 128])
def test_the_random_fill_leaves_what_a_prompt_leaves(bench, bits, stored):
    """The fill stores exactly what a real prompt of the same length stores (the quantized groups, the
    residual, the bytes and every tensor's shape), and both caches then decode alike."""
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (stored,), generator=torch.Generator().manual_seed(0)).tolist()
    with attach(model), torch.inference_mode():
        real = KVTrimCache(model, create_policy("full"), kv_bits=bits)
        logits = decoding.run(model, decoding.prefill(real, ids))
        filled = KVTrimCache(model, create_policy("full"), kv_bits=bits)
        bench.fill(filled, model, stored)
        assert _layout(filled) == _layout(real)
        if bits < 16:
            assert filled.layers[0].n_quantized == stored // 32 * 32
        for cache in (real, filled):
            decoding.run(model, decoding.decode(cache, logits, 3))
        assert _layout(filled) == _layout(real)


def test_a_low_bit_decode_step_runs_the_native_kernel_once_per_layer(bench, monkeypatch):
    from kvtrim.attention.native import kernel_for

    if kernel_for(torch.zeros(1)) != "native":
        pytest.skip("kvtrim's native CPU kernel is not built here (KVTRIM_CPU_KERNEL=torch, or no compiler)")
    calls = []
    real_kernel = lowbit_mod.native_lowbit_decode

    def counted(*args, **kwargs):
        calls.append(1)
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(lowbit_mod, "native_lowbit_decode", counted)
    model = tiny_llama()
    with attach(model), torch.inference_mode():
        cache = KVTrimCache(model, create_policy("full"), kv_bits=4)
        bench.fill(cache, model, 96)
        prof = bench.profiled_step(model, cache, torch.zeros(model.config.vocab_size))
    assert len(calls) == model.config.num_hidden_layers
    assert prof == {"kvtrim_native::lowbit_decode": {"calls": model.config.num_hidden_layers,
                                                     "ms": prof["kvtrim_native::lowbit_decode"]["ms"]}}


def test_the_benchmark_runs_end_to_end(bench, tiny_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench.main(["--model", tiny_dir, "--lengths", "64,100", "--bits", "16,4", "--threads", "1", "--steps", "2",
                       "--reps", "1", "--warmup", "0", "--calls", "1", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["note"] == bench.FILLED and d["layers"] == 3
    rows = {(r["length"], r["bits"]): r for r in d["rows"]}
    assert set(rows) == {(64, 16), (64, 4), (100, 16), (100, 4)}
    for (length, bits), r in rows.items():
        # the stored tokens are the fill; then 2 timed steps and 1 profiled step each add one
        assert r["stored"] == r["seen"] == length and r["stored_after"] == length + 3
        assert len(r["step_ms_all"]) == 2 and r["step_ms"] > 0
        assert set(r["attention"]) == ({"sdpa", "grouped"} if bits == 16 else {"lowbit"})
        assert all(v["calls"] == 3 for v in r["profiled_step"].values())
    for length in (64, 100):
        assert rows[(length, 4)]["kv_bytes"] < rows[(length, 16)]["kv_bytes"]
        assert "aten::scaled_dot_product_attention" in rows[(length, 16)]["profiled_step"]
    capsys.readouterr()
    assert bench.main(["--table", str(out)]) == 0
    table = capsys.readouterr().out
    assert bench.FILLED in table
    assert len([x for x in table.splitlines() if x.startswith("| 1 |")]) == 4


def test_bits_without_16_are_refused(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--bits", "8,4", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "--bits must include 16" in capsys.readouterr().err
