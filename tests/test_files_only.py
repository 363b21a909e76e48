"""Every file kvtrim writes or reads goes through :mod:`kvtrim.files` (issue 48: "one module for
files"), checked from the source: every call under src/kvtrim that opens, writes, renames or reads a
file by itself (``open``, ``Path.write_text``/``read_text``/..., ``json.dump``/``json.load``,
``os.open``/``os.replace``/``os.rename``, ``tempfile``, ``savefig``, ``save_pretrained``, ...) is
found with ``ast``; outside kvtrim/files.py each one needs an allowance below that says why it may
bypass the helpers. An allowance that no longer matches a call fails the test too, so the list
stays exact.

Counted by this scanner (``_calls``), before kvtrim.files (commit b2235d6) the package wrote files by
hand in 41 calls in 24 functions of 10 modules, among them five hand-written atomic writes
(``models._write_atomic``, ``reference_models.assemble``, ``eval.store._move_out``,
``harness.write_json``, ``session._write_session_dir``), and read them in 32 calls; now 3 write calls
in 2 functions remain (WRITE_ALLOWED) and 15 reads of weights' headers, the kernel's files and
package data (READ_ALLOWED), each with its reason.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvtrim"

#: attribute calls that write or move a file (``x.write_text(...)``, ``os.replace(...)``)
WRITES = {"write_text", "write_bytes", "dump", "replace", "rename", "link", "symlink", "fdopen", "savefig",
          "save_pretrained", "mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory", "copy", "copy2",
          "copyfile", "move", "save", "touch"}
#: attribute calls that read a file (``x.read_text()``, ``json.load(f)``, ``torch.load(p)``)
READS = {"read_text", "read_bytes", "load", "safe_open", "load_file"}
#: receivers whose ``.replace``/``.save``/``.load``/``.dump``/``.copy`` are not file operations
#: (``str.replace``, ``Calibration.save``-style methods that themselves call kvtrim.files are
#: checked where they are defined); only these receivers' calls of the ambiguous names count
FILE_MODULES = {"os", "shutil", "json", "torch", "tempfile", "safetensors", "pickle", "np", "numpy"}
AMBIGUOUS = {"replace", "dump", "load", "save", "copy", "move", "link", "symlink", "rename"}

#: (module, function, call) -> why it may write without kvtrim.files
WRITE_ALLOWED = {
    ("gguf.py", "convert_gguf", "save_pretrained"):
        "transformers writes the converted model's files into a temporary_directory, which publish_directory "
        "puts in place in one rename once the marker is written",
    ("cli/__init__.py", "main", "os.open"):
        "opens /dev/null for stdout after the reader of a pipe has gone (a closed stdout ends quietly)",
}
#: (module, function, call) -> why it may read without kvtrim.files
READ_ALLOWED = {
    ("reference_models.py", "_sha256", "open"): "hashes an installed model file in 16 MiB pieces (weights are "
                                                 "never read whole); the cache path is kvtrim's own",
    ("reference_models.py", "concatenate", "open"): "copies the pip-installed parts of a reference model, in pieces, "
                                                     "into write_atomic's temporary file",
    ("gguf.py", "_check_gguf_magic", "open"): "reads a GGUF's first 4 bytes, after check_regular",
    ("gguf.py", "convert_gguf", "open"): "reopens the files transformers wrote, to fsync them before the marker",
    ("gguf.py", "_sha256_of", "open"): "hashes a weight file in pieces",
    ("models.py", "_check_safetensors", "open"): "reads a safetensors header (8 bytes + its length), after "
                                                  "check_regular",
    ("cli/serve.py", "weight_bytes", "open"): "reads a safetensors header, after check_regular",
    ("cli/serve.py", "available_memory", "read_text"): "the kernel's /proc/meminfo",
    ("machine.py", "_cpuinfo", "open"): "the kernel's /proc/cpuinfo",
    ("machine.py", "l2_cache_kib", "open"): "the kernel's /sys CPU cache files",
    ("session.py", "rss_bytes", "open"): "the kernel's /proc/self/statm, once per turn",
    ("vlm.py", "load_image", "Image.open"): "decodes an image from the bytes files.read_bytes read (io.BytesIO)",
    ("budget.py", "shipped", "read_bytes"): "package data (an importlib.resources Traversable, perhaps in a zip), "
                                            "parsed with files.parse_json",
    ("integrations/prefill.py", "shipped_configs", "read_bytes"): "package data (an importlib.resources "
                                                                  "Traversable), parsed with files.parse_json",
}


def _writes(call: ast.Call) -> bool:
    """Whether ``open(...)`` opens for writing: a mode with w, a, x or + (an unknown mode counts as writing)."""
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None:
        return False
    return not (isinstance(mode, ast.Constant) and isinstance(mode.value, str)) or any(c in mode.value for c in "wax+")


def _visit(node: ast.AST, module: str, func: str, out: list) -> None:
    """Append (kind, module, function, call, line) for each file operation under ``node``."""
    for child in ast.iter_child_nodes(node):
        name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
        if isinstance(child, ast.Call):
            f = child.func
            if isinstance(f, ast.Name) and f.id == "open":
                out.append(("write" if _writes(child) else "read", module, func, "open", child.lineno))
            elif isinstance(f, ast.Attribute):
                owner = f.value.id if isinstance(f.value, ast.Name) else None
                if owner == "files" or (f.attr in AMBIGUOUS and owner not in FILE_MODULES):
                    pass  # kvtrim.files' own functions; str.replace, a class's own save/load
                elif owner == "os" and f.attr == "open":
                    out.append(("write", module, func, "os.open", child.lineno))
                elif f.attr == "open":  # Path.open(mode), Image.open(...), gzip.open(...)
                    mode = child.args[0] if child.args and owner is None else None
                    writes = isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(
                        c in mode.value for c in "wax+")
                    out.append(("write" if writes else "read", module, func, f"{owner or ''}.open", child.lineno))
                elif f.attr in WRITES:
                    out.append(("write", module, func, f"{owner}.{f.attr}" if owner in FILE_MODULES else f.attr,
                                child.lineno))
                elif f.attr in READS:
                    out.append(("read", module, func, f.attr, child.lineno))
        _visit(child, module, name, out)


def _calls() -> list[tuple[str, str, str, str, int]]:
    """(kind, module, function, call, line) for every file operation outside kvtrim/files.py."""
    out: list = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module != "files.py":
            _visit(ast.parse(path.read_text(), str(path)), module, "<module>", out)
    return out


CALLS = _calls()


def test_every_write_goes_through_kvtrim_files():
    writes = [c for c in CALLS if c[0] == "write"]
    found = {(m, fn, call) for _, m, fn, call, _ in writes}
    bad = [f"{m}:{line} {fn}() calls {call}" for _, m, fn, call, line in writes if (m, fn, call) not in WRITE_ALLOWED]
    assert not bad, ("files written without kvtrim.files (use write_atomic, append, publish_directory):\n"
                     + "\n".join(bad))
    stale = [str(k) for k in WRITE_ALLOWED if k not in found]
    assert not stale, "write allowances no longer needed (delete them):\n" + "\n".join(stale)


def test_every_read_goes_through_kvtrim_files():
    reads = [c for c in CALLS if c[0] == "read"]
    found = {(m, fn, call) for _, m, fn, call, _ in reads}
    bad = [f"{m}:{line} {fn}() calls {call}" for _, m, fn, call, line in reads if (m, fn, call) not in READ_ALLOWED]
    assert not bad, ("files read without kvtrim.files (use read_bytes, read_text, read_json, check_regular):\n"
                     + "\n".join(bad))
    stale = [str(k) for k in READ_ALLOWED if k not in found]
    assert not stale, "read allowances no longer needed (delete them):\n" + "\n".join(stale)


def test_the_check_finds_what_it_looks_for(tmp_path, monkeypatch):
    """The scanner itself: a direct write, read and rename in a module are found (a test that cannot fail
    would prove nothing)."""
    pkg = tmp_path / "kvtrim"
    pkg.mkdir()
    (pkg / "files.py").write_text("open('x', 'w')\n")  # the helpers' own module is exempt
    (pkg / "bad.py").write_text(
        "import json, os\nfrom pathlib import Path\n"
        "def f(p):\n    Path(p).write_text('x')\n    json.dump({}, open(p, 'w'))\n    os.replace(p, p + '.1')\n"
        "def g(p):\n    return Path(p).read_text(), 'a'.replace('a', 'b'), Path(p).open('ab')\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    got = sorted((kind, fn, call) for kind, _, fn, call, _ in _calls())
    assert got == [("read", "g", "read_text"), ("write", "f", "json.dump"), ("write", "f", "open"),
                   ("write", "f", "os.replace"), ("write", "f", "write_text"), ("write", "g", ".open")]
