"""Fused CPU layers (kvtrim.cpu_layers): the one-pass RMS norm against transformers' own, the fused
gated MLP against the module it replaces, what is left alone, reversibility, and load_model's switch."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kvtrim import cpu_layers as fl
from kvtrim import cpu_linear as cl
from kvtrim.attention.native import load_native, native_rms_norm
from kvtrim.errors import KVTrimError
from kvtrim.generation import generate_ids
from kvtrim.registry import create_policy
from kvtrim.session_file import weights_digest

needs_native = pytest.mark.skipif(not load_native(), reason="kvtrim's native CPU kernel cannot be built here")
needs_packing = pytest.mark.skipif(not cl.packing_supported(), reason="oneDNN has no bfloat16 support on this CPU")


def ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of x, in x's dtype, as float64."""
    mant = {torch.bfloat16: 7, torch.float32: 23}[x.dtype]
    mag = x.double().abs().clamp(min=torch.finfo(x.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - mant)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 96), (2, 37, 96), (5, 1000)])
def test_native_rms_norm_is_transformers_norm_within_units_in_the_last_place(dtype, shape):
    """bfloat16: within one unit in the last place (rounding hides the float32 sum's order);
    float32: within four (the mean summed in another order and the reciprocal square root each
    move the last bit, and the product with the weight carries it)."""
    g = torch.Generator().manual_seed(shape[-1] + len(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    norm = LlamaRMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(shape[-1], generator=g))
        want = norm(x)
    got = native_rms_norm(x, norm.weight, 1e-6)
    assert got.shape == want.shape and got.dtype == dtype
    diff = (got.double() - want.double()).abs()
    units = 1 if dtype == torch.bfloat16 else 4
    assert (diff <= units * ulp(want) * 1.0001).all(), (diff / ulp(want)).max()
    if dtype == torch.bfloat16:  # an off-by-one after rounding is rare, not the rule
        assert (got != want).float().mean() < 0.01


@needs_native
def test_native_rms_norm_reads_a_strided_input_and_refuses_mixed_dtypes():
    x = torch.randn(4, 64, 40)[:, ::2, :]  # not contiguous
    w = torch.ones(40)
    want = LlamaRMSNorm(40)(x)
    assert torch.allclose(native_rms_norm(x, w, 1e-6), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="one dtype"):
        native_rms_norm(x, w.to(torch.bfloat16), 1e-6)


def _bf16_packed_model(layers: int = 2):
    model = tiny_llama(layers=layers).to(torch.bfloat16)
    cl.pack_linears(model)
    return model


@needs_native
@needs_packing
def test_fusing_a_model_keeps_its_weights_and_logits_and_is_undone_exactly():
    model = _bf16_packed_model()
    ids = torch.randint(3, 128, (1, 41), generator=torch.Generator().manual_seed(0))
    mlps = [layer.mlp for layer in model.model.layers]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    digest = weights_digest(model)
    with torch.no_grad():
        ref = model(ids).logits.float()
    assert fl.fuse_layers(model) == 2 + 5  # 2 MLPs; 2 norms per layer and the final one
    assert fl.fused_count(model) == {"mlp": 2, "rms_norm": 5}
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert weights_digest(model) == digest  # a saved session still matches the fused model
    with torch.no_grad():
        fused = model(ids).logits.float()
    assert ((fused - ref).norm() / ref.norm()) < 2e-2  # bfloat16 rounding of the SiLU, nothing more
    assert fl.unfuse_layers(model) == 7
    assert [layer.mlp for layer in model.model.layers] == mlps  # the very modules back
    with torch.no_grad():
        assert torch.equal(model(ids).logits.float(), ref)


@needs_native
@needs_packing
def test_a_long_input_runs_in_slices_that_give_the_whole_products(monkeypatch):
    model = _bf16_packed_model(layers=1)
    mlp = model.model.layers[0].mlp
    fused = fl.FusedGatedMLP(mlp)
    x = torch.randn(1, 50, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        whole = fused(x)
        monkeypatch.setattr(fl, "MLP_CHUNK_ROWS", 7)
        sliced = fused(x)
        plain = mlp(x)
    assert sliced.shape == whole.shape == plain.shape
    assert torch.allclose(sliced.float(), whole.float(), rtol=0, atol=1e-2)
    assert ((sliced.float() - plain.float()).norm() / plain.float().norm()) < 2e-2


@needs_native
@needs_packing
def test_other_inputs_and_unpacked_linears_take_transformers_path():
    model = _bf16_packed_model(layers=1)
    fl.fuse_layers(model)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, fl.FusedGatedMLP)
    orig = mlp.original()
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        with pytest.raises(TypeError, match="bfloat16 input"):  # as the original module over packed linears
            mlp(x.float())
        cl.unpack_linears(model)  # the fused module's linears become plain ones; it still computes the MLP
        assert type(mlp.gate_proj) is nn.Linear
        ref = mlp.down_proj(orig.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        assert torch.equal(mlp(x), ref)
    fl.unfuse_layers(model)
    assert model.model.layers[0].mlp is orig
    assert type(orig.gate_proj) is nn.Linear  # the plain linears went back in


@needs_native
def test_layers_that_compute_something_else_are_left_alone():
    class GemmaLikeRMSNorm(nn.Module):  # (1 + weight), as Gemma's norm
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(n))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return ((1 + self.weight.float()) * h).to(x.dtype)

    class GeluMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(16, 32, bias=False)
            self.up_proj = nn.Linear(16, 32, bias=False)
            self.down_proj = nn.Linear(32, 16, bias=False)
            self.act_fn = nn.GELU()

    m = nn.Sequential(GemmaLikeRMSNorm(16), GeluMLP(), nn.LayerNorm(16))
    m.to(torch.bfloat16)
    cl.pack_linears(m)
    assert fl.fuse_layers(m) == 0
    assert fl.fused_count(m) == {"mlp": 0, "rms_norm": 0}


@needs_native
def test_a_float32_model_gets_its_norms_fused_and_the_same_tokens():
    model = tiny_llama(layers=2)
    ids = torch.randint(3, 128, (60,), generator=torch.Generator().manual_seed(3)).tolist()

    def run():
        return generate_ids(model, None, ids, create_policy("snapkv", keep=0.5), max_new_tokens=12,
                            stop_at_eos=False).token_ids

    plain = run()
    assert fl.fuse_layers(model) == 5  # no packed linears in float32: norms only
    assert run() == plain


@needs_packing
def test_the_torch_kernel_choice_leaves_the_norms_alone(monkeypatch):
    monkeypatch.setenv("KVTRIM_CPU_KERNEL", "torch")
    model = _bf16_packed_model()
    assert fl.fuse_layers(model) == 2  # the MLPs (oneDNN), not the norms (native code)
    assert fl.fused_count(model) == {"mlp": 2, "rms_norm": 0}


def test_the_environment_switch_is_checked(monkeypatch):
    from kvtrim.models import cpu_fusion_enabled

    monkeypatch.setenv("KVTRIM_CPU_FUSION", "0")
    assert not cpu_fusion_enabled()
    monkeypatch.setenv("KVTRIM_CPU_FUSION", "yes")
    with pytest.raises(KVTrimError, match="KVTRIM_CPU_FUSION must be 0 or 1"):
        cpu_fusion_enabled()
    monkeypatch.delenv("KVTRIM_CPU_FUSION")
    assert cpu_fusion_enabled()


@pytest.mark.model
@needs_native
def test_load_model_fuses_and_can_be_told_not_to(monkeypatch):
    from kvtrim.models import load_model

    lm = load_model(dtype="bfloat16")
    n_layers = lm.model.config.num_hidden_layers
    want_mlp = n_layers if cl.packing_supported() else 0
    assert fl.fused_count(lm.model) == {"mlp": want_mlp, "rms_norm": 2 * n_layers + 1}
    monkeypatch.setenv("KVTRIM_CPU_FUSION", "0")
    assert fl.fused_count(load_model(dtype="bfloat16").model) == {"mlp": 0, "rms_norm": 0}
