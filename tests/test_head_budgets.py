"""Per-head budgets (``heads="adaptive"``, ``kvtrim.policies.head_budgets``) and the storage that holds KV
heads of different lengths (``kvtrim.ragged_storage``), on tiny random models (CPU, float32)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import cli_status, tiny_llama

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.decisions import LOGIT_BIAS, Keep, KeepHeads
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy
from kvtrim.policies.head_budgets import HEAD_FLOOR
from kvtrim.ragged_storage import RaggedLayer
from kvtrim.registry import create_policy
from kvtrim.storage import CompressedLayer


def _owner(n_kv: int):
    return SimpleNamespace(position_policy="true", rotary=None, num_kv_heads=n_kv, spans=None, layers=[], block_size=None)


def _ragged(n_kv: int, d: int, lengths: list[int], g: torch.Generator, dtype=torch.float32):
    """A RaggedLayer that stored ``max(lengths) + 7`` random tokens and kept, in head ``h``, ``lengths[h]``
    random ones; returns it with the full keys/values and each head's kept slots."""
    t = max(lengths) + 7
    k, v = torch.randn(1, n_kv, t, d, generator=g).to(dtype), torch.randn(1, n_kv, t, d, generator=g).to(dtype)
    layer = RaggedLayer(_owner(n_kv), 0)
    layer.update(k, v)
    idx = tuple(torch.randperm(t, generator=g)[:n].sort().values for n in lengths)
    layer.apply(KeepHeads(idx))
    return layer, k, v, idx


def _padded(layer: RaggedLayer, new_k, new_v):
    """The heads padded to the longest (zeros) and the padding masked: keys, values ``[1, H, Lmax, D]``
    and a boolean mask ``[1, H, q, Lmax]`` (True = may attend, bottom-right causal per head)."""
    assert layer.head_lengths is not None
    n_kv, q = len(layer.head_lengths), new_k.shape[-2]
    lmax = max(layer.head_lengths)
    kp = new_k.new_zeros(1, n_kv, lmax, new_k.shape[-1])
    vp = new_v.new_zeros(1, n_kv, lmax, new_v.shape[-1])
    mask = torch.zeros(1, n_kv, q, lmax, dtype=torch.bool)
    for h, n in enumerate(layer.head_lengths):
        kh, vh, _ = layer.head_tensors(h)
        kp[0, h, :n], vp[0, h, :n] = kh, vh
        mask[0, h, :, :n] = torch.ones(q, n, dtype=torch.bool).tril(n - q)
    return kp, vp, mask


@pytest.mark.parametrize("d, n_kv, groups", [(64, 3, 3), (128, 2, 4), (64, 1, 3)])
@pytest.mark.parametrize("q", [1, 5])
def test_ragged_attention_equals_padded_masked_sdpa_under_the_tolerance_rule(d, n_kv, groups, q):
    """Per-head SDPA over heads of different lengths (odd sizes, one head of a single token) against the
    heads padded to the longest and masked: the error against float64 is at most twice the padded
    SDPA's in float32 (docs/style.md's tolerance rule)."""
    g = torch.Generator().manual_seed(d + n_kv + q)
    lengths = [63, 500, 1][:n_kv] if n_kv > 1 else [4001]
    layer, _, _, _ = _ragged(n_kv, d, lengths, g)
    new_k, new_v = torch.randn(1, n_kv, q, d, generator=g), torch.randn(1, n_kv, q, d, generator=g)
    layer.update(new_k, new_v)
    assert layer.head_lengths == tuple(n + q for n in lengths) and layer.phase == ("decode" if q == 1 else "turn")
    query = torch.randn(1, n_kv * groups, q, d, generator=g)
    scale = d ** -0.5
    out = layer.attend(query, scale)
    kp, vp, mask = _padded(layer, new_k, new_v)
    kr, vr, mr = (t.repeat_interleave(groups, 1) for t in (kp, vp, mask))
    ref = F.scaled_dot_product_attention(query.double(), kr.double(), vr.double(), attn_mask=mr, scale=scale)
    padded = F.scaled_dot_product_attention(query, kr, vr, attn_mask=mr, scale=scale)
    ref, padded = ref.transpose(1, 2), padded.transpose(1, 2)
    assert out.shape == padded.shape == (1, q, n_kv * groups, d) and out.dtype == torch.float32
    err, err_padded = (out.double() - ref).abs().max(), (padded.double() - ref).abs().max()
    assert err <= 2 * err_padded, (float(err), float(err_padded))


def test_keep_heads_frees_memory_and_reports_exact_bytes():
    """After a KeepHeads the rectangular buffers are gone and each head holds its count plus the slack:
    ``stored_nbytes`` is ``sum(K_h) * (D + Dv) * element_size``, ``nbytes`` the heads' allocations;
    each head keeps exactly its slots, in order."""
    g = torch.Generator().manual_seed(3)
    n_kv, d, lengths = 3, 16, [10, 90, 41]
    layer, k, v, idx = _ragged(n_kv, d, lengths, g)
    assert layer._k is None and layer._v is None and layer._pos is None
    el = 4
    assert layer.stored_nbytes() == sum(lengths) * 2 * d * el
    assert layer.nbytes() == sum(n + CompressedLayer.slack(n) for n in lengths) * 2 * d * el
    assert layer.index_nbytes() == sum(n + CompressedLayer.slack(n) for n in lengths) * 8
    assert layer.stored_per_head() == -(-sum(lengths) // n_kv) and layer.length == max(lengths)
    for h in range(n_kv):
        kh, vh, ph = layer.head_tensors(h)
        assert torch.equal(kh, k[0, h, idx[h]]) and torch.equal(vh, v[0, h, idx[h]]) and torch.equal(ph, idx[h])
    # a second keep inside a head keeps that head's own slots
    again = tuple(torch.arange(0, n, 2) for n in lengths)
    layer.apply(KeepHeads(again))
    for h in range(n_kv):
        assert torch.equal(layer.head_tensors(h)[2], idx[h][again[h]])
    with pytest.raises(KVTrimError, match="rectangular keys"):
        _ = layer.keys


def test_the_policy_shares_the_layer_total_with_a_floor_per_head():
    """Every head keeps its floor (here its sinks and window), then the free budget goes to the tokens
    holding the largest shares of their head's score: head 0's 10 peaked tokens (a tenth of its mass
    each), then head 2's 60 (a sixtieth each), the rest to head 1, whose mass is spread over 200 tokens.
    The counts sum to ``H * budget`` exactly and each head keeps the top of its own scores with its
    sinks and window forced in."""
    g = torch.Generator().manual_seed(0)
    pol = create_policy("snapkv", max_tokens=40, window=4, heads="adaptive")
    s, n = 200, 3
    scores = torch.rand(1, n, s, generator=g) * 1e-3
    scores[0, 0, 50:60] = 10.0  # head 0: all its mass on 10 tokens
    scores[0, 1] += torch.rand(s, generator=g)  # head 1: mass spread over every token
    scores[0, 2, 100:160] = 1.0  # head 2: mass on 60 tokens
    positions = torch.arange(s).view(1, 1, s).expand(1, n, s)
    view = SimpleNamespace(phase="prefill", seen=s, length=s, n_new=s, head_lengths=None, positions=positions)
    pol.score = lambda layer, query, key, scaling: scores  # the decision rule alone
    dec = pol.adaptive_heads_keep(view, torch.zeros(1, n * 2, s, 8), torch.zeros(1, n, s, 8), 1.0)
    assert isinstance(dec, KeepHeads)
    counts = dec.counts
    assert sum(counts) == n * 40
    floor = max(pol.min_tokens, int(HEAD_FLOOR * 40))
    assert floor == 8 and counts == [floor + 10, n * 40 - 3 * floor - 70 + floor, floor + 60]
    for h in range(n):
        prot = (positions[0, h] < 4) | (positions[0, h] >= s - 4)
        ranked = scores[0, h].masked_fill(prot, float("inf"))
        expect = torch.topk(ranked, counts[h]).indices.sort().values
        assert torch.equal(dec.idx[h], expect), h


@dataclass
class _Fixed(Policy):
    """Keeps, at the prompt, the slots it was given: as KeepHeads (``ragged``), or padded to the longest
    head with the padding masked by a ``LOGIT_BIAS`` of -inf (the rectangular reference)."""

    ragged: bool = True
    name = "fixed_test"

    def __post_init__(self):
        super().__post_init__()
        self.kept: dict[int, tuple] = {}

    @property
    def uniform_heads(self) -> bool:
        return not self.ragged

    def on_prefill(self, layer, query, key, scaling):
        g = torch.Generator().manual_seed(100 + layer.layer_idx)
        h, s = key.shape[1], key.shape[2]
        lengths = [int(x) + 6 for x in torch.randperm(s - 12, generator=g)[:h]]  # distinct
        idx = [torch.randperm(s, generator=g)[:n].sort().values for n in lengths]
        if self.ragged:
            return KeepHeads(tuple(idx))
        lmax = max(lengths)
        padded, bias = [], torch.zeros(1, h, lmax)
        for i, ix in enumerate(idx):
            spare = torch.tensor(sorted(set(range(s)) - set(ix.tolist()))[: lmax - len(ix)], dtype=torch.long)
            both = torch.cat([ix, spare])
            order = both.argsort()
            padded.append(both[order])
            bias[0, i] = torch.cat([torch.zeros(len(ix)), torch.full((len(spare),), float("-inf"))])[order]
        return Keep(torch.stack(padded).unsqueeze(0), states={LOGIT_BIAS: bias})

    def on_turn(self, layer, query, key, scaling):
        return None


def _run(model, policy, prompt, turn):
    cache = KVTrimCache(model, policy)
    logits = []
    with torch.no_grad(), kvtrim.attach(model):
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(4):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1])
            tok = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=turn, past_key_values=cache, use_cache=True)
        logits.append(out.logits[0])
        out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return cache, logits


@pytest.mark.parametrize("n_kv, groups", [(3, 2), (2, 3)])
def test_ragged_cache_through_the_model_equals_padded_heads_masked(n_kv, groups):
    """Decode steps, a later turn of 9 tokens and a step after it, through the model: a cache holding
    heads of different lengths (KeepHeads) gives the logits of a rectangular cache holding the same
    tokens plus padding tokens masked out by a -inf logit bias."""
    model = tiny_llama(n_kv=n_kv, groups=groups, layers=3)
    g = torch.Generator().manual_seed(5)
    prompt, turn = torch.randint(3, 128, (1, 80), generator=g), torch.randint(3, 128, (1, 9), generator=g)
    ragged, got = _run(model, _Fixed(ragged=True), prompt, turn)
    rect, want = _run(model, _Fixed(ragged=False), prompt, turn)
    assert all(isinstance(layer, RaggedLayer) and layer.head_lengths is not None for layer in ragged.compressed_layers)
    assert all(len(set(layer.head_lengths)) > 1 for layer in ragged.compressed_layers)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # the ragged cache stores fewer bytes: the padded one holds max(K_h) per head
    assert ragged.kv_bytes_stored() < rect.kv_bytes_stored()
    assert ragged.kv_bytes_stored() == sum(sum(layer.head_lengths) for layer in ragged.compressed_layers) * 2 * 16 * 4


def test_adaptive_snapkv_through_prompt_decode_and_turn(model, prompt):
    """snapkv:heads=adaptive on the tiny model: each layer's heads store different counts that sum to
    ``H * budget`` after the prompt and again after a turn; decoding appends to every head."""
    cache = KVTrimCache(model, "snapkv", keep=0.3, window=8, heads="adaptive")
    n_kv = cache.num_kv_heads
    with torch.no_grad(), kvtrim.attach(model):
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        budget = cache.policy.budget(prompt.shape[1])
        for layer in cache.compressed_layers:
            assert sum(layer.head_lengths or (layer.length,) * n_kv) == n_kv * budget
        tok = out.logits[:, -1:].argmax(-1)
        before = [layer.head_lengths for layer in cache.compressed_layers]
        for _ in range(3):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        for b, layer in zip(before, cache.compressed_layers):
            assert layer.head_lengths == tuple(n + 3 for n in b)
        model(input_ids=torch.randint(3, 128, (1, 30)), past_key_values=cache, use_cache=True)
    seen = prompt.shape[1] + 3 + 30
    budget = cache.policy.budget(seen)
    assert all(sum(layer.head_lengths) == n_kv * budget for layer in cache.compressed_layers)
    assert cache.stored_tokens() == [-(-n_kv * budget // n_kv)] * len(cache.layers)


def test_uniform_heads_is_the_rectangular_snapkv_of_before(model, prompt):
    """``heads="uniform"`` (the default) builds the plain rectangular storage, describes itself without
    ``heads`` (results and eval keys recorded before stay the same), and its prompt hook returns the
    top-``budget`` keep of ``evict_by_score``: the same cache, bit for bit, as without the field."""
    default = create_policy("snapkv", keep=0.3)
    assert default.heads == "uniform" and default.uniform_heads and "heads" not in default.describe()
    a, _ = _prefill(model, prompt, create_policy("snapkv", keep=0.3))
    b, _ = _prefill(model, prompt, create_policy("snapkv", keep=0.3, heads="uniform"))
    assert all(type(layer) is CompressedLayer for layer in a.compressed_layers)
    budget = a.policy.budget(prompt.shape[1])
    for x, y in zip(a.compressed_layers, b.compressed_layers):
        assert x.length == budget and torch.equal(x.keys, y.keys) and torch.equal(x.positions, y.positions)


def _prefill(model, prompt, policy):
    cache = KVTrimCache(model, policy)
    with torch.no_grad(), kvtrim.attach(model):
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    return cache, out


def test_refusals_are_one_clear_line(model, prompt, tmp_path):
    for kw, match in (({"layers": "adaptive"}, "layers='uniform'"), ({"per_head": False}, "per_head=True"),
                      ({"position": "reassigned"}, "position='true'"), ({"heads": "ragged"}, "heads")):
        with pytest.raises(KVTrimError, match=match):
            create_policy("snapkv", keep=0.3, **({"heads": "adaptive"} | kw))
    for kw in ({"kv_bits": 4}, {"block_size": 16}):
        with pytest.raises(KVTrimError, match="per-head budgets"):
            KVTrimCache(model, "snapkv", keep=0.3, heads="adaptive", **kw)
    from kvtrim.integrations.vllm.config import PluginConfig

    with pytest.raises(KVTrimError, match="block table"):
        PluginConfig(method="snapkv", params={"keep": 0.25, "heads": "adaptive"})
    cache, _ = _prefill(model, prompt, create_policy("snapkv", keep=0.3, heads="adaptive", window=8))
    with pytest.raises(KVTrimError, match="saving such a cache is not supported"):
        cache.state_dict()


def test_cli_refuses_kv_bits_with_adaptive_heads(tiny_dir, tmp_path, capsys):
    status = cli_status(["eval", "niah_single", "--model", tiny_dir, "--length", "256", "--samples", "1", "--keep",
                         "0.25", "--threads", "1", "--methods", "snapkv:heads=adaptive", "--kv-bits", "4",
                         "--out", str(tmp_path / "out")])
    assert status == 2
    err = capsys.readouterr().err
    # one error line (the progress bar may stand before it on the terminal line)
    assert err.count("kvtrim: error:") == 1
    line = err.split("kvtrim: error:")[1].split("\n")[0]
    assert "per-head budgets" in line and "kv_bits=4" in line


def test_ragged_caches_decode_as_batch_rows_as_alone(model, prompt):
    """Caches with heads of different lengths run as the rows of one batch (``integrations.batched``,
    what ``kvtrim eval`` does) choose the tokens they choose decoded alone."""
    from kvtrim import decoding
    from kvtrim.integrations.batched import drive

    def programs():
        caches = {k: KVTrimCache(model, "snapkv", keep=k, window=8, heads="adaptive") for k in (0.2, 0.4)}
        with torch.no_grad():
            firsts = {k: decoding.run(model, decoding.prefill(c, prompt[0].tolist())) for k, c in caches.items()}
        assert all(any(layer.head_lengths is not None for layer in c.compressed_layers) for c in caches.values())
        return {k: decoding.decode(c, firsts[k], 8) for k, c in caches.items()}

    with kvtrim.attach(model):
        together = drive(model, programs())
        alone = drive(model, programs(), batch=False)
    assert together == alone
