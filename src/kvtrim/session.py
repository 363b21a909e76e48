"""Sessions: one conversation (or one long stream) with its compressed cache, saved to disk and back.

A :class:`Session` owns a :class:`~kvtrim.cache.KVTrimCache` and the turn history of one
conversation. ``send(text) -> reply`` adds a user turn (the tokenizer's chat template is applied
per turn, continuing the conversation; for a tokenizer without one, or with ``plain=True``,
kvtrim's plain format ``User: ...`` / ``Assistant:`` of ``kvtrim.models.PLAIN_TURN``) and generates
the assistant's reply; ``add_turn(user,
assistant)`` feeds a scripted exchange without generating; ``feed(text)`` streams raw text
through the cache chunk by chunk and reports each chunk's perplexity, resident KV bytes, process
RSS and speed. ``save(dir)`` writes the cache tensors to ``cache.safetensors``, everything else
(history, policy parameters, counters, pending text) to ``session.json`` and a ``manifest.json``
(model fingerprint with dtype and weight digest, method, SHA-256 of both files) - no pickle,
atomically, 0600; ``Session.load(dir, model, tokenizer)`` verifies and restores it
(:class:`~kvtrim.errors.SessionError` for any mismatch), and the restored session continues exactly
as the original would have (tested token for token). The files, how they are written and what is
verified are :mod:`kvtrim.session_file`'s; format and guarantees: docs/sessions.md.

Continuing a chat template per turn: the cache already holds the conversation up to the last
token it was fed. A new turn feeds (1) what the template puts after the last reply (for SmolLM2,
``<|im_end|>\\n``) plus the reply's last sampled token, which generation never feeds, and (2) the
template's increment for the new user message with the generation prompt. So the cache ends up
holding exactly the text of ``apply_chat_template(history)``; generated tokens stay as the model
chose them (re-tokenizing a reply could split it differently).

Memory: with a fixed-budget streaming policy (``inf_mllm``, ``streaming_llm``, ``h2o`` with
``position="reassigned"``) a session's KV stays bounded however long it runs. The history of
messages is kept as text (a chat's history is small; ``feed`` keeps no text).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import resource
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvtrim import decoding, validate
from kvtrim.cache import KVTrimCache
from kvtrim.decoding import Sampler, check_context, chunk_size
from kvtrim.errors import KVTrimError, SessionError
from kvtrim.integrations.hf import ATTN_NAME, attach
from kvtrim.models import has_chat_template, plain_turn, plain_turn_ids
from kvtrim.policies.base import Policy
from kvtrim.session_file import SESSION_FILE, read_session, split_tensors, write_session

logger = logging.getLogger(__name__)

DEFAULT_CHUNK = 512


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``; else the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``getrusage``; kilobytes on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class ChunkStats:
    """What one ``feed`` chunk cost and how well the model predicted it."""

    chunk: int  # index of the chunk in this session's stream (0-based)
    tokens: int  # tokens in the chunk
    seen: int  # tokens the cache has seen after the chunk
    stored: int  # tokens stored per layer after the chunk (the largest layer)
    nll_sum: float  # summed negative log-likelihood (nats) of the chunk's scored tokens
    scored: int  # tokens scored (the stream's very first token has no prediction)
    kv_bytes: int  # resident key/value buffer bytes after the chunk
    rss_bytes: int  # process RSS after the chunk
    seconds: float  # wall time of the chunk's forward pass(es)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.scored) if self.scored else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ppl"] = self.ppl
        d["tokens_per_s"] = self.tokens_per_s
        return d


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (slices compared in C: a bisection, not a
    character loop in Python)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


#: Messages of history rendered with a new turn (two exchanges). A chat template renders each message
#: on its own (plus a head that depends on the first message), so the text a new user message adds,
#: and what the template puts after a reply, follow from the last few messages; rendering the whole
#: history at every turn would make each turn cost more than the one before. A session checks this on
#: its first WINDOW_CHECKS turns against the whole history and renders it whole from then on if a
#: template is not of that kind.
HISTORY_WINDOW = 4
WINDOW_CHECKS = 2


class Session:
    """One conversation or stream over a compressing cache.

    Args:
        model: a transformers causal LM (batch size 1).
        tokenizer: its tokenizer; ``None`` restricts the session to the id-level API
            (``send_ids``, ``feed_ids``).
        policy: a ``Policy`` or a registered method name (default ``inf_mllm``); with a name,
            ``policy_kwargs`` (``max_tokens``, ``keep``, method parameters) build it. The method
            must support turns (``Policy.supports_turns``).
        chat: format each turn as a chat turn (default: when there is a tokenizer): with the
            tokenizer's chat template, or kvtrim's plain format (``kvtrim.models.PLAIN_TURN``) when it
            has none. ``False``: turns are raw text, each on a new line.
        plain: use the plain format even when the tokenizer has a chat template.
        prefill_chunk: feed a turn longer than this in pieces (each piece is a policy "turn").
            Default: the whole turn at once, unless it would not fit in the model's context, in
            which case streaming policies get pieces that do (as ``generate_ids`` does).
        seed: seed of the sampling generator (its state is saved with the session).
        kv_bits: bits per stored key and value element (16, 8, 4 or 2; ``KVTrimCache``); a saved
            session holds the quantized form and loads only with the same setting.
    """

    def __init__(self, model, tokenizer=None, policy: Policy | str = "inf_mllm", *, chat: bool | None = None,
                 plain: bool = False, prefill_chunk: int | None = None, seed: int = 0, kv_bits: int = 16,
                 **policy_kwargs):
        from kvtrim.registry import create_policy

        if isinstance(policy, str):
            policy = create_policy(policy, **policy_kwargs)
        elif policy_kwargs:
            raise KVTrimError("pass method parameters either in the Policy object or as keywords with a name, not both")
        if policy.needs_reconstruction and tokenizer is None:
            raise KVTrimError(f"method {policy.name!r} asks the model, in words, to repeat the first message; "
                              "the session needs the tokenizer")
        if not policy.supports_turns:
            raise KVTrimError(f"method {policy.name!r} does not support multi-turn sessions")
        prefill_chunk = validate.optional_integer(prefill_chunk, "prefill_chunk", minimum=1)
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy
        self.cache = KVTrimCache(model, policy, kv_bits=kv_bits)
        self.chat = tokenizer is not None if chat is None else bool(chat)
        if self.chat and tokenizer is None:
            raise KVTrimError("chat=True needs a tokenizer")
        if plain and not self.chat:
            raise KVTrimError("plain=True formats chat turns; it needs a tokenizer and chat not False")
        # kvtrim's plain format: asked for, or the tokenizer has no chat template (a base model)
        self.plain = self.chat and (bool(plain) or not has_chat_template(tokenizer))
        self.prefill_chunk = prefill_chunk
        self.messages: list[dict] = []
        self.turns: list[dict] = []  # per turn: prompt_tokens, new_tokens, kv_bytes, seconds
        self.chunks_fed = 0
        self._pending_ids: list[int] = []  # generated but not yet fed (the reply's last token)
        self._pending_text = ""  # template text after the last reply (e.g. "<|im_end|>\n")
        self._last_logits: torch.Tensor | None = None  # [vocab] float32: prediction of the next token
        self._gen = torch.Generator(device="cpu").manual_seed(decoding.check_seed(seed))
        cfg = model.config.get_text_config(decoder=True)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.device = next(model.parameters()).device
        self._session_id: str | None = None  # the conversation's id in saved files (set by the first save)
        self._window = True  # render a turn against the last HISTORY_WINDOW messages (checked, see there)
        self._window_checks = WINDOW_CHECKS
        self._render_from = 0  # the first message of the window the last turn was rendered with
        self._full_render: str | None = None  # the whole history's render of a turn being checked

    # --- plumbing --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _attached(self):
        if getattr(self.model.config, "_attn_implementation", None) == ATTN_NAME:
            yield  # the caller attached the model already
        else:
            with attach(self.model):
                yield

    @property
    def seen(self) -> int:
        return self.cache.get_seq_length()

    def stored(self) -> int:
        s = self.cache.stored_tokens()
        return max(s) if s else 0

    def _check_fits(self, n: int, extra: int = 0) -> None:
        check_context(self.policy, self.seen + n + extra, self.max_context, what="the session",
                      hint="Use a streaming method with a fixed budget (inf_mllm or streaming_llm with max_tokens).")

    def _forward(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """One forward of ``ids`` through the cache; returns float32 logits ``[n or 1, vocab]``."""
        logits = decoding.forward(self.model, self.cache, ids, all_logits=all_logits)
        logits = logits if all_logits else logits.unsqueeze(0)
        self._last_logits = logits[-1].clone()
        return logits

    def _run(self, program) -> Any:
        """Run a stepper program through this session's cache (each forward via ``_forward``)."""
        def serve(step: decoding.Step) -> torch.Tensor:
            logits = self._forward(step.ids, step.all_logits)
            return logits if step.all_logits else logits[-1]

        return decoding.run(self.model, program, serve=serve)

    def _prefill(self, ids: list[int], extra: int = 0) -> None:
        chunk = self.prefill_chunk or chunk_size(self.policy, held=self.stored(), seen=self.seen, n=len(ids),
                                                 extra=extra, max_ctx=self.max_context)
        if self.policy.needs_reconstruction and self.seen == 0:
            self._prefill_reconstructed(ids, chunk)
            return
        self._run(decoding.prefill(self.cache, ids, chunk=chunk))

    def _prefill_reconstructed(self, ids: list[int], chunk: int | None) -> None:
        """The first message of a ``needs_reconstruction`` method's session (``kvzip``): one prefill
        recorded, the reconstruction forward that scores it, and the session's cache built from the
        recording, evicting once; later turns are appended to that cache (the method keeps them)."""
        from kvtrim.reconstruction import reconstructed_prefill, repeat_ids

        if chunk:
            raise KVTrimError(f"{self.policy.name}: reconstructs the first message after one whole prefill; a chunked "
                              "prefill (prefill_chunk, or a message longer than the model's context) is not supported")
        self.cache, logits = reconstructed_prefill(self.model, self.policy, ids, repeat_ids(self.tokenizer, self.plain),
                                                   kv_bits=self.cache.kv_bits)
        self._last_logits = logits.clone()

    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise KVTrimError("this session has no tokenizer; use send_ids / feed_ids")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def _turn_ids(self, user: str) -> tuple[list[int], str]:
        """Ids that continue the cache with a new user message (and the generation prompt)."""
        if not self.chat:
            prefix = "" if self.seen == 0 else "\n"
            return self._pending_ids + self._tokenize(self._pending_text + prefix + user), user
        if self.plain:  # the format is defined turn by turn: nothing to diff, nothing pending but ids
            first = self.seen == 0 and not self._pending_ids
            return self._pending_ids + plain_turn_ids(self.tokenizer, user, first=first), plain_turn(user, first=first)
        message = {"role": "user", "content": user}
        start = self._window_start()
        before = self._render(self.messages[start:], False)
        after = self._render(self.messages[start:] + [message], True)
        cut = _common_prefix(before, after)
        self._full_render = None
        if start and self._window_checks:  # the window's increment must be the whole history's
            full_before = self._render(self.messages, False)
            full_after = self._render(self.messages + [message], True)
            full_cut = _common_prefix(full_before, full_after)
            self._full_render = full_after
            if full_after[full_cut:] != after[cut:]:
                self._stop_window()
                start, before, after, cut = 0, full_before, full_after, full_cut
        if cut < len(before):
            logger.warning("the chat template does not render the history as a prefix; continuing from the common prefix")
        self._render_from = start
        return self._pending_ids + self._tokenize(self._pending_text + after[cut:]), after

    def _window_start(self) -> int:
        """The first message a turn is rendered with: HISTORY_WINDOW messages back, at a user message
        (0: the whole history, for a template that needs it)."""
        start = max(0, len(self.messages) - HISTORY_WINDOW) if self._window else 0
        while start and self.messages[start].get("role") != "user":
            start -= 1
        return start

    def _stop_window(self) -> None:
        logger.info("the chat template renders a message differently with more history before it; each turn "
                    "renders the whole history from now on")
        self._window = False
        self._full_render = None

    def _close_reply(self, prompt_render: str, fed_reply_ids: list[int], pending: list[int], reply: str) -> None:
        """After a reply: what the template adds after it, minus what the cache holds already (from the
        turn's window of messages, as :meth:`_turn_ids` rendered it)."""
        self._pending_ids = pending
        if not self.chat or self.plain:  # raw and plain turns open with their own newline
            self._pending_text = ""
            return
        reply_text = self.tokenizer.decode(fed_reply_ids + pending, skip_special_tokens=False)
        history = self._render(self.messages[self._render_from:], False)
        held = prompt_render + reply_text
        self._pending_text = history[_common_prefix(history, held):]
        if self._full_render is not None:  # a checked turn: the whole history must leave the same text pending
            full_history = self._render(self.messages, False)
            full_held = self._full_render + reply_text
            self._full_render = None
            self._window_checks -= 1
            full_pending = full_history[_common_prefix(full_history, full_held):]
            if full_pending != self._pending_text:
                self._stop_window()
                self._pending_text = full_pending

    # --- chat ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def send_ids(self, ids: list[int], max_new_tokens: int = 256, *, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, stop_ids: tuple[int, ...] | None = None, streamer=None) -> list[int]:
        """Feed ``ids`` as a new turn and generate up to ``max_new_tokens``; returns the new ids.

        The last generated token (or the stop token) is not fed until the next turn, as in any
        generate loop; ``streamer`` (transformers ``TextStreamer`` or anything with ``put``/``end``)
        receives each new token as it is chosen.
        """
        if len(ids) == 0:
            raise KVTrimError("the turn is empty; send a non-empty message")
        ids = decoding.check_token_ids(self.model, ids, "the turn")
        validate.integer(max_new_tokens, "max_new_tokens", minimum=1)
        self._check_fits(len(ids), max_new_tokens)
        if stop_ids is None:
            eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
            stop_ids = () if eos is None else (eos,)
        sampler = Sampler(do_sample, temperature, top_p, top_k)
        stops = tuple(stop_ids)

        def on_token(tok: int) -> None:
            if streamer is not None and tok not in stops:
                streamer.put(torch.tensor([tok]))

        t0 = time.perf_counter()
        with self._attached():
            self._prefill(list(ids), extra=max_new_tokens)
            t1 = time.perf_counter()
            assert self._last_logits is not None  # set by the prefill
            out, _ = self._run(decoding.decode(self.cache, self._last_logits, max_new_tokens, sampler=sampler,
                                               generator=self._gen, stop_ids=stops, on_token=on_token))
        if streamer is not None:
            streamer.end()
        t2 = time.perf_counter()
        self.turns.append({"prompt_tokens": len(ids), "new_tokens": len(out), "prefill_seconds": t1 - t0,
                           "decode_seconds": t2 - t1, "kv_bytes": self.cache.kv_bytes(), "stored": self.stored(),
                           "seen": self.seen})
        return out

    def send(self, text: str, max_new_tokens: int = 256, **gen_kwargs) -> str:
        """Add a user message, generate the assistant's reply and return it (text)."""
        if not isinstance(text, str) or not text.strip():
            raise KVTrimError("the turn is empty; send a non-empty message")
        ids, render = self._turn_ids(text)
        new = self.send_ids(ids, max_new_tokens, **gen_kwargs)
        stop = {getattr(self.tokenizer, "eos_token_id", None)}
        pending = [] if new[-1] in stop else [new[-1]]
        reply_ids = [t for t in new if t not in stop]
        reply = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        self._close_reply(render, new[:-1], pending, reply)
        return reply.strip()

    @torch.inference_mode()
    def add_turn(self, user: str, assistant: str) -> int:
        """Feed a scripted exchange (user message + given assistant reply) without generating.

        Returns the tokens fed. The reply is fed in full, so nothing is pending afterwards except
        the template's end-of-turn text.
        """
        if not isinstance(user, str) or not user.strip():
            raise KVTrimError("the turn is empty; send a non-empty message")
        ids, render = self._turn_ids(user)
        reply_ids = self._tokenize(assistant)
        ids = ids + reply_ids
        self._check_fits(len(ids))
        with self._attached():
            self._prefill(ids)
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        self._close_reply(render, reply_ids, [], assistant)
        self.turns.append({"prompt_tokens": len(ids), "new_tokens": 0, "kv_bytes": self.cache.kv_bytes(),
                           "stored": self.stored(), "seen": self.seen})
        return len(ids)

    # --- streams ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def feed_ids_iter(self, ids: list[int], chunk: int = DEFAULT_CHUNK, score: bool = True) -> Iterator[ChunkStats]:
        """Feed ``ids`` in chunks of ``chunk`` tokens, yielding each chunk's :class:`ChunkStats`.

        Perplexity is teacher-forced: each token is scored by the logits before it (the chunk's
        first token by the previous chunk's last logits), under the compressed cache.
        ``score=False`` skips it (only the last position's logits are computed; ``scored`` is 0).
        """
        validate.integer(chunk, "chunk", minimum=1, unit="tokens")
        if self.policy.needs_reconstruction:
            raise KVTrimError(f"method {self.policy.name!r} reconstructs a whole first message; it cannot compress a "
                              "stream fed in chunks (use a streaming method: tova, streaming_llm, inf_mllm)")
        if len(ids) == 0:
            raise KVTrimError("nothing to feed: the text is empty")
        ids = decoding.check_token_ids(self.model, ids, "the stream")
        held = min(self.policy.budget(self.seen + len(ids)), self.seen + len(ids))
        if self.max_context and self.policy.can_stream() and held + min(chunk, len(ids)) > self.max_context:
            raise KVTrimError(
                f"chunk {chunk} + budget {held} exceed the model's context of {self.max_context} (the positions a chunk "
                "is given); use a smaller chunk or budget"
            )
        with self._attached():
            if self._pending_ids or self._pending_text:  # close a pending reply first
                self._prefill(self._pending_ids + (self._tokenize(self._pending_text) if self._pending_text else []))
                self._pending_ids, self._pending_text = [], ""
            for s in range(0, len(ids), chunk):
                part = list(ids[s : s + chunk])
                self._check_fits(len(part))
                target = torch.tensor(part, device=self.device)
                prev = self._last_logits
                t0 = time.perf_counter()
                logits = self._forward(part, all_logits=score)
                dt = time.perf_counter() - t0
                if not score:
                    nll, scored = logits.new_zeros(()), 0
                elif len(part) > 1:
                    nll, scored = F.cross_entropy(logits[:-1], target[1:], reduction="sum"), len(part) - 1
                else:
                    nll, scored = logits.new_zeros(()), 0
                if score and prev is not None:
                    nll = nll + F.cross_entropy(prev.unsqueeze(0), target[:1], reduction="sum")
                    scored += 1
                stats = ChunkStats(self.chunks_fed, len(part), self.seen, self.stored(), float(nll), scored,
                                   self.cache.kv_bytes(), rss_bytes(), dt)
                self.chunks_fed += 1
                yield stats

    def feed_ids(self, ids: list[int], chunk: int = DEFAULT_CHUNK) -> list[ChunkStats]:
        return list(self.feed_ids_iter(ids, chunk))

    def feed(self, text: str, chunk: int = DEFAULT_CHUNK) -> list[ChunkStats]:
        """Stream raw ``text`` (no chat template) through the cache; per-chunk statistics."""
        if not isinstance(text, str) or not text:
            raise KVTrimError("nothing to feed: the text is empty")
        return self.feed_ids(self._tokenize(text), chunk)

    # --- persistence (format: docs/sessions.md) ----------------------------------------------------
    def save(self, directory: str | os.PathLike) -> Path:
        """Save the session into ``directory``, atomically: ``manifest.json`` (model fingerprint,
        dtype, method, parameters, SHA-256 of the other two files), ``session.json`` (history,
        counters, pending text) and ``cache.safetensors`` (KV buffers, stream indices, policy token
        state, last logits, RNG state) are written into a fresh temporary directory beside it, each
        fsynced, and the directory is then renamed into place.

        An existing ``directory`` is replaced only when it is a saved session (or empty), and only
        once the new one is complete; anything else there (a file, another directory, a symbolic
        link) is refused with :class:`~kvtrim.errors.SessionError`. Files are created 0600, the
        directory 0700. Returns the directory.
        """
        tensors = self.cache.state_dict()
        layers = self.cache.state_meta()
        for meta in layers:
            if meta is None:
                continue
            try:
                meta["state"] = json.loads(json.dumps(meta["state"]))
            except TypeError:
                raise SessionError(f"policy {self.policy.name!r} keeps per-layer state that cannot be saved as JSON") from None
        if self._last_logits is not None:
            tensors["last_logits"] = self._last_logits.contiguous()
        tensors["rng_state"] = self._gen.get_state()
        if self._session_id is None:  # the conversation's id: kept across save and load, new for a new session
            self._session_id = uuid.uuid4().hex
        state = {
            "policy": {"name": self.policy.name, "params": self.policy.params()},
            "chat": self.chat, "plain": self.plain, "prefill_chunk": self.prefill_chunk,
            "kv_bits": self.cache.kv_bits, "messages": self.messages, "turns": self.turns, "chunks_fed": self.chunks_fed,
            "pending_ids": self._pending_ids, "pending_text": self._pending_text,
            "layers": layers,
        }
        return write_session(directory, self.model, state, tensors, self._session_id)

    @classmethod
    def load(cls, directory: str | os.PathLike, model, tokenizer=None, *, kv_bits: int | None = None) -> "Session":
        """Restore a session saved with :meth:`save` onto ``model`` (the same weights and dtype).

        Everything is verified before anything is used: the manifest's checksums of both files, the
        model's architecture, dtype and weight digest, the method and its parameters, that the two
        files come from the same save, the types of every field, the tensors against the counters,
        and the pending token ids against the vocabulary. Any mismatch raises
        :class:`~kvtrim.errors.SessionError` naming what differs. Sessions of format v1 (no
        manifest) are loaded with a warning: their files cannot be verified (save them again).

        ``kv_bits``: None (default) loads the session with the setting it was saved with; another
        value than that is refused (the file holds the keys and values in the saved bit width).
        """
        saved = read_session(directory, model)
        where = saved.where
        try:
            s = cls._restore(saved.info, saved.tensors, model, tokenizer, kv_bits)
        except SessionError as e:
            raise SessionError(f"{where}: {e}") from None
        except KVTrimError as e:
            raise SessionError(f"{where}: {e}") from None
        except (TypeError, KeyError, IndexError, AttributeError) as e:  # a field of an unexpected shape
            raise SessionError(f"{where}: malformed {SESSION_FILE} ({type(e).__name__}: {e})") from None
        s._session_id = saved.session_id
        return s

    @classmethod
    def _restore(cls, info: dict, tensors: dict[str, torch.Tensor], model, tokenizer,
                 kv_bits: int | None = None) -> "Session":
        from kvtrim.cache import check_kv_bits
        from kvtrim.registry import create_policy

        saved_bits = check_kv_bits(info.get("kv_bits", 16))  # sessions saved before kv_bits hold 16 bits
        if kv_bits is not None and check_kv_bits(kv_bits) != saved_bits:
            raise SessionError(f"saved with kv_bits={saved_bits}, asked to load with kv_bits={kv_bits}: the file holds "
                               f"the keys and values in {saved_bits} bits; load it with kv_bits={saved_bits} "
                               f"(--kv-bits {saved_bits}) or start a new session")
        policy = create_policy(info["policy"]["name"], **info["policy"]["params"])
        s = cls(model, tokenizer, policy, chat=info["chat"], plain=bool(info.get("plain", False)),
                prefill_chunk=info["prefill_chunk"], kv_bits=saved_bits)
        tensors, rng, logits = split_tensors(tensors, model)
        s.cache.load_state_dict({k: t.to(s.device) for k, t in tensors.items()}, info["layers"])
        seen = {m["seen"] for m in info["layers"] if m is not None}
        if len(seen) > 1:
            raise SessionError(f"the layers disagree on the tokens seen: {sorted(seen)}")
        s.messages, s.turns, s.chunks_fed = info["messages"], info["turns"], info["chunks_fed"]
        s._pending_ids, s._pending_text = list(info["pending_ids"]), info["pending_text"]
        s._last_logits = None if logits is None else logits.to(s.device)
        try:
            s._gen.set_state(rng.cpu())
        except RuntimeError as e:
            raise SessionError(f"rng_state is not a sampling state: {e}") from None
        return s
