"""The file format of a saved :class:`~kvtrim.session.Session`: what ``save`` writes and ``load`` verifies.

A saved session is a directory of three files (format ``kvtrim-session`` v2; docs/sessions.md):

* ``cache.safetensors`` -- the tensors: KV buffers, stream indices, policy token state, the last
  logits and the sampling generator's state (safetensors: no pickle);
* ``session.json`` -- everything else: history, policy name and parameters, counters, pending
  text, per-layer metadata;
* ``manifest.json`` -- the model's fingerprint (architecture, dtype, a digest of sampled weights),
  the directory it was loaded from (``source``: what ``kvtrim chat --load`` loads when not given
  ``--model``), the method, and the SHA-256 of the other two files.

:func:`write_session` writes them into a fresh 0700 directory beside the target, each file 0600
and fsynced (:func:`kvtrim.files.write_atomic`), and renames the directory into place; an
existing session there is replaced only once the new one is complete, anything else there is
refused. :func:`read_session` reads them without following a symbolic link and verifies every
field before anything is used; any mismatch is a :class:`~kvtrim.errors.SessionError` naming
what differs. Sessions of format v1 (no manifest) load with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtrim.errors import SessionError
from kvtrim.files import parse_json, publish_directory, read_bytes, temporary_directory, write_atomic

logger = logging.getLogger(__name__)

FORMAT = "kvtrim-session"
FORMAT_VERSION = 2  # v2: manifest.json (fingerprint, checksums); v1 sessions load with a warning
MANIFEST_FILE = "manifest.json"
SESSION_FILE = "session.json"
CACHE_FILE = "cache.safetensors"
SESSION_FILES = (MANIFEST_FILE, SESSION_FILE, CACHE_FILE)
_WEIGHT_SAMPLES = 64  # elements read from each parameter for the weight digest


@dataclass
class SavedSession:
    """What :func:`read_session` read and verified: ``session.json``'s fields, the tensors of
    ``cache.safetensors``, the conversation's id (None for a v1 session) and the directory as
    messages name it."""

    info: dict
    tensors: dict[str, torch.Tensor]
    session_id: str | None
    where: str


def write_session(directory: str | os.PathLike, model, state: dict, tensors: dict[str, torch.Tensor],
                  session_id: str) -> Path:
    """Write a session's three files into ``directory``, atomically (see the module docstring).

    ``state`` holds the fields of ``session.json`` after its header, in order (``policy`` as
    ``{"name", "params"}``, then chat, plain, prefill_chunk, messages, turns, chunks_fed,
    pending_ids, pending_text, layers); ``tensors`` what goes into ``cache.safetensors``;
    ``session_id`` the conversation's id (the same for every save of one conversation). Each save
    gets an id of its own, so files of two saves cannot be mixed. Returns the directory.
    """
    from safetensors.torch import save as save_bytes

    target = Path(directory)
    ids = {"session": session_id, "save": uuid.uuid4().hex}
    cache_bytes = save_bytes(tensors, metadata={"format": FORMAT, **ids})
    info = {"format": FORMAT, "version": FORMAT_VERSION, **ids, "model": _fingerprint(model), **state}
    try:
        info_bytes = json.dumps(info, indent=1, allow_nan=False).encode()
    except ValueError as e:
        raise SessionError(f"the session cannot be saved as JSON: {e}") from None
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, **ids,
        "model": _fingerprint(model), "dtype": _dtype_name(model), "weights": weights_digest(model),
        "source": str(getattr(model, "name_or_path", "") or "") or None, "policy": state["policy"],
        "files": {SESSION_FILE: _sha256(info_bytes), CACHE_FILE: _sha256(cache_bytes)},
    }
    files = {CACHE_FILE: cache_bytes, SESSION_FILE: info_bytes,
             MANIFEST_FILE: json.dumps(manifest, indent=1).encode()}
    _write_session_dir(target, files)
    return target


def read_session(directory: str | os.PathLike, model) -> SavedSession:
    """Read and verify the session saved in ``directory`` for ``model`` (see the module docstring).

    Verified here: the manifest's checksums of both files, the model's architecture, dtype and
    weight digest, the method, that the files come from the same save, and the type and range of
    every field of ``session.json``. What needs the restored cache (the tensors against the
    counters) is checked by ``Session.load``. Raises :class:`~kvtrim.errors.SessionError`.
    """
    d = Path(directory)
    files = _read_session_dir(d)
    where = f"session {str(d)!r}"
    if MANIFEST_FILE in files:
        manifest = _parse_json(files[MANIFEST_FILE], f"{where}: {MANIFEST_FILE}")
        _check_manifest(manifest, files, model, where)
        info = _parse_json(files[SESSION_FILE], f"{where}: {SESSION_FILE}")
        _check_header(info, where, FORMAT_VERSION)
        for key in ("session", "save"):
            if info.get(key) != manifest[key]:
                raise SessionError(f"{where}: {SESSION_FILE} comes from another save than {MANIFEST_FILE} ({key} differs)")
        if info.get("policy") != manifest["policy"]:
            raise SessionError(f"{where}: {SESSION_FILE} names method {_policy_text(info.get('policy'))}, "
                               f"the manifest {_policy_text(manifest['policy'])}")
    else:
        info = _parse_json(files[SESSION_FILE], f"{where}: {SESSION_FILE}")
        _check_header(info, where, 1)
        logger.warning("%s is a format v1 session (no manifest): its files cannot be verified against damage or "
                       "mixing; save it again to write format v%d", str(d), FORMAT_VERSION)
        manifest = None
    _check_info(info, model, where)
    tensors, meta = _load_tensors(files[CACHE_FILE], where)
    if manifest is not None and (meta.get("session"), meta.get("save")) != (manifest["session"], manifest["save"]):
        raise SessionError(f"{where}: {CACHE_FILE} comes from another session or save than {SESSION_FILE}")
    return SavedSession(info, tensors, None if manifest is None else manifest["session"], where)


def split_tensors(tensors: dict[str, torch.Tensor], model) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """The tensors of ``cache.safetensors`` as ``(cache tensors, rng_state, last_logits or None)``,
    checked against ``model``: KV buffers in the model's dtype, a sampling state, logits of shape
    ``[vocab]`` float32. Raises :class:`~kvtrim.errors.SessionError` (without the directory: the
    caller adds it)."""
    dtype = next(model.parameters()).dtype
    for key, t in tensors.items():
        if key.endswith((".keys", ".values")) and t.dtype != dtype:
            raise SessionError(f"{key} is {_dtype_text(t.dtype)}, the model is {_dtype_text(dtype)}")
    tensors = dict(tensors)
    rng = tensors.pop("rng_state", None)
    logits = tensors.pop("last_logits", None)
    if rng is None or rng.dtype != torch.uint8 or rng.dim() != 1:
        raise SessionError(f"{CACHE_FILE} lacks the sampling state (rng_state)")
    vocab = _vocab_size(model)
    if logits is not None and (logits.dim() != 1 or logits.dtype != torch.float32 or len(logits) != vocab):
        raise SessionError(f"last_logits has shape {tuple(logits.shape)} and dtype {_dtype_text(logits.dtype)}, "
                           f"expected ({vocab},) float32")
    return tensors, rng, logits


def saved_model_source(directory: str | os.PathLike) -> str | None:
    """The directory of the model a session was saved with (``source`` in its manifest), so a command
    can continue the session without being told the model again. None when the manifest has none (a
    v1 session, one saved before kvtrim recorded it, a model made in memory) or cannot be read: the
    full load (:func:`read_session`) then says what is wrong. The link rule holds here too, and the
    manifest is read as every session file is (:func:`kvtrim.files.read_bytes`: a regular file only,
    never blocking on a FIFO)."""
    try:
        path = Path(directory) / MANIFEST_FILE
        manifest = parse_json(read_bytes(path, "session file", follow_symlinks=False, error=SessionError),
                              "session file", path, SessionError)
    except SessionError:
        return None
    source = manifest.get("source") if isinstance(manifest, dict) else None
    return source if isinstance(source, str) and source else None


def check_save_target(directory: str | os.PathLike) -> None:
    """Raise :class:`~kvtrim.errors.SessionError` now if :func:`write_session` (``Session.save``)
    would refuse ``directory`` (a file, a symbolic link, a directory that is not a session) or could
    not create it (a file where a folder above it should be, a folder that cannot be written), so a
    command can refuse it before the model loads and the conversation starts."""
    target = Path(directory)
    _replaceable(target)
    above = target.absolute().parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise SessionError(f"cannot save a session to {str(target)!r}: {str(above)!r} is not a directory")
    if not os.access(above, os.W_OK | os.X_OK):
        raise SessionError(f"cannot save a session to {str(target)!r}: the folder {str(above)!r} cannot be written")


def _fingerprint(model) -> dict:
    """The architecture a session belongs to: the decoder config's sizes and model type."""
    cfg = model.config.get_text_config(decoder=True)
    keys = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size", "head_dim")
    return {k: getattr(cfg, k, None) for k in keys}



def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_name(model) -> str:
    return _dtype_text(next(model.parameters()).dtype)


def _vocab_size(model) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    return int(n) if n is not None else int(model.config.get_text_config(decoder=True).vocab_size)


def weights_digest(model) -> str:
    """SHA-256 over every parameter's name, shape and dtype and the bytes of a fixed sample of its
    elements (``_WEIGHT_SAMPLES`` evenly spaced ones, the first and last included): cheap (a few
    hundred small reads), and any other checkpoint, fine-tune or dtype differs. Packed linears
    (:mod:`kvtrim.cpu_linear`) digest as the plain ones."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in _named_weights(model):
            h.update(f"{name}|{tuple(p.shape)}|{p.dtype}\n".encode())
            n = p.numel()
            if n == 0 or p.device.type == "meta":
                continue
            k = min(_WEIGHT_SAMPLES, n)
            idx = torch.arange(k, dtype=torch.int64) * (n - 1) // max(k - 1, 1)  # exact in int64
            if isinstance(p, _PackedWeight):
                sample = p.module.weight_elements(idx)
            else:
                sample = p.detach().reshape(-1)[idx.to(p.device)]
            # -0.0 reads as +0.0: a packed weight's elements come out of a product, which loses
            # the sign of a zero.
            sample = torch.where(sample == 0, torch.zeros_like(sample), sample)
            h.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _PackedWeight:
    """The weight of a :class:`kvtrim.cpu_linear.PackedLinear` as the digest sees it: the plain
    weight's shape and dtype, its elements read through the module."""

    def __init__(self, module) -> None:
        self.module = module
        self.shape = torch.Size((module.out_features, module.in_features))
        self.dtype = torch.bfloat16
        self.device = torch.device("cpu")

    def numel(self) -> int:
        return self.shape.numel()


def _named_weights(model):
    """``model.named_parameters()`` with each packed linear's weight where the plain linear's was
    (same names, same order), so that packing the linears (:mod:`kvtrim.cpu_linear`) leaves the
    digest as it was."""
    from kvtrim.cpu_linear import PackedLinear

    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        prefix = mod_name + "." if mod_name else ""
        if isinstance(mod, PackedLinear):
            shared = mod._shared_weight
            if shared is None:
                yield prefix + "weight", _PackedWeight(mod)
            elif id(shared) not in seen:
                seen.add(id(shared))
                yield prefix + "weight", shared
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield prefix + pname, p


def _policy_text(policy: Any) -> str:
    if isinstance(policy, dict) and isinstance(policy.get("name"), str):
        return f"{policy['name']!r} {policy.get('params')}"
    return repr(policy)


def _check_no_symlink(path: Path, what: str) -> os.stat_result | None:
    """``lstat`` of ``path`` (``None`` when missing); a symbolic link is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SessionError(f"{what} {str(path)!r}: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):
        raise SessionError(f"{what} {str(path)!r} is a symbolic link; kvtrim does not follow links for sessions")
    return st


def _replaceable(target: Path) -> bool:
    """Whether ``target`` may be replaced by a save: missing, or a directory holding only session files
    (regular files, no links); anything else is refused. Returns whether it exists."""
    st = _check_no_symlink(target, "session directory")
    if st is None:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise SessionError(f"{str(target)!r} exists and is not a directory; give a new or a session directory")
    try:
        names = os.listdir(target)
    except OSError as e:
        raise SessionError(f"cannot read {str(target)!r}: {e.strerror or e}") from None
    others = sorted(n for n in names if n not in SESSION_FILES)
    if others:
        raise SessionError(f"{str(target)!r} is a directory that is not a kvtrim session (it holds {', '.join(others[:3])}"
                           f"{', ...' if len(others) > 3 else ''}); refusing to replace it, give a new directory")
    for n in names:
        st = _check_no_symlink(target / n, "session file")
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise SessionError(f"{str(target / n)!r} is not a regular file; refusing to replace {str(target)!r}")
    return True


def _write_session_dir(target: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into a fresh 0700 directory beside ``target`` and rename it into place.

    An existing session at ``target`` is first renamed aside (``.<name>.old-*``) and removed once the
    new one is in place; if the process dies between the two renames, the old session is left
    under that name.
    """
    exists = _replaceable(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_directory(target)  # .<name>.tmp-*, mode 0700
    except OSError as e:
        raise SessionError(f"cannot save the session to {str(target)!r}: {e.strerror or e}") from None
    try:
        for name, data in files.items():
            write_atomic(tmp / name, data, force=False, mode=0o600)
        publish_directory(tmp, target, replace=exists)  # the old session put back if this fails
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SessionError(f"cannot save the session to {str(target)!r}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_session_dir(d: Path) -> dict[str, bytes]:
    """The session files of ``d`` through :func:`kvtrim.files.read_bytes`: regular files only (a
    FIFO or a device is refused without blocking), links refused and never followed, each within
    its size limit."""
    st = _check_no_symlink(d, "session directory")
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise SessionError(f"{str(d)!r} is not a saved kvtrim session (expected a directory with {SESSION_FILE} and {CACHE_FILE})")
    out: dict[str, bytes] = {}
    for name in SESSION_FILES:
        path = d / name
        if not os.path.lexists(path):
            continue
        out[name] = read_bytes(path, "session file", kind="tensors" if name == CACHE_FILE else "json",
                               error=SessionError, follow_symlinks=False)
    missing = [n for n in (SESSION_FILE, CACHE_FILE) if n not in out]
    if missing:
        raise SessionError(f"{str(d)!r} is not a saved kvtrim session (expected {SESSION_FILE} and {CACHE_FILE}; "
                           f"missing {', '.join(missing)})")
    return out


def _parse_json(data: bytes, what: str) -> dict:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SessionError(f"{what} is not valid JSON ({e}); the file is damaged or cut") from None
    if not isinstance(obj, dict):
        raise SessionError(f"{what} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _check_header(info: dict, where: str, version: int) -> None:
    if info.get("format") != FORMAT or info.get("version") != version:
        raise SessionError(f"{where}: unsupported session format {info.get('format')!r} v{info.get('version')!r} "
                           f"(this kvtrim reads {FORMAT} v1 and v{FORMAT_VERSION})")


def _check_model(saved: Any, model, where: str) -> None:
    now = _fingerprint(model)
    if saved is None:
        raise SessionError(f"{where}: the model fingerprint ('model') is missing")
    if not isinstance(saved, dict):
        raise SessionError(f"{where}: the model fingerprint must be an object, got {type(saved).__name__}")
    diff = [f"{k} {saved.get(k)!r} (this model: {now[k]!r})" for k in now if saved.get(k) != now[k]]
    if diff or set(saved) != set(now):
        raise SessionError(f"{where} was saved with a different model: {'; '.join(diff) or 'other fingerprint keys'}; "
                           "load it with the same model")


def _check_manifest(manifest: dict, files: dict[str, bytes], model, where: str) -> None:
    _check_header(manifest, f"{where}: {MANIFEST_FILE}", FORMAT_VERSION)
    kinds = {"session": str, "save": str, "model": dict, "dtype": str, "weights": str, "policy": dict, "files": dict}
    for key, kind in kinds.items():
        if not isinstance(manifest.get(key), kind):
            raise SessionError(f"{where}: {MANIFEST_FILE} lacks {key!r} (or it is not a {kind.__name__})")
    if not isinstance(manifest.get("source"), (str, type(None))):  # absent in sessions saved before it was recorded
        raise SessionError(f"{where}: {MANIFEST_FILE}: source must be a path or null")
    for name in (SESSION_FILE, CACHE_FILE):
        want = manifest["files"].get(name)
        if not isinstance(want, str):
            raise SessionError(f"{where}: {MANIFEST_FILE} has no checksum for {name}")
        if _sha256(files[name]) != want:
            raise SessionError(f"{where}: {name} does not match its SHA-256 in {MANIFEST_FILE} ({len(files[name])} bytes): "
                               "the file was damaged, cut, edited or replaced")
    _check_model(manifest["model"], model, where)
    if manifest["dtype"] != _dtype_name(model):
        raise SessionError(f"{where} was saved with a {manifest['dtype']} model, this model is {_dtype_name(model)}; "
                           f"load the model as {manifest['dtype']} (load_model(..., dtype={manifest['dtype']!r}), --dtype {manifest['dtype']})")
    if manifest["weights"] != weights_digest(model):
        raise SessionError(f"{where} was saved with other weights (the weight digest differs: another checkpoint "
                           "or fine-tune of the same architecture); load it with the model it was saved with")


def _check_info(info: dict, model, where: str) -> None:
    """Types and ranges of every field of ``session.json`` (any format)."""
    _check_model(info.get("model"), model, where)

    def need(key: str, ok: bool, what: str) -> None:
        if key not in info:
            raise SessionError(f"{where}: {SESSION_FILE} lacks {key!r}")
        if not ok:
            raise SessionError(f"{where}: {SESSION_FILE}: {key} must be {what}, got {json.dumps(info[key])[:60]}")

    def is_int(x: Any, minimum: int = 0) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= minimum

    pol = info.get("policy")
    need("policy", isinstance(pol, dict) and isinstance(pol.get("name"), str) and isinstance(pol.get("params"), dict),
         'an object {"name": str, "params": object}')
    need("chat", isinstance(info.get("chat"), bool), "true or false")
    if "plain" in info:  # sessions saved before the plain prompt format have none (= false)
        need("plain", isinstance(info["plain"], bool), "true or false")
    need("prefill_chunk", info.get("prefill_chunk") is None or is_int(info.get("prefill_chunk"), 1),
         "null or a positive integer")
    msgs = info.get("messages")
    need("messages", isinstance(msgs, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs),
        'a list of {"role": str, "content": str}')
    need("turns", isinstance(info.get("turns"), list) and all(isinstance(t, dict) for t in info["turns"]),
         "a list of objects")
    need("chunks_fed", is_int(info.get("chunks_fed")), "a non-negative integer")
    vocab = _vocab_size(model)
    pend = info.get("pending_ids")
    need("pending_ids", isinstance(pend, list) and all(is_int(t) for t in pend), "a list of token ids")
    bad = [t for t in info["pending_ids"] if t >= vocab]
    if bad:
        raise SessionError(f"{where}: {SESSION_FILE}: pending token id {bad[0]} is outside the model's vocabulary "
                           f"of {vocab}")
    need("pending_text", isinstance(info.get("pending_text"), str), "a string")
    if info["pending_text"] and not info["chat"]:
        raise SessionError(f"{where}: {SESSION_FILE}: chat is false but chat-template text is pending; "
                           "the chat flag was changed")
    layers = info.get("layers")
    need("layers", isinstance(layers, list) and all(m is None or isinstance(m, dict) for m in layers),
         "a list of per-layer objects")


def _load_tensors(data: bytes, where: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and header metadata of a safetensors file held in memory."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_bytes

    try:
        n = int.from_bytes(data[:8], "little")
        if len(data) < 8 or n > len(data) - 8:
            raise ValueError(f"the header of {n} bytes does not fit in {len(data)} bytes")
        header = json.loads(data[8 : 8 + n])
        meta = header.get("__metadata__") or {}
        tensors = load_bytes(data)
    except (SafetensorError, ValueError, AttributeError, RuntimeError) as e:
        raise SessionError(f"{where}: {CACHE_FILE} is not a readable safetensors file ({e}); the file is damaged or "
                           "cut") from None
    return tensors, meta
