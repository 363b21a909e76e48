"""The decoding stepper: the one place where tokens are fed through a compressing cache and chosen.

Every loop in kvtrim that feeds a prompt and decodes new tokens (``generate_ids``, sessions, the
evaluation programs, the benchmarks) is built from the pieces here, so the position rule, the
chunk rule, the context check and greedy/sampling selection exist once.

Decoding is written as *programs*: generators that ``yield Step(cache, ids)`` (feed these ids
through this cache) and receive the float32 logits of that forward back. A program does not care
who runs it: :func:`run` serves each step with one batch-1 forward (the normal path), and the
batched driver in :mod:`kvtrim.integrations.batched` serves the steps of many programs as rows of
one batch. Two programs cover the loops kvtrim needs:

* :func:`prefill` feeds a prompt, in chunks when asked to, and returns the last logits;
* :func:`decode` chooses a token from the logits (greedy or sampling), feeds it, and repeats
  until a stop token, a stop predicate, or ``max_new_tokens``.

Position rule (``next_positions``): under the ``true`` position policy a new token's position is
its stream index (transformers derives it from ``get_seq_length()``, which a ``KVTrimCache``
reports as tokens *seen*); under ``reassigned``/``compressed`` it is its slot in the cache
(tokens *stored*), passed explicitly as ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtrim import validate
from kvtrim.errors import KVTrimError

if TYPE_CHECKING:
    from kvtrim.cache import KVTrimCache
    from kvtrim.policies.base import Policy

#: The largest and smallest chunks the chunk rule hands out when a prompt must be split to fit the context.
MAX_AUTO_CHUNK = 1024
MIN_AUTO_CHUNK = 64
#: The smallest prefill chunk a user may ask for: one token would be a decode step, not a "turn".
MIN_PREFILL_CHUNK = 2


@dataclass
class Clock:
    """Decode time charged to one program: its share of each batched step (step time / rows)."""

    seconds: float = 0.0
    steps: int = 0
    rows: int = 0  # sum over steps of the rows that shared it

    @property
    def mean_rows(self) -> float:
        return self.rows / self.steps if self.steps else 1.0

    def charge(self, seconds: float, rows: int) -> None:
        self.seconds += seconds / rows
        self.steps += 1
        self.rows += rows


@dataclass
class Step:
    """Request: feed ``ids`` through ``cache``; the program receives float32 logits back.

    ``[vocab]`` for the last position, or ``[len(ids), vocab]`` with ``all_logits``. ``extra`` are
    additional model inputs of this forward (a vision-language model's ``pixel_values`` ...);
    a step with ``extra`` is never batched with others.
    """

    cache: "KVTrimCache"
    ids: list[int]
    all_logits: bool = False
    clock: Clock | None = None
    extra: dict | None = None


@dataclass
class Wait:
    """Request: the result of the program registered under ``key`` (batched driver only)."""

    key: Hashable


Program = Generator["Step | Wait", Any, Any]


@dataclass(frozen=True)
class Sampler:
    """How a token is chosen from logits: greedy (the default) or sampling.

    Sampling divides the logits by ``temperature`` (> 0), keeps the ``top_k`` likeliest tokens
    (0: all), of those the smallest set whose probability reaches ``top_p`` (in (0, 1]; 1: all), and
    draws from what is left, renormalised: the usual order of the filters, as in transformers'
    ``generate``. The values are checked when the sampler is made (``KVTrimError``), greedy or not, so
    a bad one is refused where it is given rather than ignored: ``do_sample`` a bool, a finite
    ``temperature`` > 0, ``top_p`` a fraction in (0, 1], ``top_k`` a non-negative integer (the same
    wording as the command line's checks of ``--temperature``, ``--top-p`` and ``--top-k``).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise KVTrimError(f"do_sample must be True or False, got {self.do_sample!r}")
        # held as floats: an int temperature such as 2**64 is a valid number but not a tensor scalar
        object.__setattr__(self, "temperature", validate.number(self.temperature, "temperature", minimum=0, min_open=True))
        object.__setattr__(self, "top_p", validate.fraction(self.top_p, "top_p"))
        validate.integer(self.top_k, "top_k", minimum=0)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """One token id from ``logits`` (``[vocab]``)."""
        if not self.do_sample:
            return int(logits.argmax())
        logits = logits.float() / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)
            drop = sp.cumsum(-1) - sp > self.top_p
            probs = probs.scatter(-1, si, sp.masked_fill(drop, 0.0))
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))


GREEDY = Sampler()

#: the seeds a sampling generator takes (torch.Generator.manual_seed: a signed or unsigned 64-bit integer)
SEED_RANGE = (-(2**63), 2**64 - 1)


def check_seed(seed, what: str = "seed") -> int:
    """``seed`` as a sampling generator's seed: an integer within :data:`SEED_RANGE`; ``KVTrimError`` otherwise."""
    return validate.integer(seed, what, minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])


def max_context(model) -> int:
    """The model's context length (``max_position_embeddings``), 0 when it does not say."""
    cfg = getattr(model, "config", model).get_text_config(decoder=True)
    return int(getattr(cfg, "max_position_embeddings", 0) or 0)


def check_token_ids(model, ids, what: str = "the prompt") -> list[int]:
    """``ids`` as a list of ints, refused with a clear error unless each is a token of ``model``'s vocabulary."""
    vocab = model.get_input_embeddings().num_embeddings
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or (not isinstance(t, int) and not (isinstance(t, torch.Tensor) and t.numel() == 1)):
            raise KVTrimError(f"{what}: token {i} is {t!r}, not an integer token id")
        t = int(t)
        if not 0 <= t < vocab:
            raise KVTrimError(f"{what}: token id {t} at index {i} is outside the model's vocabulary of {vocab} tokens")
        out.append(t)
    return out


def check_context(policy: "Policy", total: int, max_ctx: int, *, what: str = "the prompt",
                  hint: str = "Shorten the prompt, or use a streaming method with a fixed budget "
                              "(e.g. --method streaming_llm --max-tokens 2048).") -> None:
    """Refuse ``total`` tokens beyond the model's context unless the policy can stream past it."""
    if max_ctx and total > max_ctx and not policy.can_stream():
        raise KVTrimError(
            f"{what} would hold {total} tokens, more than the model's context of {max_ctx}; method "
            f"{policy.name!r} with position {policy.position_policy!r} cannot stream past it. {hint}"
        )


def chunk_size(policy: "Policy", *, held: int, seen: int, n: int, extra: int, max_ctx: int) -> int | None:
    """The chunk rule: the size of the pieces ``n`` new tokens are fed in, or None for one piece.

    ``held`` tokens are stored in the cache already and ``seen`` were fed so far; ``extra`` more
    will be decoded after them. While they fit the model's context the tokens go in one forward.
    A policy that streams past the context evicts while it decodes, so its new tokens need no room
    beyond its decode allowance; when its prompt does not fit, it is fed in pieces small enough
    that the budget, the decode allowance and one piece fit the context's positions. Pieces are
    never smaller than ``MIN_AUTO_CHUNK`` tokens (one token per forward would make a long prompt
    many times slower): a budget that leaves less room than that is refused.
    """
    streams = policy.can_stream()
    if not max_ctx or held + n + (0 if streams else extra) <= max_ctx:
        return None
    budget = policy.budget(seen + n)
    cap = int(getattr(policy, "decode_cap", 0) or 0)
    room = max_ctx - budget - cap - (0 if streams else extra)
    if room // 2 < MIN_AUTO_CHUNK:
        raise KVTrimError(
            f"a budget of {budget} tokens (+{cap} decode allowance{'' if streams else f', +{extra} to generate'}) leaves "
            f"{max(room, 0)} of the model's {max_ctx} positions to feed the prompt in; pieces of at least "
            f"{MIN_AUTO_CHUNK} tokens need {2 * MIN_AUTO_CHUNK}. Use a smaller budget (max_tokens <= "
            f"{max_ctx - cap - 2 * MIN_AUTO_CHUNK - (0 if streams else extra)})."
        )
    return min(MAX_AUTO_CHUNK, room // 2)


def check_prefill_chunk(policy: "Policy | type[Policy]", chunk) -> int | None:
    """A user's prefill chunk (``generate_ids(prefill_chunk=)``, ``--prefill-chunk``) checked for ``policy``
    (a policy, or its class when the budget is not known yet: only the method's class properties count).

    None means one piece (the default; a prompt past the context of a streaming method is still
    cut by :func:`chunk_size`). Chunked prefill bounds a long prompt's memory: every piece after the
    first is a policy "turn", so a compressing method evicts down to its budget after each piece and
    the cache holds at most the budget plus one piece while the next is fed (docs/memory.md). A
    piece has at least ``MIN_PREFILL_CHUNK`` tokens: a one-token piece is a decode step, where most
    methods do not evict. Methods that change the prefill forward itself
    (``Policy.rewrites_forward``: FastV and HAE drop image tokens from the hidden states once, by
    the last prompt token's attention over all of them) need the whole prompt in one forward and
    are refused.
    """
    if chunk is None:
        return None
    from kvtrim.validate import integer

    chunk = integer(chunk, "prefill_chunk", minimum=MIN_PREFILL_CHUNK, unit="tokens")
    if policy.rewrites_forward:
        raise KVTrimError(
            f"method {policy.name!r} cannot prefill in chunks: it decides once, inside the prefill forward, which "
            "prompt tokens to drop from the hidden states (by the last prompt token's attention over all of them), "
            "so it needs the whole prompt in one forward. Leave out prefill_chunk / --prefill-chunk."
        )
    return chunk


def next_positions(cache: "KVTrimCache", n: int, device=None) -> torch.Tensor | None:
    """Positions ``[1, n]`` of the next ``n`` tokens fed through ``cache``, or None under ``true``
    positions (transformers then continues from ``get_seq_length()``, the tokens seen)."""
    if cache.position_policy == "true":
        return None
    first = cache.compressed_layers[0]
    start = first.length if first.is_initialized else 0
    return torch.arange(start, start + n, device=device).unsqueeze(0)


def explicit_positions(cache: "KVTrimCache", n: int) -> torch.Tensor:
    """Positions ``[n]`` of the next ``n`` tokens, explicit under every position policy."""
    pos = next_positions(cache, n)
    if pos is None:
        start = cache.get_seq_length()
        return torch.arange(start, start + n)
    return pos[0]


def forward(model, cache: "KVTrimCache", ids: list[int] | torch.Tensor, *, all_logits: bool = False,
            extra: dict | None = None) -> torch.Tensor:
    """One batch-1 forward of ``ids`` through ``cache`` (inside ``kvtrim.attach``).

    Returns float32 logits: ``[vocab]`` of the last position, or ``[n, vocab]`` with ``all_logits``.
    """
    from kvtrim.cache import cache_keyword

    device = next(model.parameters()).device
    x = ids.to(device) if isinstance(ids, torch.Tensor) else torch.tensor([list(ids)], device=device)
    if x.dim() == 1:
        x = x.unsqueeze(0)
    kw: dict = {cache_keyword(): cache, "use_cache": True, "logits_to_keep": 0 if all_logits else 1, **(extra or {})}
    pos = next_positions(cache, x.shape[1], device)
    if pos is not None:
        kw["position_ids"] = pos
    logits = model(input_ids=x, **kw).logits[0].float()
    return logits if all_logits else logits[-1]


def run(model, program: Program, *, on_step: Callable[[Step, float], None] | None = None,
        serve: Callable[[Step], torch.Tensor] | None = None) -> Any:
    """Run ``program`` to its end with batch-1 forwards; returns its result.

    ``on_step(step, seconds)`` is called after each forward (timing, progress); ``serve(step)``
    replaces :func:`forward` for an owner that keeps state per forward (a session's last logits).
    """
    import time

    try:
        request = next(program)
        while True:
            if not isinstance(request, Step):
                raise KVTrimError(f"a batch-1 program can only ask for steps, got {type(request).__name__}")
            t0 = time.perf_counter()
            if serve is not None:
                logits = serve(request)
            else:
                logits = forward(model, request.cache, request.ids, all_logits=request.all_logits, extra=request.extra)
            dt = time.perf_counter() - t0
            if request.clock is not None:
                request.clock.charge(dt, 1)
            if on_step is not None:
                on_step(request, dt)
            request = program.send(logits)
    except StopIteration as stop:
        return stop.value


def prefill(cache: "KVTrimCache", ids: list[int], *, chunk: int | None = None, all_logits: bool = False,
            extra: dict | None = None, clock: Clock | None = None) -> Program:
    """Program: feed ``ids`` (in pieces of ``chunk`` when given); returns the last step's logits.

    Each piece after the first is a policy "turn". ``extra`` model inputs go with the first piece
    (image inputs need the whole prompt in one piece: chunking them is refused).
    """
    if not ids:
        raise KVTrimError("the prompt is empty; give a question or prompt text")
    if chunk is not None and extra:
        raise KVTrimError("image/video inputs need the prompt in one prefill; chunked prefill is not supported with them")
    step = chunk or len(ids)
    logits = None
    for s in range(0, len(ids), step):
        logits = yield Step(cache, list(ids[s : s + step]), all_logits, clock, extra if s == 0 else None)
    return logits


def decode(cache: "KVTrimCache", logits: torch.Tensor, max_new_tokens: int, *, sampler: Sampler = GREEDY,
           generator: torch.Generator | None = None, stop_ids: tuple[int, ...] | frozenset = (),
           finished: Callable[[list[int]], bool] | None = None,
           on_token: Callable[[int], None] | None = None, clock: Clock | None = None) -> Program:
    """Program: choose a token from ``logits``, feed it, repeat; returns ``(tokens, forward_steps)``.

    Stops after a token in ``stop_ids`` (included in the tokens), when ``finished(tokens)`` is
    true, or at ``max_new_tokens``. The last chosen token is never fed (as in any generate loop),
    so ``forward_steps`` is one less than the tokens chosen. ``on_token`` sees each token as it
    is chosen (a streamer).
    """
    out: list[int] = []
    steps = 0
    for i in range(max_new_tokens):
        tok = sampler.choose(logits, generator)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in stop_ids or i == max_new_tokens - 1 or (finished is not None and finished(out)):
            break
        logits = yield Step(cache, [tok], False, clock)
        steps += 1
    return out, steps


def teacher_forced_nll(cache: "KVTrimCache", logits: torch.Tensor, target: list[int],
                       clock: Clock | None = None) -> Program:
    """Program: ``-sum log p(target)``, the first token predicted by ``logits``, the rest in one forward."""
    nll = -float(torch.log_softmax(logits, -1)[target[0]])
    if len(target) > 1:
        all_logits = yield Step(cache, list(target[:-1]), True, clock)
        lp = torch.log_softmax(all_logits, -1)
        idx = torch.tensor(target[1:], device=lp.device).unsqueeze(1)
        nll -= float(lp.gather(1, idx).sum())
    return nll
