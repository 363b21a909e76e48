"""Packed CPU linears (kvtrim.cpu_linear): the same products as nn.Linear, reversible, invisible to
state_dict and to the session weight digest, and applied by load_model only where they apply."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama
from torch import nn

from kvtrim import cpu_linear as cl
from kvtrim.generation import generate_ids
from kvtrim.registry import create_policy
from kvtrim.session_file import weights_digest

needs_packing = pytest.mark.skipif(not cl.packing_supported(), reason="oneDNN has no bfloat16 support on this CPU")


def test_only_bfloat16_is_packable():
    assert not cl.packing_supported(torch.float32)
    assert not cl.packing_supported(torch.float16)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 500])
@pytest.mark.parametrize("shape", [(63, 96), (500, 63), (128, 4001)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_error_within_twice_f_linear(rows, shape, bias):
    """The tolerance rule: the packed product's error against float64 is at most twice
    F.linear's error in bfloat16 (both accumulate in float32)."""
    g = torch.Generator().manual_seed(rows * 7 + shape[0])
    out_f, in_f = shape
    lin = nn.Linear(in_f, out_f, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=g))
    x = torch.randn(2, rows, in_f, generator=g).to(torch.bfloat16)
    ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    with torch.no_grad():
        plain = lin(x)
        got = cl.PackedLinear(lin)(x)
    assert got.shape == plain.shape and got.dtype == torch.bfloat16
    err_plain = (plain.double() - ref).abs().max().item()
    err_packed = (got.double() - ref).abs().max().item()
    assert err_packed <= 2 * err_plain + 1e-12, (err_packed, err_plain)


@needs_packing
def test_pack_and_unpack_a_model_keep_every_weight_and_logit():
    model = tiny_llama(layers=2).to(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 41), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    digest = weights_digest(model)
    with torch.no_grad():
        ref = model(ids).logits
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert cl.pack_linears(model) == n_linear  # the tiny Llama ties nothing
    assert cl.packed_count(model) == (n_linear, 0)
    assert not any(type(m) is nn.Linear for m in model.modules())
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)  # the same oneDNN product as F.linear here
    after = model.state_dict()
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert weights_digest(model) == digest
    assert cl.unpack_linears(model) == n_linear
    assert sum(type(m) is nn.Linear for m in model.modules()) == n_linear
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    assert weights_digest(model) == digest


@needs_packing
def test_tied_output_projection_is_packed_only_when_asked():
    model = tiny_llama(layers=1, tie_word_embeddings=True).to(torch.bfloat16)
    model.tie_weights()
    emb = model.get_input_embeddings().weight
    assert model.lm_head.weight is emb
    digest = weights_digest(model)
    n = sum(type(m) is nn.Linear for m in model.modules())
    assert cl.pack_linears(model) == n - 1
    assert type(model.lm_head) is nn.Linear
    assert cl.pack_linears(model, tied=True) == 1
    assert isinstance(model.lm_head, cl.PackedLinear)
    assert cl.packed_count(model)[1] == emb.numel() * emb.element_size()  # the packed copy
    assert model.lm_head.weight is emb
    assert weights_digest(model) == digest
    cl.unpack_linears(model)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied again


@needs_packing
def test_weight_elements_read_the_plain_weight():
    lin = nn.Linear(37, 11).to(torch.bfloat16)
    pl = cl.PackedLinear(lin)
    idx = torch.tensor([0, 5, 36, 37, 200, 406])
    assert torch.equal(pl.weight_elements(idx), lin.weight.detach().reshape(-1)[idx])
    assert torch.equal(pl.weight, lin.weight.detach())


@needs_packing
def test_generation_is_unchanged_by_packing():
    model = tiny_llama(layers=2).to(torch.bfloat16)
    ids = torch.randint(3, 128, (60,), generator=torch.Generator().manual_seed(2)).tolist()

    def run():
        return generate_ids(model, None, ids, create_policy("snapkv", keep=0.5), max_new_tokens=12,
                            stop_at_eos=False).token_ids

    plain = run()
    cl.pack_linears(model)
    assert run() == plain


def test_other_dtypes_and_subclasses_are_left_alone():
    model = tiny_llama(layers=1)  # float32
    assert cl.pack_linears(model) == 0

    class Adapter(nn.Linear):
        pass

    m = nn.Sequential(Adapter(8, 8).to(torch.bfloat16))
    assert cl.pack_linears(m) == 0
    with pytest.raises(ValueError, match="bfloat16 weight on the CPU"):
        cl.PackedLinear(nn.Linear(4, 4))


@needs_packing
def test_packed_linear_refuses_other_input_dtypes():
    pl = cl.PackedLinear(nn.Linear(8, 4).to(torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16 input"):
        pl(torch.ones(1, 8))


@needs_packing
def test_load_model_packs_bfloat16_only_and_can_be_told_not_to(real):
    from kvtrim.models import load_model

    assert cl.packed_count(real.model)[0] == 0  # float32
    lm = load_model(dtype="bfloat16")
    n, extra = cl.packed_count(lm.model)
    assert n > 0 and extra == 0  # SmolLM2 ties lm_head: left plain by default
    assert type(lm.model.lm_head) is nn.Linear
    plain = load_model(dtype="bfloat16", pack_linears=False)
    assert cl.packed_count(plain.model) == (0, 0)
    assert weights_digest(plain.model) == weights_digest(lm.model)
