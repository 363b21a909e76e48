"""``expected_attention``: a query-agnostic score, the attention future queries are expected to pay
(after the idea of Expected Attention, Devoto et al., 2025; written for kvtrim from the idea).

SnapKV and Inf-MLLM score keys by the attention of the current prompt's last queries: they keep what
the current question needs and can drop what the next question asks for (a chat, a session, a
document asked many things). This method scores each key by the attention the queries of the *next*
``future`` positions are expected to pay it, estimated from the statistics of the queries seen so far:

1. Per layer and query head, the running mean and the mean square of every query seen at a prompt
   (the first prompt and each later turn; decode steps do not add), taken before RoPE: each query is
   rotated back from its position. Kept in the layer's state, so a session carries them on.
2. The next ``future`` queries are modelled as those queries placed at the next ``future`` positions:
   RoPE's rotation is averaged over the positions (``kvtrim.rope.rotation_moments``), which gives the
   mean ``mu`` of the future queries exactly and the **diagonal** of their covariance ``Sigma``
   (the off-diagonal terms are dropped: the estimate treats the dims as independent).
3. For a Gaussian query ``q ~ N(mu, Sigma)`` the expected unnormalised attention of key ``k`` is
   ``E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2)`` (``s`` the attention scale, ``1/sqrt(d)``);
   normalised over the keys it is the expected attention weight. It is averaged over the query heads
   of each KV head (GQA) and, with ``vnorm``, multiplied by the norm of the key's value (a key whose
   value is small changes the output little), then max-pooled along the keys (``kernel``, as SnapKV:
   a number split into single-digit tokens survives whole).

The top tokens per KV head are kept, plus the attention sinks and the newest ``window`` tokens (the
current question). Where the engine gives no rotary embedding (an unknown RoPE, or vLLM) the queries
are used as rotated and the score is that of their mean, without the average over future positions.
Eviction runs at each prompt (prefill and turns) down to the budget; decoded tokens are appended.
``layers`` shares the total budget unevenly among the layers (``kvtrim.policies.layer_budgets``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtrim import validate
from kvtrim.policies.layer_budgets import LayerBudgets
from kvtrim.rope import partner_of, rotation_moments
from kvtrim.scores import ScoreRequest, group_reduce, grouped_queries, pool_scores

#: the per-layer state holding the running query statistics (lists of floats, saved with a session)
STATS = "expected_attention_stats"
#: the current prompt's window scores between score() and protected() (``question > 0``; never saved)
QUESTION = "expected_attention_question"


@dataclass
class ExpectedAttention(LayerBudgets):
    """Args:
        window: the newest tokens always kept (default 32, SnapKV's window: the current question).
        future: the next positions whose queries the score predicts (default 512); RoPE's rotation
            is averaged over them.
        covariance: add the variance term ``k^T Sigma k / (2 d)`` (default True); False scores by the
            mean future query alone.
        vnorm: multiply each key's expected attention by the norm of its value (default True).
        kernel: max-pooling width along the keys (default 7, odd; 1 = no pooling).
        question: the share of the budget (after the sinks and window) given first to the tokens the
            current prompt's last ``window`` queries attend to most (SnapKV's score, pooled the same
            way); the rest goes by expected attention. Default 0.0: query-agnostic. A share between
            keeps what the current question needs and what later ones are expected to.
        layers: "uniform" (default), "pyramid" or "adaptive" (``kvtrim.policies.layer_budgets``).
    """

    window: int = 32
    future: int = 512
    covariance: bool = True
    vnorm: bool = True
    kernel: int = 7
    question: float = 0.0
    layers: str = "uniform"

    name = "expected_attention"
    description = "query-agnostic: expected attention of the next queries from past query statistics, at each prompt"

    def __post_init__(self) -> None:
        self.window = validate.integer(self.window, "expected_attention: window", minimum=1)
        self.future = validate.integer(self.future, "expected_attention: future", minimum=1)
        self.covariance = validate.boolean(self.covariance, "expected_attention: covariance")
        self.vnorm = validate.boolean(self.vnorm, "expected_attention: vnorm")
        self.kernel = validate.odd_integer(self.kernel, "expected_attention: kernel")
        self.question = validate.number(self.question, "expected_attention: question", minimum=0.0, maximum=1.0)
        self.check_layers()
        super().__post_init__()

    @property
    def min_window(self) -> int:
        return self.window

    def window_reason(self) -> str:
        return f"the window of the {self.window} newest tokens"

    def window_tokens(self, layer, budget):
        return min(self.window, layer.n_new)

    def protected(self, layer, budget):
        """The sinks and window, and with ``question > 0`` the current prompt's share (its last queries'
        top tokens: ``question`` of the budget left after the sinks and window)."""
        base = super().protected(layer, budget)
        pending = layer.state.pop(QUESTION, None)
        if self.question == 0 or pending is None or base is None:
            return base
        n = math.floor(self.question * max(0, budget - int(base.sum(dim=-1).max())))
        if n == 0:
            return base
        s = pending.masked_fill(base, float("-inf"))
        top = torch.topk(s, n, dim=-1).indices
        return base.clone().scatter_(-1, top, True)

    def wants_prefill_scores(self, layer) -> ScoreRequest | None:
        return ScoreRequest(window=self.window) if self.question > 0 and self.wants_scores(layer) else None

    # --- query statistics ----------------------------------------------------------------------------
    def learn(self, layer, query: torch.Tensor) -> None:
        """Add this forward's queries (``[1, Hq, n, D]``, rotated where the layer's newest ``n`` slots
        are) to the layer's running sums, before RoPE: of ``q``, ``q**2`` and ``q * partner(q)``."""
        q = query[0].double()  # [Hq, n, D]: batch 1 (the storage refuses more)
        rotary = layer.rotary
        if rotary is not None:
            q = rotary.rotate(q, -layer.rotations[0, 0, layer.length - query.shape[-2]:])
            cross = q * partner_of(rotary.layout)(q)
        else:
            cross = torch.zeros_like(q)
        sums = [q.sum(dim=1), (q * q).sum(dim=1), cross.sum(dim=1)]
        n = q.shape[1]
        old = layer.state.get(STATS)
        if old is not None:
            sums = [s + torch.tensor(o, dtype=torch.float64, device=s.device) for s, o in zip(sums, old["sums"])]
            n += old["n"]
        layer.state[STATS] = {"n": n, "sums": [s.tolist() for s in sums]}

    @staticmethod
    def query_means(layer, device=None) -> tuple[torch.Tensor, ...]:
        """The means ``[Hq, D]`` (float64) of ``q``, ``q**2`` and ``q * partner(q)`` over every query
        the layer saw at a prompt (:meth:`learn`)."""
        st = layer.state[STATS]
        return tuple(torch.tensor(s, dtype=torch.float64, device=device) / st["n"] for s in st["sums"])

    def future_moments(self, layer, m1, m2, mx) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and diagonal variance ``[Hq, D]`` of the queries of the next ``future`` positions."""
        rotary = layer.rotary
        if rotary is None:
            return m1, (m2 - m1 * m1).clamp_min(0)
        start = int(layer.rotations[0, 0, layer.length - 1]) + 1
        r = rotation_moments(rotary.inv_freq, torch.arange(start, start + self.future, device=m1.device),
                             rotary.layout)
        d, partner = r.cos.shape[-1], partner_of(rotary.layout)
        rot, rest = (m1[..., :d], m1[..., d:]), (m2[..., :d], m2[..., d:])
        mean = torch.cat((rot[0] * r.cos + partner(rot[0]) * r.sin, rot[1]), dim=-1)
        # partner(q)**2 per dim is q**2 of the partner dim (the sign goes): partner(m2) up to sign
        p2 = partner(rest[0]).abs()
        square = torch.cat((rest[0] * r.cos2 + p2 * r.sin2 + 2 * mx[..., :d] * r.cos_sin, rest[1]), dim=-1)
        return mean, (square - mean * mean).clamp_min(0)

    # --- the score ---------------------------------------------------------------------------------
    def score(self, layer, query, key, scaling):
        if self.question > 0:  # the current prompt's share, read by protected()
            probs = self.attention_window_probs(layer, query, key, scaling, self.window)  # [B, Hkv, G, w, S]
            layer.state[QUESTION] = self.pool(group_reduce(probs.sum(dim=-2), "mean"))
        m1, m2, mx = self.query_means(layer, key.device)
        mean, var = self.future_moments(layer, m1, m2, mx)
        n_kv = key.shape[1]
        k = key.float()  # [B, Hkv, S, D]
        mu = grouped_queries(mean.float().unsqueeze(0).unsqueeze(-2), n_kv).squeeze(-2)  # [1, Hkv, G, D]
        logits = torch.einsum("bhgd,bhsd->bhgs", mu, k) * scaling
        if self.covariance:
            sig = grouped_queries(var.float().unsqueeze(0).unsqueeze(-2), n_kv).squeeze(-2)
            logits = logits + torch.einsum("bhgd,bhsd->bhgs", sig, k * k) * (scaling * scaling / 2)
        s = torch.softmax(logits, dim=-1).mean(dim=2)  # [B, Hkv, S]
        if self.vnorm:
            s = s * layer.values.float().norm(dim=-1)
        return self.pool(s)

    def pool(self, s: torch.Tensor) -> torch.Tensor:
        """``kernel``-wide max pooling of ``[B, H, S]`` scores along the keys."""
        return pool_scores(s, self.kernel, "max")

    def on_prefill(self, layer, query, key, scaling):
        self.learn(layer, query)  # also where nothing is evicted: the statistics cover every prompt
        return super().on_prefill(layer, query, key, scaling)
