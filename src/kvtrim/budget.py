"""Automatic budget: a quality target instead of a ratio.

``keep_for_quality("snapkv", "qwen2.5-0.5b", 0.95, prompt_tokens=3000)`` returns the smallest
``keep`` that a calibration of that model expects to keep the method's **agreement with the full
cache** at or above 0.95 on a prompt of that length (``1.0``, the full cache, when none does).
``policy_for_quality`` builds the policy.

Agreement with the full cache (``AGREEMENT``), per sample, comparing a configuration's greedy
answer with the full cache's answer to the same prompt in the same run:

* on a task with a label (passkey, the needle tasks, vt, multiturn, ...): ``min(1, s / s_full)``,
  where ``s`` and ``s_full`` are the task's scores of the two answers; a sample the full cache gets
  wrong (``s_full == 0``) has nothing to agree with and is left out;
* on ``labelfree`` (no label): the ROUGE-L F1 of the answer against the full cache's answer.

A calibration point (method, prompt length, keep) holds the mean agreement per task and their
mean over tasks (each task weighs the same). The picking rule credits a point with its **worst
task's** agreement (``Point.credit``; the mean where a point has no per-task values): a budget is
picked only where every calibrated task kept the target. Crediting the mean over tasks fell short
on tasks the calibration had not seen (on Qwen2.5-Coder-0.5B-Instruct at 6 of 7 compressed picks, docs/autobudget.md);
the worst task met the target on them at every pick, at the cost of the full cache in a few cells
where a compressed budget would have done.

Picking rule (``Calibration.choose``), for a method, a target ``Q`` in (0, 1] and a prompt of ``n``
tokens:

1. a prompt the method keeps whole anyway (``Policy.kept_whole``: too short for compression to save
   memory) gets the full cache;
2. at each calibrated length the measured agreement is made non-decreasing in ``keep`` from above
   (the agreement credited to ``keep`` is the lowest measured at ``keep`` or any larger budget), and
   the length's pick is the smallest calibrated ``keep`` whose credited agreement is ``>= Q``, or the
   full cache when none is;
3. ``n`` within 10% of a calibrated length (``LENGTH_TOLERANCE``) takes that length's pick; else,
   between two calibrated lengths, the larger of their two picks; outside the calibrated range the
   nearest length's pick (``BudgetChoice.extrapolated`` says so).

Bit widths (format 2): a calibration point may also name the bits per stored key and value
element its cache held (``bits``: 16, the model's dtype, or 8, 4, 2, ``KVTrimCache(kv_bits=)``;
points of a format-1 file are 16-bit). Where a method has points at more than one bit width,
:meth:`Calibration.choose` picks the **(keep, bits) pair with the least resident memory** among the
calibrated pairs whose credited agreement meets ``Q`` at every length used (rules 2 and 3, applied
per bit width: at a length a pair is credited with the monotone credit of the largest calibrated
keep <= its keep at its bit width). Memory is the pair's measured KV share (``Point.kv_frac``: the
sweep's resident bytes -- codes, scales, zero points, group ids and the full-precision residual --
over the uncompressed 16-bit cache's) when every candidate has one at the lengths used, else the
formula :func:`lowbit_share` (``keep x`` the low-bit storage's bytes per element over 16 bits);
``BudgetChoice.memory_source`` says which. Ties go to more bits, then the higher credit. A method
calibrated at 16 bits only is picked exactly as before (the smallest keep). The full cache at a
low bit width (the calibration's ``full`` points, keep 1: nothing evicted, every token quantized) is
a candidate for every method too, so a target no eviction budget meets may still be met with less
than the 16-bit full cache.

Calibrations ship as package data, ``kvtrim/calibration/<model key>.json`` (one per reference
model, ``kvtrim.reference_models``), made by ``kvtrim calibrate`` from a ``kvtrim eval`` sweep; a
file made for another model is passed as ``calibration=PATH`` (``--calibration PATH``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrim import validate
from kvtrim.errors import KVTrimError
from kvtrim.files import parse_json, read_bytes, write_atomic

if TYPE_CHECKING:
    from kvtrim.policies.base import Policy

#: the calibration file format written: 2 adds ``bits`` per point; format 1 files are read as 16-bit
FORMAT = 2
READ_FORMATS = (1, 2)

#: the definition recorded in every calibration file (the module docstring says it in full)
AGREEMENT = ("per sample: min(1, score / full cache's score) on labelled tasks (samples the full cache gets "
             "wrong left out), ROUGE-L F1 against the full cache's answer on labelfree; mean per task, then "
             "mean over tasks")

#: the full cache's method name: a calibration's points under it are the full cache at low bit widths (keep 1)
FULL = "full"

#: the command that makes a calibration (named in errors)
CALIBRATE_COMMAND = "kvtrim calibrate --model MODEL --out FILE.json"

#: a prompt within this share of a calibrated length counts as that length (a calibration's lengths are
#: ``kvtrim eval``'s, the prompt text without the chat template, which adds a few dozen tokens)
LENGTH_TOLERANCE = 0.1

#: the model fields a calibration's fingerprint records (a loaded model must match them)
FINGERPRINT_KEYS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                    "vocab_size")


def model_fingerprint(model) -> dict:
    """The architecture fields (``FINGERPRINT_KEYS``) of a transformers model's (or config's) text config."""
    cfg = getattr(model, "config", model)
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)
    return {k: getattr(cfg, k, None) for k in FINGERPRINT_KEYS}


def lowbit_share(bits: int, head_dim: int) -> float:
    """Bytes per stored token of a ``bits``-bit cache over a 16-bit one's: the low-bit storage's own
    layout formula (``kvtrim.lowbit_storage.byte_share``); 1.0 at 16 bits."""
    if bits == 16:
        return 1.0
    from kvtrim.lowbit_storage import byte_share  # the storage knows its layout (imports torch: only here)

    return byte_share(bits, head_dim)


@dataclass(frozen=True)
class Point:
    """One calibrated (method, length, keep, bits): mean agreement over tasks, per task, samples used, KV share
    (``kv_frac``: measured resident bytes over the uncompressed 16-bit cache's)."""

    length: int
    keep: float
    agreement: float
    n: int
    tasks: dict = field(default_factory=dict)
    kv_frac: float | None = None
    bits: int = 16

    @property
    def credit(self) -> float:
        """The agreement the picking rule credits this point with: its worst task's (the mean over
        tasks where no per-task values were recorded)."""
        return min((t["agreement"] for t in self.tasks.values()), default=self.agreement)


@dataclass(frozen=True)
class BudgetChoice:
    """What :meth:`Calibration.choose` picked and why (``keep == 1.0``: the full cache)."""

    method: str
    quality: float
    prompt_tokens: int | None
    keep: float
    expected: float | None  # the calibrated agreement credited to ``keep`` (None: full cache, agreement 1 by definition)
    lengths: tuple[int, ...]  # the calibrated lengths the pick came from
    extrapolated: bool
    reason: str
    kv_bits: int = 16  # the bits per stored key and value element to build the cache with (KVTrimCache(kv_bits=))
    memory: float | None = None  # the pick's KV share of the uncompressed 16-bit cache (picks among bit widths only)
    memory_source: str | None = None  # "measured" (the calibration's kv_frac) or "formula" (lowbit_share)
    bit_widths: tuple[int, ...] = (16,)  # the bit widths the method's calibration holds (16 alone: keep picked as before)

    @property
    def full(self) -> bool:
        """The full cache at 16 bits (no compression, no quantization)."""
        return self.keep >= 1.0 and self.kv_bits == 16

    @property
    def whole(self) -> bool:
        """Nothing evicted: the full cache, at ``kv_bits`` (a pick at a low bit width may be the full cache quantized)."""
        return self.keep >= 1.0

    def to_dict(self) -> dict:
        return {"method": self.method, "quality": self.quality, "prompt_tokens": self.prompt_tokens, "keep": self.keep,
                "kv_bits": self.kv_bits, "expected_agreement": self.expected, "calibrated_lengths": list(self.lengths),
                "extrapolated": self.extrapolated, "reason": self.reason, "memory": self.memory,
                "memory_source": self.memory_source}


def _credited(points: list[Point]) -> list[tuple[float, float]]:
    """(keep, credited agreement) ascending in keep: the lowest worst-task agreement (``Point.credit``)
    measured at this or any larger keep."""
    out: list[tuple[float, float]] = []
    low = math.inf
    for p in sorted(points, key=lambda p: p.keep, reverse=True):
        low = min(low, p.credit)
        out.append((p.keep, low))
    return out[::-1]


def _credit_at(points: list[Point], keep: float) -> float | None:
    """Credited agreement of ``keep`` at one length: that of the largest calibrated keep <= ``keep``."""
    below = [a for k, a in _credited(points) if k <= keep + 1e-9]
    return below[-1] if below else None


@dataclass
class Calibration:
    """Agreement with the full cache per (method, prompt length, keep) for one model (see the module docstring)."""

    model: dict  # {"key", "source", "fingerprint"}
    methods: dict[str, list[Point]]
    made: dict = field(default_factory=dict)
    path: str | None = None

    # --- file -------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Any, where: str = "calibration") -> Calibration:
        """Check and build from the JSON object of a calibration file; ``KVTrimError`` naming the problem."""

        def bad(msg: str) -> KVTrimError:
            return KVTrimError(f"{where}: {msg}; remake it with `{CALIBRATE_COMMAND}`")

        if not isinstance(d, dict):
            raise bad(f"not a JSON object (got {type(d).__name__})")
        fmt = d.get("format")
        if isinstance(fmt, bool) or fmt not in READ_FORMATS:
            raise bad(f"format {fmt!r} is not one of {', '.join(map(str, READ_FORMATS))}")
        model = d.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("key"), str) or not model["key"]:
            raise bad("'model' must be an object with a non-empty 'key'")
        if not isinstance(model.get("fingerprint", {}), dict):
            raise bad("'model.fingerprint' must be an object")
        methods = d.get("methods")
        if not isinstance(methods, dict) or not methods:
            raise bad("'methods' must be a non-empty object of method -> list of points")
        out: dict[str, list[Point]] = {}
        for name, pts in methods.items():
            if not isinstance(pts, list) or not pts:
                raise bad(f"method {name!r} has no points")
            seen = set()
            parsed = []
            for j, p in enumerate(pts):
                at = f"method {name!r} point {j}"
                if not isinstance(p, dict):
                    raise bad(f"{at} is not an object")
                try:
                    length = validate.integer(p.get("length"), f"{at}: length", minimum=1)
                    bits = 16 if fmt == 1 else p.get("bits", 16)  # format 1 predates bit widths: 16-bit points
                    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in validate.KV_BITS:
                        raise KVTrimError(f"{at}: bits must be one of 16, 8, 4, 2; got {bits!r}")
                    # keep 1 (nothing evicted) is a point only at a low bit width: at 16 bits it is the reference
                    keep = validate.number(p.get("keep"), f"{at}: keep", minimum=0, maximum=1, min_open=True,
                                           max_open=bits == 16)
                    agreement = validate.number(p.get("agreement"), f"{at}: agreement", minimum=0, maximum=1)
                    n = validate.integer(p.get("n"), f"{at}: n", minimum=1)
                    kv = p.get("kv_frac")
                    kv = None if kv is None else validate.number(kv, f"{at}: kv_frac", minimum=0)
                except KVTrimError as e:
                    raise bad(str(e)) from None
                tasks = p.get("tasks", {})
                if not isinstance(tasks, dict):
                    raise bad(f"{at}: 'tasks' must be an object")
                for task, t in tasks.items():  # the picking rule reads each task's agreement (Point.credit)
                    if not isinstance(t, dict):
                        raise bad(f"{at}: task {task!r} must be an object with its 'agreement'")
                    try:
                        validate.number(t.get("agreement"), f"{at}: task {task!r} agreement", minimum=0, maximum=1)
                    except KVTrimError as e:
                        raise bad(str(e)) from None
                if (length, keep, bits) in seen:
                    raise bad(f"{at}: a second point for length {length}, keep {keep}, {bits} bits")
                seen.add((length, keep, bits))
                parsed.append(Point(length, keep, agreement, n, tasks, kv, bits))
            out[name] = sorted(parsed, key=lambda p: (p.length, -p.bits, p.keep))
        return cls(model=model, methods=out, made=d.get("made", {}) if isinstance(d.get("made"), dict) else {})

    def to_dict(self) -> dict:
        return {"format": FORMAT, "agreement": AGREEMENT, "model": self.model, "made": self.made,
                "methods": {m: [{"length": p.length, "keep": p.keep, "agreement": round(p.agreement, 6), "n": p.n,
                                 "tasks": p.tasks, "kv_frac": p.kv_frac, "bits": p.bits} for p in pts]
                            for m, pts in sorted(self.methods.items())}}

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """The calibration in the JSON file ``path`` (read through :func:`kvtrim.files.read_bytes`: a
        regular file within the JSON size limit); ``KVTrimError`` naming what is wrong."""
        p = Path(path)
        data = read_bytes(p, "calibration")
        try:
            d = parse_json(data, "calibration", p)
        except KVTrimError as e:
            raise KVTrimError(f"{e}; remake it with `{CALIBRATE_COMMAND}`") from None
        cal = cls.from_dict(d, f"calibration {str(p)!r}")
        cal.path = str(p)
        return cal

    def save(self, path: str | os.PathLike, *, force: bool = True) -> None:
        """Write the calibration as JSON, atomically (:func:`kvtrim.files.write_atomic`: never through a
        symbolic link); ``force=False`` refuses an existing file."""
        write_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n", force=force)

    # --- picking ----------------------------------------------------------------------------------
    def at_bits(self, bits: int = 16) -> Calibration:
        """This calibration with only its points at ``bits`` (16: what a calibration made without
        ``--kv-bits`` would hold, so its picks can be compared with the bit-width picks); a method
        left with no point there (the full cache's low-bit points, at 16) is dropped."""
        methods = {m: [p for p in pts if p.bits == bits] for m, pts in self.methods.items()}
        methods = {m: pts for m, pts in methods.items() if pts}
        if not methods:
            raise KVTrimError(f"the calibration of {self.model['key']!r} has no point at {bits} bits")
        return replace(self, methods=methods)

    def points(self, method: str) -> list[Point]:
        if method not in self.methods:
            raise KVTrimError(
                f"the calibration of {self.model['key']!r} has no method {method!r} (calibrated: "
                f"{', '.join(sorted(self.methods))}); add it with `kvtrim calibrate --model {self.model['key']} "
                f"--methods {method} --out FILE.json` and pass --calibration FILE.json")
        return self.methods[method]

    def candidates(self, method: str) -> list[Point]:
        """The points ``--quality`` chooses among for ``method``: its own, and the full cache's at low bit
        widths (``FULL``'s points, keep 1: nothing evicted, every token quantized)."""
        own = self.points(method)
        return own + [p for p in self.methods.get(FULL, []) if p.bits != 16 and method != FULL]

    def lengths(self, method: str) -> list[int]:
        return sorted({p.length for p in self.points(method)})

    def pick_at_length(self, method: str, length: int, quality: float) -> tuple[float, float | None]:
        """(keep, credited agreement) at one calibrated length: the smallest calibrated keep whose credited
        agreement is >= ``quality``; (1.0, None) -- the full cache -- when none is."""
        pts = [p for p in self.points(method) if p.length == length and p.bits == 16]
        for keep, credit in _credited(pts):
            if credit >= quality - 1e-12:
                return keep, credit
        return 1.0, None

    def choose(self, method: str, quality: float, prompt_tokens: int | None = None) -> BudgetChoice:
        """The smallest budget expected to keep agreement >= ``quality`` (the module docstring's rule).

        ``prompt_tokens`` None: the largest pick over all calibrated lengths, for callers that do not
        know the prompt's length yet."""
        quality = check_quality(quality)
        from kvtrim.registry import create_policy, get_policy_class

        if not get_policy_class(method).takes_budget:
            raise KVTrimError(f"method {method!r} takes no budget; --quality picks a budget for a compressing method")
        if prompt_tokens is not None:
            prompt_tokens = validate.integer(prompt_tokens, "prompt_tokens", minimum=0, unit="tokens")
            probe = create_policy(method, keep=0.5)
            if probe.kept_whole(prompt_tokens):
                widths = tuple(sorted({p.bits for p in [*self.methods.get(method, []), *self.methods.get(FULL, [])]}
                                      | {16}, reverse=True))
                return BudgetChoice(method, quality, prompt_tokens, 1.0, None, (), False,
                                    f"the prompt has {prompt_tokens} tokens, at most {probe.min_length}: too short for "
                                    "compression to save memory, kept whole", bit_widths=widths)
        lengths = self.lengths(method)
        extrapolated = False
        if prompt_tokens is None:
            used = lengths
        else:
            near = [n for n in lengths if abs(prompt_tokens - n) <= LENGTH_TOLERANCE * n]
            below = [n for n in lengths if n <= prompt_tokens]
            above = [n for n in lengths if n >= prompt_tokens]
            if near:
                used = [min(near, key=lambda n: abs(prompt_tokens - n))]
            else:
                used = sorted({*(below[-1:]), *(above[:1])})
                extrapolated = not below or not above
        if any(p.bits != 16 for p in self.candidates(method)):
            return replace(self._choose_bits(method, quality, prompt_tokens, used, extrapolated),
                           bit_widths=tuple(sorted({p.bits for p in self.candidates(method)} | {16}, reverse=True)))
        picks = {n: self.pick_at_length(method, n, quality) for n in used}
        keep = max(k for k, _ in picks.values())
        if keep >= 1.0:
            best = max(self.points(method), key=lambda p: (p.credit, -p.keep))
            short = [n for n, (k, _) in picks.items() if k >= 1.0]
            return BudgetChoice(method, quality, prompt_tokens, 1.0, None, tuple(used), extrapolated,
                                f"no calibrated budget of {method} reaches agreement {quality:g} on every calibrated task "
                                f"at {short[0]} tokens (best worst-task agreement: {best.credit:.3f} at keep {best.keep:g}, "
                                f"{best.length} tokens): full cache")
        credits = [_credit_at([p for p in self.points(method) if p.length == n], keep) for n in used]
        expected = min(c for c in credits if c is not None)
        where = ", ".join(f"{n}" for n in used)
        return BudgetChoice(method, quality, prompt_tokens, keep, expected, tuple(used), extrapolated,
                            f"calibrated agreement {expected:.3f} (worst task) >= {quality:g} at keep {keep:g} ({where} tokens"
                            f"{'; outside the calibrated lengths, nearest used' if extrapolated else ''})")


    def head_dim(self) -> int | None:
        """The model's head dimension from the fingerprint (hidden size over attention heads), if recorded."""
        fp = self.model.get("fingerprint") or {}
        h, n = fp.get("hidden_size"), fp.get("num_attention_heads")
        return h // n if isinstance(h, int) and isinstance(n, int) and n > 0 else None

    def _choose_bits(self, method: str, quality: float, prompt_tokens: int | None, used: list[int],
                     extrapolated: bool) -> BudgetChoice:
        """The (keep, bits) pair with the least memory meeting ``quality`` at every length in ``used``
        (the module docstring's rule for calibrations with bit widths)."""
        pts = self.candidates(method)
        meeting = []  # (keep, bits, credited agreement: the lowest over the lengths used)
        for keep, bits in sorted({(p.keep, p.bits) for p in pts}):
            credits = [_credit_at([p for p in pts if p.length == n and p.bits == bits], keep) for n in used]
            if all(c is not None and c >= quality - 1e-12 for c in credits):
                meeting.append((keep, bits, min(c for c in credits if c is not None)))
        where = ", ".join(f"{n}" for n in used)
        if not meeting:
            best = max(pts, key=lambda p: (p.credit, -p.keep))
            return BudgetChoice(method, quality, prompt_tokens, 1.0, None, tuple(used), extrapolated,
                                f"no calibrated (keep, bits) of {method} reaches agreement {quality:g} on every calibrated "
                                f"task at {where} tokens (best worst-task agreement: {best.credit:.3f} at keep {best.keep:g}, "
                                f"{best.bits} bits, {best.length} tokens): full cache")

        def measured(keep: float, bits: int) -> float | None:
            at = [p.kv_frac for p in pts if p.keep == keep and p.bits == bits and p.length in used]
            return sum(at) / len(at) if len(at) == len(used) and None not in at else None  # type: ignore[arg-type]

        shares = {(k, b): measured(k, b) for k, b, _ in meeting}
        source = "measured" if all(v is not None for v in shares.values()) else "formula"
        hd = self.head_dim() or 64

        def memory(keep: float, bits: int) -> float:
            v = shares[(keep, bits)]
            return v if source == "measured" and v is not None else keep * lowbit_share(bits, hd)

        keep, bits, expected = min(meeting, key=lambda c: (round(memory(c[0], c[1]), 6), -c[1], -c[2]))
        mem = memory(keep, bits)
        smallest16 = next((k for k, b, _ in meeting if b == 16), None)
        than = ("" if bits == 16 else f"; the smallest 16-bit keep reaching it is {smallest16:g}" if smallest16 is not None
                else "; no 16-bit keep reaches it")
        return BudgetChoice(method, quality, prompt_tokens, keep, expected, tuple(used), extrapolated,
                            f"calibrated agreement {expected:.3f} (worst task) >= {quality:g} at keep {keep:g}"
                            f"{' (the full cache, nothing evicted)' if keep >= 1.0 else ''}, {bits}-bit KV "
                            f"({where} tokens{'; outside the calibrated lengths, nearest used' if extrapolated else ''}), "
                            f"the least memory of the pairs reaching it: {mem:.3f} of the full cache ({source}){than}",
                            kv_bits=bits, memory=mem, memory_source=source)


def check_quality(quality) -> float:
    """A quality target in (0, 1]; ``KVTrimError`` otherwise."""
    if not isinstance(quality, (int, float)) or isinstance(quality, bool) or math.isnan(float(quality)) \
            or not 0.0 < float(quality) <= 1.0:
        raise KVTrimError(f"quality must be a target agreement with the full cache in (0, 1], e.g. 0.95; got {quality!r}")
    return float(quality)


# --- shipped calibrations ----------------------------------------------------------------------------
def shipped() -> dict[str, Calibration]:
    """The calibrations shipped in the package, by model key."""
    root = resources.files("kvtrim") / "calibration"
    out = {}
    if root.is_dir():
        for f in sorted(root.iterdir(), key=lambda f: f.name):
            if f.name.endswith(".json"):
                d = parse_json(f.read_bytes(), "shipped calibration", f.name)  # package data: a Traversable
                cal = Calibration.from_dict(d, f"shipped calibration {f.name}")
                cal.path = f.name
                out[cal.model["key"]] = cal
    return out


def _label(model) -> str:
    if model is None:
        return "the embedded model (smollm2)"
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    return str(getattr(model, "source", None) or getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__)


def calibration_for(model, calibration: str | os.PathLike | Calibration | None = None) -> Calibration:
    """The calibration of ``model``: ``calibration`` when given (a file or object), else the shipped one.

    ``model``: None (the embedded default), a reference model's short name or alias, a model label
    (``LoadedModel.source``), a ``kvtrim.models.LoadedModel`` or a transformers model (matched by the
    calibration's model name in its path and its architecture fingerprint). Raises ``KVTrimError``
    naming ``kvtrim calibrate`` when there is none.
    """
    from kvtrim import reference_models

    cals = {} if calibration is not None else shipped()
    found = None
    if isinstance(calibration, Calibration):
        found = calibration
    elif calibration is not None:
        found = Calibration.load(calibration)
    elif model is None:
        found = cals.get(reference_models.SMOLLM2.key)
    elif isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        ref = reference_models.lookup(text)
        key = ref.key if ref is not None else None
        found = cals.get(key) if key else next(
            (c for c in cals.values() if str(c.model.get("source", "")).lower() == text.strip().lower()), None)
    else:
        source = getattr(model, "source", None)
        net = getattr(model, "model", model)
        name = str(getattr(getattr(net, "config", None), "name_or_path", "") or "")
        fp = model_fingerprint(net) if hasattr(net, "config") else None
        for c in cals.values():
            src = str(c.model.get("source", ""))
            # a LoadedModel by its label; a bare transformers model by the name in its path and its architecture
            by_label = source is not None and source == src
            if by_label or (source is None and src and src in name and fp == c.model.get("fingerprint")):
                found = c
    if found is None:
        raise KVTrimError(
            f"no auto-budget calibration for {_label(model)} (shipped: {', '.join(sorted(cals)) or 'none'}); make one "
            f"with `{CALIBRATE_COMMAND}` and pass it with --calibration FILE.json (calibration= in Python), or give "
            "a budget (--keep/--max-tokens)")
    if not isinstance(model, (str, os.PathLike)) and model is not None:
        net = getattr(model, "model", model)
        want = found.model.get("fingerprint")
        if hasattr(net, "config") and want and model_fingerprint(net) != want:
            raise KVTrimError(f"the calibration of {found.model['key']!r}{' in ' + found.path if found.path else ''} was made "
                              f"on another architecture ({want}); make one for this model with `{CALIBRATE_COMMAND}`")
    return found


def keep_for_quality(method: str, model, quality: float, prompt_tokens: int | None = None, *,
                     calibration: str | os.PathLike | Calibration | None = None) -> BudgetChoice:
    """Pick ``method``'s budget on ``model`` for a target agreement with the full cache (module docstring).

    Returns a :class:`BudgetChoice`; its ``keep`` is 1.0 (the full cache) for a prompt too short to
    compress and when no calibrated budget is expected to reach ``quality``. ``prompt_tokens`` None
    takes the largest pick over the calibrated lengths. Where the calibration holds bit widths, the
    choice is the (keep, bits) pair with the least memory: build the cache with
    ``KVTrimCache(model, policy, kv_bits=choice.kv_bits)`` (``generate_ids(..., kv_bits=)``,
    ``Session(..., kv_bits=)``).
    """
    check_quality(quality)
    return calibration_for(model, calibration).choose(method, quality, prompt_tokens)


def policy_for_quality(method: str, model, quality: float, prompt_tokens: int | None = None, *,
                       calibration: str | os.PathLike | Calibration | None = None,
                       **kwargs) -> tuple[Policy, BudgetChoice]:
    """The policy :func:`keep_for_quality` picks, with the choice: ``method`` at the chosen ``keep``
    (``kwargs``, e.g. ``position``, passed on), or ``full`` when the choice is the full cache. The
    bit width is the cache's, not the policy's: pass ``kv_bits=choice.kv_bits`` where the cache is made."""
    from kvtrim.registry import create_policy

    choice = keep_for_quality(method, model, quality, prompt_tokens, calibration=calibration)
    pol = create_policy(FULL) if choice.whole else create_policy(method, keep=choice.keep, **kwargs)
    return pol, choice
