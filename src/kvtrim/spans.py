"""Modality spans: which prompt tokens are system text, text, image, video (or a document).

A request may carry spans of token positions tagged with a modality (docs/methods-spec.md). kvtrim finds
them itself for transformers' vision-language models from the token ids their processors insert
(``config.image_token_id`` / ``image_token_index``, ``config.video_token_id``: every run of such
ids is one span), and accepts them explicitly for text models, for example to tag a long
document as a second modality (``document``) that a multimodal policy (``hae``, ``fastv``) may
prune like an image.

Positions are stream indices of the prompt, ``[start, end)``; tokens not covered by any span are
``text``, and so are tokens generated after the prompt. Policies read the spans from the cache
(``cache.spans``) and turn the stream index of each stored token into a modality with
:meth:`SpanSet.mask`.

Design decision (kvtrim's choice): the allowed tags are the vision-language ones (``system``,
``text``, ``image``, ``video``) plus ``document`` (the "second modality" of a text-only request);
anything else is refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvtrim import validate
from kvtrim.errors import KVTrimError

MODALITIES = ("system", "text", "image", "video", "document")
#: modalities a multimodal policy prunes by default
VISUAL = ("image", "video")


@dataclass(frozen=True)
class Span:
    """Prompt positions ``[start, end)`` of one modality (``system``, ``text``, ``image``, ``video``, ``document``)."""

    start: int
    end: int
    modality: str

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise KVTrimError(f"unknown modality {self.modality!r} in span {self.start}..{self.end}; allowed: {', '.join(MODALITIES)}")
        validate.integer(self.start, "span start (a token position)")
        validate.integer(self.end, "span end (a token position)")
        if self.start < 0 or self.end <= self.start:
            raise KVTrimError(f"span [{self.start}, {self.end}) is empty or negative; spans need 0 <= start < end")

    def __len__(self) -> int:
        return self.end - self.start


class SpanSet:
    """Validated, sorted, non-overlapping spans over a prompt of ``n_tokens`` tokens.

    Raises ``KVTrimError`` for spans that overlap, lie (partly) outside the prompt, or name an
    unknown modality.
    """

    def __init__(self, spans: Iterable[Span | tuple], n_tokens: int):
        n_tokens = validate.integer(n_tokens, "the prompt length", minimum=1)
        items = [s if isinstance(s, Span) else Span(*s) for s in spans]
        items.sort(key=lambda s: (s.start, s.end))
        for s in items:
            if s.end > n_tokens:
                raise KVTrimError(
                    f"span [{s.start}, {s.end}) ({s.modality}) lies outside the prompt of {n_tokens} tokens; "
                    f"positions must be in [0, {n_tokens})"
                )
        for a, b in itertools.pairwise(items):
            if b.start < a.end:
                raise KVTrimError(f"spans overlap: [{a.start}, {a.end}) ({a.modality}) and [{b.start}, {b.end}) ({b.modality})")
        self.spans: tuple[Span, ...] = tuple(items)
        self.n_tokens = n_tokens

    def __iter__(self):
        return iter(self.spans)

    def __len__(self) -> int:
        return len(self.spans)

    def __repr__(self) -> str:
        inner = ", ".join(f"{s.modality}[{s.start}:{s.end}]" for s in self.spans)
        return f"SpanSet({inner}; n_tokens={self.n_tokens})"

    def of(self, modality: str) -> list[Span]:
        return [s for s in self.spans if s.modality == modality]

    def count(self, modalities: Sequence[str]) -> int:
        """Tokens covered by spans of the given modalities."""
        return sum(len(s) for s in self.spans if s.modality in modalities)

    def mask(self, positions: torch.Tensor, modalities: Sequence[str]) -> torch.Tensor:
        """Boolean tensor like ``positions`` (stream indices): True where the token is of one of ``modalities``.

        Positions past the prompt (generated tokens) are ``text``.
        """
        unknown = [m for m in modalities if m not in MODALITIES]
        if unknown:
            raise KVTrimError(f"unknown modality {unknown[0]!r}; allowed: {', '.join(MODALITIES)}")
        out = torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)
        for s in self.spans:
            if s.modality in modalities:
                out |= (positions >= s.start) & (positions < s.end)
        if "text" in modalities:  # uncovered prompt tokens and generated tokens are text
            covered = torch.zeros_like(out)
            for s in self.spans:
                covered |= (positions >= s.start) & (positions < s.end)
            out |= ~covered
        return out


def runs(ids: torch.Tensor, token_id: int) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of ``token_id`` in a 1-D id tensor."""
    hit = (ids == token_id).to(torch.int8)
    if not bool(hit.any()):
        return []
    edges = torch.diff(torch.cat([hit.new_zeros(1), hit, hit.new_zeros(1)]))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends))


def modality_token_ids(config) -> dict[str, int]:
    """The placeholder token ids a transformers VLM config declares: ``{"image": id, "video": id}``.

    Reads ``image_token_id`` (LLaVA's ``image_token_index``) and ``video_token_id``; empty for a
    text-only model.
    """
    out: dict[str, int] = {}
    for modality, names in (("image", ("image_token_id", "image_token_index")), ("video", ("video_token_id",))):
        for n in names:
            v = getattr(config, n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                out[modality] = v
                break
    return out


def is_multimodal(model_or_config) -> bool:
    cfg = getattr(model_or_config, "config", model_or_config)
    return bool(modality_token_ids(cfg))


def find_spans(model_or_config, input_ids: torch.Tensor | Sequence[int]) -> SpanSet:
    """Spans of a prompt for a transformers model: image/video runs from the config's token ids,
    everything else ``text``. A text-only model gives one ``text`` span."""
    cfg = getattr(model_or_config, "config", model_or_config)
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise KVTrimError(f"modality spans are per sequence; got a batch of {ids.shape[0]} (kvtrim runs batch size 1)")
        ids = ids[0]
    n = int(ids.shape[0])
    found: list[Span] = []
    for modality, tid in modality_token_ids(cfg).items():
        found += [Span(a, b, modality) for a, b in runs(ids, tid)]
    found.sort(key=lambda s: s.start)
    spans: list[Span] = []
    cur = 0
    for s in found:
        if s.start > cur:
            spans.append(Span(cur, s.start, "text"))
        spans.append(s)
        cur = s.end
    if cur < n:
        spans.append(Span(cur, n, "text"))
    return SpanSet(spans, n)


def as_span_set(spans, n_tokens: int) -> SpanSet:
    """Accept a ``SpanSet``, or spans as ``Span`` objects / ``(start, end, modality)`` tuples / dicts."""
    if isinstance(spans, SpanSet):
        if spans.n_tokens != n_tokens:
            raise KVTrimError(f"the spans were made for a prompt of {spans.n_tokens} tokens, but the prompt has {n_tokens}")
        return spans
    items = []
    for s in spans:
        if isinstance(s, dict):
            try:
                s = Span(s["start"], s["end"], s["modality"])
            except KeyError as e:
                raise KVTrimError(f"a span dict needs keys start, end, modality; missing {e}") from None
        items.append(s)
    return SpanSet(items, n_tokens)
