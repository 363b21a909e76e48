"""The policy base class: the mechanism every KV method shares.

A policy is a small dataclass that decides and never stores: an engine calls ``after_attention``
once per layer per forward pass, after the layer's attention output has been computed from the
full set of keys (the stored ones plus the new ones), with a read-only view of the layer
(``kvtrim.decisions.LayerView``); the hook returns a decision (keep these slots, drop the lead,
drop these slots, merge) that the engine's storage applies (``kvtrim.storage`` for transformers,
``kvtrim.integrations.vllm.storage`` for vLLM's blocks). A policy imports no storage module. The
base class decides the phase and calls one hook:

* ``on_prefill`` - the first forward of a sequence (the prompt);
* ``on_turn`` - a later forward with more than one new token (a new user turn, a stream chunk,
  or a chunk of a chunked prefill);
* ``on_decode`` - a forward with one new token.

A score-based method only writes ``score()`` (higher = more worth keeping) and, if it keeps a
window of recent tokens, ``window_tokens()``; ``evict_by_score`` then keeps exactly the
top-``budget`` tokens of ``score`` with the protected ones forced in. Merging methods (Elastic
Cache) and streaming methods override the hooks instead. When and down to how many tokens a
method evicts is one integer rule, ``eviction_target``, which engines can evaluate without
tensors (to plan memory) and which the hooks follow (``kept_target``).

Do no harm by default (docs/methods-spec.md, "Always kept"):

* every compressing method keeps the **attention sinks**, the first ``SINKS`` tokens of the
  stream, and its **window** (``window_tokens``: the observation window, the recent share), whatever
  the budget: ``protected()`` always includes both and ``min_tokens`` counts them;
* a prompt too short for compression to save memory is **kept whole** (``kept_whole``): with a
  ``keep`` budget nothing is evicted while the stream holds at most ``min_length`` tokens.

Budgets (docs/methods-spec.md): either ``keep`` (a fraction of the tokens seen so far) or
``max_tokens`` (a fixed cap). A compressing method given neither takes its class's
``default_max_tokens`` (1024 unless the method says otherwise), so no method silently keeps
everything; ``keep=1.0`` asks for no eviction explicitly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtrim import validate
from kvtrim.decisions import Decisions, DropSlots, Keep, LayerView
from kvtrim.errors import KVTrimError
from kvtrim.scores import ScoreRequest, causal_column_sums, heads_shared, window_probs

POSITION_POLICIES = ("true", "reassigned", "compressed")

#: the budget (tokens per layer and KV head) a compressing method takes when given none
DEFAULT_MAX_TOKENS = 1024

#: Attention sinks kept by every compressing method: the first tokens of a stream draw a large share
#: of every later query's attention whatever their content, and evicting them derails the model
#: (Xiao et al., 2023, StreamingLLM, which keeps 4). What losing them did on the embedded model:
#: docs/methods.md, "Do no harm".
SINKS = 4

#: Prompts of at most this many tokens are kept whole under a ``keep`` budget (``Policy.kept_whole``).
#: Such a prompt is a short question in its chat template: every token is template or question, and
#: the most compression could save is a few MiB, under 1% of the weights' memory (docs/methods.md,
#: "Do no harm"), so eviction would drop the question's start for almost nothing. Methods with a
#: larger window raise it to twice their ``min_tokens``.
MIN_LENGTH = 64


@dataclass
class Policy:
    """Base class of all KV policies.

    Capability flags (class attributes a method sets; tools query them instead of method names):
    ``supports_streaming``, ``supports_turns``, ``takes_budget``, ``rewrites_forward``,
    ``needs_spans``, ``shares_prefill_scores``, ``needs_reconstruction`` -- each is documented where it is declared.

    Args:
        keep: fraction of the seen tokens to keep, in (0, 1]. Mutually exclusive with ``max_tokens``.
        max_tokens: fixed number of tokens to keep per layer (and per KV head). With neither,
            ``default_max_tokens`` (see the default-budget block of ``__post_init__``).
        position: position policy, one of ``true``, ``reassigned``, ``compressed``
            (docs/methods-spec.md); ``None`` takes the method's default.
        per_head: select a separate token set per KV head (scores averaged over the query heads
            of its group) instead of one set per layer.
    """

    keep: float | None = None
    max_tokens: int | None = None
    position: str | None = None
    per_head: bool = True

    name: ClassVar[str] = "base"
    #: parameters added after results were recorded, with their defaults: :meth:`describe` leaves a
    #: parameter out while it has this value, so results and eval keys recorded before it existed
    #: still name the same configuration (a resumed sweep does not recompute them)
    added_later: ClassVar[dict] = {}
    description: ClassVar[str] = ""
    default_position: ClassVar[str] = "true"
    #: can run on a stream longer than the model's context (needs reassigned positions + max_tokens)
    supports_streaming: ClassVar[bool] = False
    #: meaningful across several turns of one conversation (eviction at each new prompt or step)
    supports_turns: ClassVar[bool] = True
    #: accepts a compressing budget (``full`` does not)
    takes_budget: ClassVar[bool] = True
    #: changes the prefill forward pass itself (drops tokens from the hidden states, as FastV and
    #: HAE do): the prompt's forward then depends on the method, so it cannot be recorded once and
    #: replayed for each method (``kvtrim.recording``), and the hidden-state pruning integration
    #: asks the policy :meth:`take_hidden_state_keep` during each forward
    rewrites_forward: ClassVar[bool] = False
    #: acts only on tokens tagged with a modality span (image, video, document; ``kvtrim.spans``):
    #: a prompt without them is refused unless it has a budget of its own (``kvtrim.registry.spans_error``)
    needs_spans: ClassVar[bool] = False
    #: its prefill scores depend on the prompt only, not on the budget, so several budgets of the
    #: method on one prompt can compute them once: see :meth:`share_prefill_scores`
    shares_prefill_scores: ClassVar[bool] = False
    #: the parameter that gives every KV head the same budget (named in errors where ragged heads are refused)
    uniform_heads_setting: ClassVar[str] = "heads='uniform'"
    #: scores the prompt by a second forward that kvtrim runs after the prefill (KVzip's
    #: reconstruction, :mod:`kvtrim.reconstruction`): only entry points that drive the forwards
    #: themselves (``generate_ids``, ``kvtrim eval``) can run it; the others refuse it
    needs_reconstruction: ClassVar[bool] = False
    #: ``max_tokens`` used when neither ``keep`` nor ``max_tokens`` is given (methods that take a
    #: budget only); None: the method has no default budget (its budget is optional)
    default_max_tokens: ClassVar[int | None] = DEFAULT_MAX_TOKENS

    def __post_init__(self) -> None:
        # --- default budget: one rule for every entry point (CLI, create_policy, the classes) -----
        if self.takes_budget and self.keep is None and self.max_tokens is None and self.default_max_tokens is not None:
            self.max_tokens = self.default_max_tokens
        # ------------------------------------------------------------------------------------------
        if self.keep is not None and self.max_tokens is not None:
            raise KVTrimError(f"{self.name}: give either keep or max_tokens, not both")
        if self.keep is not None:
            self.keep = validate.fraction(self.keep, f"{self.name}: keep")
        if self.max_tokens is not None:
            self.max_tokens = validate.integer(self.max_tokens, f"{self.name}: max_tokens")
            if self.max_tokens < self.min_tokens:
                raise KVTrimError(
                    f"{self.name}: max_tokens={self.max_tokens} is smaller than the {self.min_tokens} tokens this "
                    f"method always keeps ({self.min_tokens_reason()}); use max_tokens >= {self.min_tokens}"
                )
        if self.position is not None and self.position not in POSITION_POLICIES:
            raise KVTrimError(f"{self.name}: unknown position policy {self.position!r}; allowed: {', '.join(POSITION_POLICIES)}")

    # --- budget --------------------------------------------------------------------------------
    @property
    def n_sinks(self) -> int:
        """Attention sinks this method always keeps (``SINKS``; StreamingLLM lets the user set it)."""
        return SINKS

    @property
    def min_window(self) -> int:
        """Recent (or otherwise method-specific) tokens always kept besides the sinks (default 1)."""
        return 1

    def window_reason(self) -> str:
        return "1 recent token"

    @property
    def min_tokens(self) -> int:
        """Tokens this method always keeps (the sinks + ``min_window``); a budget below it is refused."""
        return self.n_sinks + self.min_window

    def min_tokens_reason(self) -> str:
        return f"{self.n_sinks} attention sinks + {self.window_reason()}"

    @property
    def min_length(self) -> int:
        """Longest stream kept whole under a ``keep`` budget: ``max(MIN_LENGTH, 2 * min_tokens)``
        (below twice the always-kept tokens, eviction would save less than it keeps by rule)."""
        return max(MIN_LENGTH, 2 * self.min_tokens)

    def kept_whole(self, seen: int) -> bool:
        """True when nothing is evicted after ``seen`` tokens because the stream is too short for
        compression to save memory: a ``keep`` budget and ``seen <= min_length``. A ``max_tokens``
        cap is a memory bound the caller asked for and is always honoured (it cannot be below the
        sinks and window, ``min_tokens``)."""
        return self.keep is not None and self.keep < 1.0 and seen <= self.min_length

    def short_prompt_reason(self, n_prompt: int) -> str | None:
        """Why a prompt of ``n_prompt`` tokens is not compressed, or None when it is (JSON reports)."""
        if not self.compresses:
            return f"{self.name} keeps every token (no budget)"
        if self.kept_whole(n_prompt):
            return (f"the prompt has {n_prompt} tokens, at most {self.min_length}: kept whole, too short "
                    f"for compression to save memory")
        return None

    @property
    def position_policy(self) -> str:
        return self.position or self.default_position

    @property
    def compresses(self) -> bool:
        return self.max_tokens is not None or (self.keep is not None and self.keep < 1.0)

    def budget(self, seen: int) -> int:
        """Tokens to hold per layer and KV head after ``seen`` tokens (``seen`` while :meth:`kept_whole`)."""
        if self.max_tokens is not None:
            return self.max_tokens
        if self.keep is None or self.kept_whole(seen):
            return seen
        return max(self.min_tokens, math.floor(self.keep * seen + 1e-9))

    @property
    def uniform_layers(self) -> bool:
        """True when every layer keeps the same number of tokens (``budget``); False for per-layer
        budgets (``kvtrim.policies.layer_budgets``), which an engine whose layers share one block
        table cannot hold."""
        return True

    @property
    def uniform_heads(self) -> bool:
        """True when every KV head of a layer keeps the same number of tokens; False for per-head
        budgets (``kvtrim.policies.head_budgets``), which only a storage with one buffer per head holds
        (``kvtrim.ragged_storage``): vLLM's shared block tables, the low-bit storage and session files
        refuse them."""
        return True

    def can_stream(self) -> bool:
        """True when this configuration can run past the model's trained context."""
        return self.supports_streaming and self.position_policy == "reassigned" and self.max_tokens is not None

    def params(self) -> dict:
        """Every dataclass field as given (``position`` may be None): ``create_policy(name, **params())``
        rebuilds this policy."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def describe(self) -> dict:
        """``{"method": name, **params()}`` with ``position`` resolved to the effective position policy
        and tuples as lists (JSON-ready; results files and ``--json`` output read these keys)."""
        d = {"method": self.name, **self.params(), "position": self.position_policy}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()
                if not (k in self.added_later and v == self.added_later[k])}

    # --- hooks ---------------------------------------------------------------------------------
    # Every hook receives a read-only view of one layer (``kvtrim.decisions.LayerView``) and returns
    # what the storage should do: a decision, several in order, or None (nothing changes).
    def after_attention(self, layer: LayerView, query: torch.Tensor, key: torch.Tensor | None,
                        scaling: float) -> Decisions:
        """The hook an engine calls after a layer's attention: ``key`` is every stored key ``[B, Hkv, S, D]``,
        or None where the layer's heads store different numbers (per-head budgets: ``layer.head(h)``)."""
        if layer.phase == "prefill":
            return self.on_prefill(layer, query, key, scaling)
        if layer.phase == "turn":
            return self.on_turn(layer, query, key, scaling)
        return self.on_decode(layer, query, key, scaling)

    def on_prefill(self, layer: LayerView, query, key, scaling) -> Decisions:
        return self.evict_by_score(layer, query, key, scaling)

    def on_turn(self, layer: LayerView, query, key, scaling) -> Decisions:
        return self.on_prefill(layer, query, key, scaling)

    def on_decode(self, layer: LayerView, query, key, scaling) -> Decisions:
        """Default: decoded tokens are appended; nothing is evicted until the next prompt."""
        return None

    # --- when and to how many: one integer rule for every engine ----------------------------------
    def eviction_target(self, phase: str, seen: int, stored: int) -> int | None:
        """How many tokens this method keeps after a forward of ``phase`` that leaves a layer having
        seen ``seen`` and storing ``stored`` tokens, or None when it evicts nothing then.

        Integers only, so an engine can plan the memory a layer will hold without its tensors (the
        vLLM plugin's scheduler frees blocks by it). Default: evict down to the budget at each
        prompt (prefill, turn), never while decoding. A method whose hooks evict elsewhere overrides
        it, and its hooks use :meth:`kept_target` so that plan and deed are the same rule
        (``tests/test_cache_policies.py`` checks it for every method)."""
        if phase == "decode":
            return None
        budget = self.budget(seen)
        return budget if stored > budget else None

    def kept_target(self, layer: LayerView) -> int | None:
        """Tokens to keep at this hook: :meth:`eviction_target` as the storage can hold it
        (``LayerView.round_budget``: whole blocks in a paged storage), or None when nothing is evicted."""
        target = self.eviction_target(layer.phase, layer.seen, layer.length)
        if target is None:
            return None
        kept = layer.round_budget(target)
        return kept if kept < layer.length else None

    # --- score-based selection -------------------------------------------------------------------
    def score(self, layer: LayerView, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
        """Per-token scores ``[B, Hkv, stored]``; higher is more worth keeping."""
        raise NotImplementedError

    def window_tokens(self, layer: LayerView, budget: int) -> int:
        """The most recent tokens this method keeps at an eviction down to ``budget`` (its observation
        window or recent share); default 0."""
        return 0

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        """Boolean ``[B, Hkv, stored]`` of tokens that must be kept: the sinks and the window."""
        return self.always_kept(layer, self.window_tokens(layer, budget))

    def always_kept(self, layer: LayerView, n_recent: int) -> torch.Tensor:
        """Boolean ``[B, Hkv, stored]``: the first ``n_sinks`` tokens of the stream and the ``n_recent`` newest."""
        return self.always_kept_at(layer.positions, layer.seen, n_recent)

    def always_kept_at(self, positions: torch.Tensor, seen: int, n_recent: int) -> torch.Tensor:
        """:meth:`always_kept` for slots holding the stream indices ``positions`` after ``seen`` tokens."""
        mask = positions < self.n_sinks
        return mask | (positions >= seen - n_recent) if n_recent > 0 else mask

    #: True when :meth:`score` with ``per_head=False`` already returns the row every head of the layer
    #: shares (computed over every tensor-parallel rank's heads), so :meth:`shared` leaves it alone.
    scores_shared_by_heads = False

    def shared(self, scores: torch.Tensor, layer: LayerView) -> torch.Tensor:
        """``scores`` as :meth:`select` should rank them for ``layer``: unchanged with ``per_head``;
        otherwise the mean over every head of the layer, on every tensor-parallel rank
        (:func:`kvtrim.scores.heads_shared` with the layer's all-gathered
        :meth:`~kvtrim.decisions.LayerView.head_mean`), so all heads (and ranks) keep the same
        tokens. Computed once per decision; :meth:`ranking`'s own head mean is then a no-op."""
        if self.per_head or self.scores_shared_by_heads:
            return scores
        return heads_shared(scores.float(), layer)

    def ranking(self, scores: torch.Tensor, protected: torch.Tensor | None) -> torch.Tensor:
        """The float32 scores :meth:`select` ranks: averaged over the heads given unless ``per_head``
        (nothing to do when they are already one shared row: :meth:`shared`), protected tokens at +inf."""
        s = scores.float()
        if not self.per_head:
            s = heads_shared(s)
            if protected is not None:
                protected = protected.any(dim=1, keepdim=True).expand_as(scores)
        if protected is not None:
            s = s.masked_fill(protected, float("inf"))
        return s

    @staticmethod
    def few_dropped(s: torch.Tensor, budget: int) -> torch.Tensor | None:
        """When keeping the top-``budget`` of ``s [B, H, S]`` drops only a few tokens (at most 1/64 of
        them, or one: a decode step), those slots ``[B, H, S - budget]``; else None. Finding the
        bottom few costs less than ranking the top-``budget`` and sorting them; the set is the same
        (up to the order of exact ties)."""
        n_drop = s.shape[-1] - budget
        if 0 < n_drop <= max(1, s.shape[-1] // 64):
            return torch.topk(s, n_drop, dim=-1, largest=False, sorted=False).indices
        return None

    def select(self, scores: torch.Tensor, protected: torch.Tensor | None, budget: int) -> torch.Tensor:
        """Slots to keep: the top-``budget`` of ``scores`` with protected tokens forced in, ascending.
        Under tensor parallelism a ``per_head=False`` policy passes :meth:`shared` scores."""
        s = self.ranking(scores, protected)
        drop = self.few_dropped(s, budget)
        if drop is not None:
            keep = torch.ones(s.shape, dtype=torch.bool, device=s.device).scatter_(-1, drop, False)
            return keep.nonzero()[:, -1].view(*s.shape[:-1], budget)
        idx = torch.topk(s, budget, dim=-1, sorted=False).indices
        return idx.sort(dim=-1).values

    def evict_by_score(self, layer: LayerView, query, key, scaling, *, order_free: bool = False) -> Decisions:
        """Score the stored tokens and keep the top :meth:`kept_target` (None: nothing evicted).

        ``order_free``: the method keeps no meaning in its slots' order (its state lives per slot),
        so a decode step that drops only a few tokens returns them as :class:`DropSlots` (a storage
        may fill the holes with the newest tokens) instead of the kept slots."""
        budget = self.kept_target(layer)
        if budget is None:
            return None
        scores = self.shared(self.score(layer, query, key, scaling), layer)
        protected = self.protected(layer, budget)
        if order_free and layer.phase == "decode":
            drop = self.few_dropped(self.ranking(scores, protected), budget)
            if drop is not None:
                return DropSlots(drop)
        return Keep(self.select(scores, protected, budget))

    # --- capability hooks --------------------------------------------------------------------------
    def share_prefill_scores(self, memo: dict | None) -> "Policy":
        """Compute per-prompt prefill scores once for every policy given the same ``memo``; returns self.

        ``memo`` is a dict owned by the caller and used for **one prompt** only (a new prompt needs
        a new dict); ``None`` stops sharing. Policies that declare ``shares_prefill_scores`` store
        and reuse their budget-independent prefill scores in it (:meth:`prefill_scores`), so an
        evaluation of several budgets on one prompt scores it once. The scores are the same
        quantities as without sharing (H2O's are bit-identical; Elastic Cache's ``sum`` importance
        is then the head mean of the shared column sums, equal up to the order of summation).
        """
        self._score_memo = memo
        return self

    def sharing_prefill_scores(self, layer: LayerView) -> bool:
        """True when ``layer`` is in its prefill and a memo is shared (:meth:`share_prefill_scores`)."""
        return getattr(self, "_score_memo", None) is not None and layer.phase == "prefill"

    def prefill_scores(self, layer: LayerView, key: Hashable, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()``; during the prefill with a shared memo, computed once per ``(key, layer)``.

        ``key`` names the score and every parameter it depends on (not the budget).
        """
        memo = getattr(self, "_score_memo", None)
        if memo is None or layer.phase != "prefill":
            return compute()
        k = (key, layer.layer_idx)
        if k not in memo:
            memo[k] = compute()
        return memo[k]

    def prefill_column_sums(self, layer: LayerView, query: torch.Tensor, key: torch.Tensor,
                            scaling: float) -> torch.Tensor:
        """Causal softmax column sums of a prefill, ``[B, Hkv, G, S]`` (``kvtrim.scores.causal_column_sums``),
        shared through the memo of :meth:`share_prefill_scores` (H2O and Elastic Cache use the same sums).
        The sums the prefill's own attention computed are used when it handed them over
        (:meth:`wants_prefill_scores`), else they are computed from ``query`` and ``key``."""

        def compute() -> torch.Tensor:
            got = layer.attention_scores
            if got is not None and got.column_sums is not None and got.column_sums.shape[-1] == key.shape[-2]:
                return got.column_sums
            return causal_column_sums(query, key, scaling)

        return self.prefill_scores(layer, "column_sums", compute)

    def wants_prefill_scores(self, layer: LayerView) -> ScoreRequest | None:
        """What this prefill's hook will read from the prompt's attention probabilities, or None.

        kvtrim's attention function then computes the prefill attention with a kernel that also
        returns those scores from the same probabilities (``kvtrim.attention.fused``: column sums
        for H2O and Elastic Cache, the last-window rows for SnapKV and Inf-MLLM) and leaves them in
        ``layer.attention_scores`` while the hook runs; :meth:`prefill_column_sums` and
        :meth:`attention_window_probs` read them, or compute them where no attention function gave
        them (another engine, no native kernel, a sparse prefill). Asked before the prefill's
        attention, with the prompt already stored. Default: None (the attention stays the model's)."""
        return None

    @staticmethod
    def attention_window_probs(layer: LayerView, query: torch.Tensor, key: torch.Tensor, scaling: float,
                               window: int) -> torch.Tensor:
        """``window_probs(query, key, scaling, window)`` ``[B, Hkv, G, w, S]``: the prefill attention's own
        rows when it handed them over (:meth:`wants_prefill_scores`), else computed."""
        got = layer.attention_scores
        if got is not None and (rows := got.window(window, query.shape[-2])) is not None and rows.shape[-1] == key.shape[-2]:
            return rows
        return window_probs(query, key, scaling, window)

    def wants_decode_probs(self, layer: LayerView) -> bool:
        """True when this decode step's hook reads the step's attention probabilities. kvtrim's
        attention function then computes the step's attention itself
        (:func:`kvtrim.scores.decode_attention`) and leaves the probabilities in
        ``layer.decode_probs`` while the hook runs, so the method does not compute ``q @ K`` a second
        time (:meth:`decode_probs` reads them, or computes them where no attention function gave
        them). Default: False (the attention stays the model's SDPA)."""
        return False

    @staticmethod
    def decode_probs(layer: LayerView, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
        """This decode step's softmax row ``[B, Hkv, G, 1, S]``: the attention's own when it handed
        them over (:meth:`wants_decode_probs`; a low-bit storage always does), else computed from
        ``query`` and ``key``. A decode hook reads the step's attention here, never from ``key``
        directly: a low-bit storage's decode step hands the hook only its newest keys
        (``kvtrim.lowbit_storage``)."""
        if layer.decode_probs is not None:
            return layer.decode_probs
        return window_probs(query, key, scaling, 1)

    def take_hidden_state_keep(self, cache) -> "tuple[int, torch.Tensor] | None":
        """For ``rewrites_forward`` policies: ``(layer_idx, keep)`` once the policy decided, during this
        forward, that layers after ``layer_idx`` need only the prompt tokens ``keep`` (ascending
        indices into the forward's tokens); the request is handed over once. Default: None."""
        return None

    # --- helpers for subclasses ------------------------------------------------------------------
    @staticmethod
    def recent_mask(layer: LayerView, n: int) -> torch.Tensor:
        """Boolean ``[B, H, stored]``: the ``n`` most recent tokens by stream index."""
        pos = layer.positions
        return pos >= (layer.seen - n)

    @staticmethod
    def first_mask(layer: LayerView, n: int) -> torch.Tensor:
        """Boolean ``[B, H, stored]``: tokens among the first ``n`` of the stream (attention sinks)."""
        return layer.positions < n
