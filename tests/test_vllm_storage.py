"""The vLLM storage carries out a policy's decisions on paged blocks exactly as the transformers
storage does on its buffers (no vLLM needed: vLLM's paged cache is simulated with its CPU kernel's
block layout, keys channel-major and values token-major).

Both storages serve the same policy class, fed the same queries, keys and values step by step,
with the transformers storage's budget rounded to whole blocks as vLLM's is
(``KVTrimCache(block_size=...)``, ``kvtrim.decisions.paged_kept``). After every compaction each KV head keeps the same
tokens (stream indices) with bit-identical keys and values, in the blocks the ledger says, and the
blocks the scheduler frees are never read again."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from kvtrim.cache import KVTrimCache
from kvtrim.integrations.vllm import plan
from kvtrim.integrations.vllm.storage import FP8_KINDS, PLAIN, CacheFormat, PagedLayer, compose, read_tokens
from kvtrim.registry import create_policy
from kvtrim.scores import window_probs

BS, D, HKV, HQ = 8, 16, 2, 6
KEY_LAYOUT = torch.tensor([j * BS + t for t in range(BS) for j in range(D)])  # vLLM CPU: keys channel-major


def fp8_format(kind: str, k_scale: float = 0.7, v_scale: float = 1.3) -> CacheFormat:
    """vLLM's fp8 cache format with per-layer scales; ``encode`` here is torch's own cast (it stands in
    for vLLM's cache-write op, whose rounding the vLLM tier checks)."""
    f8 = FP8_KINDS[kind]

    def encode(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (k.float() / k_scale).to(f8).view(torch.uint8), (v.float() / v_scale).to(f8).view(torch.uint8)

    return CacheFormat(f8, k_scale, v_scale, torch.float32, encode)


POISON = {torch.float32: float("nan"), torch.uint8: 0x7F}  # freed blocks: NaN (0x7f is NaN in e4m3fn and e5m2)


class Pool:
    """A simulated paged KV cache: blocks ``[N, H, BS, D]`` for keys (in the kernel's layout) and values,
    float32 or the bytes of an fp8 format (``fmt``)."""

    def __init__(self, n: int = 400, seed: int = 0, fmt: CacheFormat = PLAIN, heads: int = HKV):
        self.fmt = fmt
        dtype = torch.uint8 if fmt.quantized else torch.float32
        self.k = torch.zeros(n, heads, BS, D, dtype=dtype)
        self.v = torch.zeros(n, heads, BS, D, dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randperm(n, generator=g)  # logical block -> physical block of the one request

    def write(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What vLLM's cache write does for the token at stream position ``pos`` (``k, v [H, D]``);
        returns the keys and values as the kernel then reads them (dequantized)."""
        if self.fmt.quantized:
            assert self.fmt.encode is not None
            k, v = self.fmt.encode(k, v)
        b = self.table[pos // BS]
        tm = plan.token_major(self.k[b:b + 1], KEY_LAYOUT)
        tm[0, :, pos % BS] = k
        self.k[b:b + 1] = plan.stored(tm.contiguous(), KEY_LAYOUT)
        self.v[b, :, pos % BS] = v
        return self.fmt.decode(k, "keys"), self.fmt.decode(v, "values")

    def read(self, which: str, blocks: torch.Tensor, n: int, raw: bool = False) -> torch.Tensor:
        cache, layout = (self.k, KEY_LAYOUT) if which == "keys" else (self.v, None)
        data = read_tokens(cache, blocks, n, layout)
        return data if raw else self.fmt.decode(data, which)


def _steps(prompt: int, chunk: int, decode: int):
    out, ctx = [], 0
    while ctx < prompt:
        q = min(chunk, prompt - ctx)
        out.append((ctx, q))
        ctx += q
    return out + [(c, 1) for c in range(prompt, prompt + decode)]


def _decide(pool: Pool, ledger: plan.Ledger, layer: PagedLayer, policy, ctx: int, q: int, query) -> int:
    """vLLM's side of a forward of ``q`` new tokens after the pool holds them: the plan's kept count,
    then the policy's hook on the paged layer, reading the pool; returns the kept count."""
    kept = ledger.end_step(policy, ctx, q)
    live = pool.table[ledger.live]
    layer.append(ctx, q)
    layer.reader = lambda which: pool.read(which, live, layer.length).unsqueeze(0)
    key_all = layer.reader("keys")
    if layer.phase == "decode" and policy.wants_decode_probs(layer.view):
        layer.decode_probs = window_probs(query, key_all, D ** -0.5, 1)
    layer.decide(policy, query, key_all, D ** -0.5, kept)
    layer.reader, layer.decode_probs = None, None
    return kept


CASES = {
    "full": {},
    "snapkv": {"keep": 0.3, "window": 8},
    "snapkv_shared": {"keep": 0.3, "window": 8, "per_head": False, "chunk": 3},
    "h2o": {"keep": 0.3},
    "tova": {"keep": 0.3},
    "tova_heads": {"keep": 0.3, "per_head": True, "window": 4},
    "streaming_llm": {"max_tokens": 30},
    "inf_mllm": {"max_tokens": 40, "window": 8, "decode_cap": 10},
    "elastic": {"keep": 0.3, "distance": 6},
    "elastic_frequency": {"keep": 0.3, "eviction": "frequency", "proportional": True},
}


@pytest.mark.parametrize("kind", [None, "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("chunk", [1000, 37])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_storage_keeps_what_the_transformers_storage_keeps(model, name, chunk, kind):
    """``kind``: vLLM's fp8 cache; the transformers storage is then fed the keys and values as the
    kernel reads them back (dequantized), and the paged one must keep the same tokens with the same
    bytes (compaction moves bytes, never re-quantizes)."""
    method = name.split("_")[0] if name.startswith(("snapkv", "elastic", "tova")) else name
    if kind is not None and method == "elastic":
        pytest.skip("a merge is quantized again in an fp8 cache, the transformers storage keeps it in float: "
                    "test_fp8_compaction_moves_bytes_and_writes_merged_tokens_through_the_encoder checks merges")
    fmt = PLAIN if kind is None else fp8_format(kind)
    params = {"position": "true", **CASES[name]}
    ref_policy, paged_policy = create_policy(method, **params), create_policy(method, **params)
    cache = KVTrimCache(model, ref_policy, block_size=BS)  # evictions rounded to whole blocks, as vLLM's
    ref = cache.compressed_layers[0]
    pool = Pool(fmt=fmt)
    paged = PagedLayer(0, HKV, BS)
    ledger = plan.Ledger(BS)
    g = torch.Generator().manual_seed(3)
    compactions = 0
    for ctx, q in _steps(150, chunk, 60):
        # -- the step begins: vLLM's side frees and moves what the last forward decided
        freed, before = ledger.begin_step(ctx, q)
        if freed:
            gone = set(freed)
            after = [i for i in before if i not in gone]
            paged.compact(pool.k, pool.v, pool.table[before], pool.table[after], (KEY_LAYOUT, None), fmt)
            compactions += 1
            live = pool.table[after]
            got_k = pool.read("keys", live, paged.length)
            got_v = pool.read("values", live, paged.length)
            # the same tokens per head (H2O's storage may hold them in another slot order) and the same bits
            for h in range(HKV):
                order_r, order_p = ref.positions[0, h].argsort(), paged.positions[0, h].argsort()
                assert torch.equal(ref.positions[0, h, order_r], paged.positions[0, h, order_p])
                assert torch.equal(ref.keys[0, h, order_r], got_k[h, order_p])
                assert torch.equal(ref.values[0, h, order_r], got_v[h, order_p])
            for key in set(ref.token_state) | set(paged.token_state):
                for h in range(HKV):
                    order_r, order_p = ref.positions[0, h].argsort(), paged.positions[0, h].argsort()
                    assert torch.equal(ref.state_view(key)[0, h, order_r], paged.token_state[key][0, h, order_p])
            pool.k[pool.table[freed]] = POISON[pool.k.dtype]  # freed blocks are never read again
            pool.v[pool.table[freed]] = POISON[pool.v.dtype]
        # -- the step's forward: new keys/values/queries for both storages
        k = torch.randn(1, HKV, q, D, generator=g)
        v = torch.randn(1, HKV, q, D, generator=g)
        query = torch.randn(1, HQ, q, D, generator=g)
        read_back = [pool.write(ctx + i, k[0, :, i], v[0, :, i]) for i in range(q)]
        k = torch.stack([kk for kk, _ in read_back], dim=1).unsqueeze(0)  # what the kernel attends to
        v = torch.stack([vv for _, vv in read_back], dim=1).unsqueeze(0)
        keys_ref, _ = ref.update(k, v)
        cache.after_attention(ref, query, keys_ref, D ** -0.5)
        kept = _decide(pool, ledger, paged, paged_policy, ctx, q, query)
        assert ref.length == kept  # the transformers storage applied at once what vLLM's applies next step
    if method != "full":
        assert compactions > 0


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_compaction_moves_bytes_and_writes_merged_tokens_through_the_encoder(kind):
    from kvtrim.errors import KVTrimError
    from kvtrim.integrations.vllm.storage import Compaction

    fmt = fp8_format(kind)
    pool = Pool(fmt=fmt)
    g = torch.Generator().manual_seed(5)
    n = 3 * BS + 5
    for pos in range(n):
        pool.write(pos, 3 * torch.randn(HKV, D, generator=g), torch.randn(HKV, D, generator=g))
    before = pool.table[:4]
    raw_k, raw_v = pool.read("keys", before, n, raw=True), pool.read("values", before, n, raw=True)
    keep = torch.stack([torch.arange(0, 2 * (BS + 5), 2), torch.arange(BS, 2 * BS + 5)])  # [H, K]: two kept blocks' worth
    after = before[[0, 3]]

    # a plain keep: the kept tokens' bytes move as they are (no encoder needed, none is called)
    layer = PagedLayer(0, HKV, BS)
    layer.append(0, n)
    layer.pending = Compaction(keep.unsqueeze(0))
    bare = CacheFormat(fmt.fp8, fmt.k_scale, fmt.v_scale)  # no encode: a re-quantization would raise
    layer.compact(pool.k, pool.v, before, after, (KEY_LAYOUT, None), bare)
    got_k, got_v = pool.read("keys", after, BS + 5, raw=True), pool.read("values", after, BS + 5, raw=True)
    for h in range(HKV):
        assert torch.equal(got_k[h], raw_k[h, keep[h]]) and torch.equal(got_v[h], raw_v[h, keep[h]])

    # a merge: the merged tokens are written as the encoder makes them, in the kernel's layout
    mk, mv = torch.randn(1, HKV, BS + 5, D, generator=g), torch.randn(1, HKV, BS + 5, D, generator=g)
    pool2 = Pool(fmt=fmt)
    pool2.k[before], pool2.v[before] = pool.k[before], pool.v[before]
    layer = PagedLayer(0, HKV, BS)
    layer.append(0, BS + 5)
    layer.pending = Compaction(torch.arange(BS + 5).expand(1, HKV, BS + 5), mk, mv)
    with pytest.raises(KVTrimError, match="merged tokens cannot be written to an fp8 cache"):
        layer.compact(pool2.k, pool2.v, after, after, (KEY_LAYOUT, None), bare)
    layer.compact(pool2.k, pool2.v, after, after, (KEY_LAYOUT, None), fmt)
    want_k, want_v = fmt.encode(mk[0], mv[0])
    assert torch.equal(pool2.read("keys", after, BS + 5, raw=True), want_k)
    assert torch.equal(pool2.read("values", after, BS + 5, raw=True), want_v)
    assert torch.equal(pool2.read("keys", after, BS + 5), fmt.decode(want_k, "keys"))


def test_fp8_decode_uses_the_format_and_each_halfs_scale():
    fmt = fp8_format("fp8_e4m3", k_scale=0.5, v_scale=4.0)
    raw = torch.tensor([0x38, 0xB8, 0x40, 0x7E], dtype=torch.uint8)  # e4m3fn: 1, -1, 2, 448
    assert fmt.decode(raw, "keys").tolist() == [0.5, -0.5, 1.0, 224.0]
    assert fmt.decode(raw, "values").tolist() == [4.0, -4.0, 8.0, 1792.0]
    e5 = fp8_format("fp8_e5m2", k_scale=1.0)
    assert e5.decode(torch.tensor([0x3C, 0x7B], dtype=torch.uint8), "keys").tolist() == [1.0, 57344.0]
    assert PLAIN.decode(raw, "keys") is raw  # a float cache is read as it is


def test_a_merge_into_a_byte_cache_without_its_format_is_refused():
    from kvtrim.errors import KVTrimError
    from kvtrim.integrations.vllm.storage import Compaction

    pool = Pool(fmt=fp8_format("fp8_e4m3"))
    layer = PagedLayer(0, HKV, BS)
    layer.append(0, BS)
    idx = torch.arange(BS).expand(1, HKV, BS)
    layer.pending = Compaction(idx, torch.randn(1, HKV, BS, D), torch.randn(1, HKV, BS, D))
    with pytest.raises(KVTrimError, match=r"torch\.float32 tokens cannot be written to a torch\.uint8 cache"):
        layer.compact(pool.k, pool.v, pool.table[:1], pool.table[:1], (KEY_LAYOUT, None))


def _paged_step(pool: Pool, ledger: plan.Ledger, layer: PagedLayer, policy, ctx: int, q: int, k, v, query) -> bool:
    """One forward of ``q`` new tokens on one rank: the blocks the ledger freed compacted away, the new
    keys and values written, the policy's hook run (:func:`_decide`); True when blocks were freed."""
    freed, before = ledger.begin_step(ctx, q)
    if freed:
        gone = set(freed)
        after = [b for b in before if b not in gone]
        layer.compact(pool.k, pool.v, pool.table[before], pool.table[after], (KEY_LAYOUT, None))
    for j in range(q):
        pool.write(ctx + j, k[0, :, j], v[0, :, j])
    _decide(pool, ledger, layer, policy, ctx, q, query)
    return bool(freed)


class Ranks:
    """A simulated tensor-parallel group of ``n`` ranks, each run in its own thread: ``gather_for(r)``
    is rank ``r``'s ``PagedLayer.gather_ranks`` (every rank's tensor, stacked in rank order)."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list = [None] * n

    def gather_for(self, rank: int):
        def gather(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t
            self.barrier.wait()
            out = torch.stack(self.slots)
            self.barrier.wait()  # no rank hands in its next tensor before every rank has read this one
            return out
        return gather


def _in_threads(work) -> None:
    errors: list = []

    def run(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("name", ["elastic", "elastic_frequency", "tova", "snapkv_shared", "h2o_shared"])
def test_under_tensor_parallelism_ranks_keep_what_one_storage_of_every_head_keeps(name):
    """A score averaged over every attention head (Elastic Cache's anchors, TOVA's ranking, any
    method's ``per_head=false``: one token set per layer). Split over two tensor-parallel ranks (one
    KV head and its query heads each), each rank's storage averages over all ranks' heads
    (``LayerView.head_mean``), so the ranks keep and merge the same tokens as one storage holding
    every head -- not each rank its own choice."""
    method = name.split("_")[0]
    params = {"position": "true", **CASES.get(name, {"keep": 0.3, "per_head": False})}
    whole = PagedLayer(0, HKV, BS)
    whole_policy = create_policy(method, **params)
    group = Ranks(HKV)
    ranks = [PagedLayer(0, 1, BS) for _ in range(HKV)]
    policies = [create_policy(method, **params) for _ in range(HKV)]
    for r, layer in enumerate(ranks):
        layer.gather_ranks = group.gather_for(r)
    pools = [Pool(heads=HKV)] + [Pool(heads=1) for _ in range(HKV)]
    ledgers = [plan.Ledger(BS) for _ in range(HKV + 1)]
    g = torch.Generator().manual_seed(5)
    hq = HQ // HKV
    compactions = 0

    def step(i, layer, policy, ctx, q, k, v, query):
        return _paged_step(pools[i], ledgers[i], layer, policy, ctx, q, k, v, query)

    for ctx, q in _steps(150, 1000, 60):
        k, v = torch.randn(1, HKV, q, D, generator=g), torch.randn(1, HKV, q, D, generator=g)
        query = torch.randn(1, HQ, q, D, generator=g)
        compactions += step(0, whole, whole_policy, ctx, q, k, v, query)
        _in_threads([
            functools.partial(step, r + 1, ranks[r], policies[r], ctx, q, k[:, r:r + 1], v[:, r:r + 1],
                              query[:, r * hq:(r + 1) * hq])
            for r in range(HKV)
        ])
        for r, layer in enumerate(ranks):
            assert layer.length == whole.length
            assert torch.equal(layer.positions[0, 0], whole.positions[0, r]), (name, ctx, r)
            want, got = whole.pending, layer.pending
            assert (want is None) == (got is None)
            if want is not None and want.keys is not None:
                assert torch.allclose(got.keys[0, 0], want.keys[0, r], atol=1e-6)
                assert torch.allclose(got.values[0, 0], want.values[0, r], atol=1e-6)
    assert compactions > 0


@pytest.mark.parametrize("name", ["tova", "snapkv_shared", "h2o_shared", "inf_mllm_shared"])
def test_a_shared_ranking_gathers_once_per_decision(name):
    """``per_head=false`` under tensor parallelism: the head mean over every rank (one all-gather)
    is taken once per eviction (``Policy.shared``), not again when the scores are chunked or ranked
    (TOVA's score averages over the heads itself; SnapKV and Inf-MLLM here also keep whole chunks)."""
    method = name.rsplit("_", 1)[0] if name.endswith("_shared") else name
    params = {"position": "true", **CASES.get(name, {"keep": 0.3, "per_head": False})}
    if method == "inf_mllm":
        params = {"position": "true", **CASES["inf_mllm"], "per_head": False, "chunk": 4}
    group = Ranks(HKV)
    ranks = [PagedLayer(0, 1, BS) for _ in range(HKV)]
    policies = [create_policy(method, **params) for _ in range(HKV)]
    gathers, decisions = [0] * HKV, [0] * HKV
    for r, (layer, policy) in enumerate(zip(ranks, policies)):
        inner, hook = group.gather_for(r), policy.after_attention

        def counted_gather(x, r=r, inner=inner):
            gathers[r] += 1
            return inner(x)

        def counted_hook(*a, r=r, hook=hook):
            d = hook(*a)
            decisions[r] += d is not None
            return d
        layer.gather_ranks = counted_gather
        object.__setattr__(policy, "after_attention", counted_hook)
    pools = [Pool(heads=1) for _ in range(HKV)]
    ledgers = [plan.Ledger(BS) for _ in range(HKV)]
    g = torch.Generator().manual_seed(6)
    hq = HQ // HKV

    def step(r, ctx, q, k, v, query):
        _paged_step(pools[r], ledgers[r], ranks[r], policies[r], ctx, q, k, v, query)

    for ctx, q in _steps(150, 400, 60):
        k, v = torch.randn(1, HKV, q, D, generator=g), torch.randn(1, HKV, q, D, generator=g)
        query = torch.randn(1, HQ, q, D, generator=g)
        _in_threads([functools.partial(step, r, ctx, q, k[:, r:r + 1], v[:, r:r + 1], query[:, r * hq:(r + 1) * hq])
                     for r in range(HKV)])
    assert decisions[0] > 0, name
    assert gathers == decisions, (name, gathers, decisions)


def test_compose_applies_decisions_in_order():
    from kvtrim.decisions import DropLead, DropSlot, Keep, Merge

    idx = torch.tensor([[[0, 2, 3, 5, 6, 7], [1, 2, 3, 4, 6, 7]]])
    mk, mv = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    c = compose([Merge(idx, mk, mv, {"s": torch.arange(12.0).view(1, 2, 6)}), DropSlot(1), DropLead(1, 2)], 8, 2)
    assert c is not None and c.kept == 3
    assert c.idx.tolist() == [[[0, 6, 7], [1, 6, 7]]]
    assert torch.equal(c.keys, mk[:, :, [0, 4, 5]]) and torch.equal(c.values, mv[:, :, [0, 4, 5]])
    assert c.states["s"].tolist() == [[[0.0, 4.0, 5.0], [6.0, 10.0, 11.0]]]
    assert compose(None, 8, 2) is None
    assert compose(Keep(idx), 8, 2).idx is idx


def test_a_hook_that_disagrees_with_its_plan_is_refused():
    from kvtrim.errors import KVTrimError

    policy = create_policy("snapkv", keep=0.5, window=4, position="true")
    layer = PagedLayer(0, HKV, BS)
    layer.append(0, 100)
    keys = torch.randn(1, HKV, 100, D)
    with pytest.raises(KVTrimError, match="kept 52 of 100 tokens in layer 0, its eviction_target plans 100"):
        layer.decide(policy, torch.randn(1, HQ, 100, D), keys, 0.25, 100)


def _text_methods() -> list[str]:
    from kvtrim.registry import get_policy_class, method_names

    return [m for m in method_names() if not get_policy_class(m).rewrites_forward]


@pytest.mark.parametrize("method", _text_methods())
@pytest.mark.parametrize("position", ["true", None])
def test_every_methods_hooks_do_what_its_eviction_target_plans(model, method, position):
    """What an engine plans from ``Policy.eviction_target`` (integers only) is what the method's hooks
    then keep, at every prompt chunk, turn and decode step, for every registered text method."""
    from kvtrim.decisions import planned_length

    params = {} if method == "full" else {"max_tokens": 40} if method in ("streaming_llm", "inf_mllm") else {"keep": 0.3}
    policy = create_policy(method, **params, **({"position": position} if position else {}))
    cache = KVTrimCache(model, policy)
    g = torch.Generator().manual_seed(4)
    for ctx, q in [*_steps(120, 50, 0), *[(c, 1) for c in range(120, 400)], (400, 30), (430, 1)]:
        for layer in cache.compressed_layers:
            k, v = torch.randn(1, HKV, q, D, generator=g), torch.randn(1, HKV, q, D, generator=g)
            keys, _ = layer.update(k, v)
            target = policy.eviction_target(layer.phase, layer.seen, layer.length)
            want = planned_length(target, layer.length)
            cache.after_attention(layer, torch.randn(1, HQ, q, D, generator=g), keys, D ** -0.5)
            assert layer.length == want, (ctx, q, layer.layer_idx)
