"""The layering of docs/architecture.md, checked from the source: every import statement of every
module under src/kvtrim (top-level, inside functions and under ``TYPE_CHECKING`` alike) is read
with ``ast``, and each rule below names the modules that break it.

An allowance is a (module, imported module) pair that breaks a rule on purpose; each carries its
reason. An allowance that no longer matches an import fails the test too, so the lists stay exact.

The last tests keep the repository self-contained: no reference to files outside it, no internal
jargon, no relative link in the docs to a missing file.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kvtrim"


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the file that imports
    target: str  # dotted module imported (``from a.b import c`` gives ``a.b.c`` when that is a module)
    name: str | None  # the name taken by ``from ... import name``; None for ``import x``
    line: int

    def where(self) -> str:
        return f"{self.importer}:{self.line} imports {self.target}" + (f" ({self.name})" if self.name else "")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def read_imports(name: str, path: Path) -> list[Import]:
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(name, a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: resolve against the importing package
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append(Import(name, sub if sub in MODULES else base, a.name, node.lineno))
    return out


IMPORTS = [imp for name, path in MODULES.items() for imp in read_imports(name, path)]


def top(target: str) -> str:
    return target.split(".")[0]


def inside(target: str, *prefixes: str) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def layer(module: str) -> str:
    """The layer a kvtrim module belongs to (docs/architecture.md)."""
    if inside(module, "kvtrim.attention"):
        return "kernels"
    if inside(module, "kvtrim.policies"):
        return "policies"
    if inside(module, "kvtrim.integrations"):
        return "integrations"
    if inside(module, "kvtrim.eval", "kvtrim.tools", "kvtrim.cli", "kvtrim.__main__"):
        return "top"
    return "core"


def check(rule, allowances: dict[tuple[str, str], str]) -> None:
    """Fail with every import that breaks ``rule`` and is not allowed, and every unused allowance."""
    broken = [imp for imp in IMPORTS if not rule(imp)]
    unexplained = [imp.where() for imp in broken if (imp.importer, imp.target) not in allowances]
    used = {(imp.importer, imp.target) for imp in broken}
    stale = [f"{a} -> {b}" for a, b in allowances if (a, b) not in used]
    assert not unexplained, "imports that break the layering:\n" + "\n".join(unexplained)
    assert not stale, "allowances no longer needed (delete them):\n" + "\n".join(stale)


def test_every_module_was_read():
    assert "kvtrim.attention.patterns" in MODULES and "kvtrim.integrations.prefill" in MODULES
    assert any(imp.importer == "kvtrim.storage" and top(imp.target) == "transformers" for imp in IMPORTS)


# -- kernels ----------------------------------------------------------------------------------------
# ninja: the build tool torch.utils.cpp_extension runs to compile the native CPU kernel (a
# declared dependency; native.py only reads where its binary is).
KERNEL_THIRD_PARTY = {"torch", "triton", "ninja"}
KERNEL_KVTRIM = ("kvtrim.attention", "kvtrim.errors", "kvtrim.validate")


def test_kernels_import_only_torch_triton_stdlib_and_leaf_modules():
    def rule(imp: Import) -> bool:
        if layer(imp.importer) != "kernels":
            return True
        t = top(imp.target)
        if t == "kvtrim":
            return inside(imp.target, *KERNEL_KVTRIM)
        return t in KERNEL_THIRD_PARTY or t in sys.stdlib_module_names

    check(rule, {})


def test_kernels_load_without_transformers():
    """What the import statements say, at run time: importing every kernel module loads neither
    transformers nor a kvtrim module outside attention/ (besides the package's own light
    ``__init__``: errors and the registry of names)."""
    needs_triton = ("kvtrim.attention.triton.kernels", "kvtrim.attention.triton.fused")  # import triton at import
    kernels = [m for m in MODULES if layer(m) == "kernels" and m not in needs_triton]
    code = (
        "import importlib, sys\n"
        f"for m in {kernels!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kvtrim', 'transformers')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert not [m for m in loaded if top(m) == "transformers"]
    assert [m for m in loaded if not inside(m, "kvtrim.attention")] == ["kvtrim", "kvtrim.errors", "kvtrim.registry"]


# -- transformers -----------------------------------------------------------------------------------
# Modules below the integrations and the top layer that import transformers, and why.
TRANSFORMERS_ALLOWED = {
    ("kvtrim.cache", "transformers.cache_utils"):
        "a KVTrimCache is a transformers Cache: it subclasses Cache and builds DynamicSlidingWindowLayer",
    ("kvtrim.cache", "transformers.models.auto.modeling_auto"):
        "a KVTrimCache refuses an encoder (a masked LM such as BERT) by transformers' own architecture tables",
    ("kvtrim.storage", "transformers.cache_utils"):
        "the transformers storage: a CompressedLayer is a transformers CacheLayerMixin",
    ("kvtrim.models", "transformers"):
        "loading a model and its tokenizer is this module's job (AutoConfig, AutoModelForCausalLM, AutoTokenizer)",
    ("kvtrim.models", "transformers.models.auto.modeling_auto"):
        "tells a causal LM from a masked LM before loading, by transformers' own architecture tables",
    ("kvtrim.models", "transformers.models.auto.configuration_auto"):
        "refuses a config.json whose model_type transformers does not know, before loading anything",
    ("kvtrim.gguf", "transformers"):
        "converting a GGUF once into a plain model directory goes through transformers' GGUF loader",
    ("kvtrim.vlm", "transformers"):
        "loading vision-language models and their processors, and building the tiny test ones from configs",
    ("kvtrim.vlm", "transformers.models.clip.image_processing_pil_clip"):
        "the PIL image processor of LLaVA-style models (no torchvision needed)",
    ("kvtrim.vlm", "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"):
        "the PIL image processor of Qwen2-VL (no torchvision needed)",
    ("kvtrim.machine", "transformers"):
        "records transformers.__version__ in the machine record of results",
}


def test_only_integrations_and_the_top_layer_import_transformers():
    def rule(imp: Import) -> bool:
        return top(imp.target) != "transformers" or layer(imp.importer) in ("integrations", "top")

    check(rule, TRANSFORMERS_ALLOWED)


# -- policies ---------------------------------------------------------------------------------------
POLICY_KVTRIM = ("kvtrim.policies", "kvtrim.errors", "kvtrim.validate", "kvtrim.scores", "kvtrim.rope", "kvtrim.spans",
                 "kvtrim.decisions")


def test_policies_import_only_base_helpers():
    """A policy sees a layer's view and returns decisions (``kvtrim.decisions``): it imports no
    storage, cache, integration, evaluation, tool or CLI module, with no exception."""

    def rule(imp: Import) -> bool:
        if layer(imp.importer) != "policies":
            return True
        t = top(imp.target)
        if t == "kvtrim":
            return inside(imp.target, *POLICY_KVTRIM)
        return t == "torch" or t in sys.stdlib_module_names

    check(rule, {})


# -- one direction: no module imports from a layer above its own, and no circles --------------------
RANKS = [
    ("leaves", ("kvtrim.errors", "kvtrim.validate")),
    ("kernels", ("kvtrim.attention",)),
    ("base helpers", ("kvtrim.scores", "kvtrim.rope", "kvtrim.spans", "kvtrim.decisions", "kvtrim.cpu_linear", "kvtrim.cpu_layers",
                      "kvtrim.mixed_precision", "kvtrim.files")),
    ("policies", ("kvtrim.policies", "kvtrim.registry")),
    ("core", ("kvtrim.storage", "kvtrim.lowbit_storage", "kvtrim.ragged_storage", "kvtrim.rerotation", "kvtrim.persistence", "kvtrim.cache",
              "kvtrim.decoding")),
    ("integrations", ("kvtrim.integrations",)),
    ("models and the Python API", ()),  # every module not named elsewhere
    ("top", ("kvtrim.eval", "kvtrim.tools", "kvtrim.cli", "kvtrim.__main__")),
]


def rank(module: str) -> int:
    """The index in ``RANKS`` of the layer ``module`` belongs to (docs/architecture.md)."""
    default = next(i for i, (_, prefixes) in enumerate(RANKS) if not prefixes)
    best = (-1, default)
    for i, (_, prefixes) in enumerate(RANKS):
        for p in prefixes:
            if inside(module, p) and len(p) > best[0]:
                best = (len(p), i)
    return best[1]


def kvtrim_module(target: str) -> str | None:
    """The kvtrim module an import names (``kvtrim.a.b.name`` -> ``kvtrim.a.b``), or None."""
    if top(target) != "kvtrim":
        return None
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target if target in MODULES else None


def test_no_module_imports_from_a_higher_layer():
    """Every import between kvtrim modules runs down or sideways. The package's ``__init__`` is the
    public face (it hands on names from every layer, lazily) and is exempt."""

    def rule(imp: Import) -> bool:
        t = kvtrim_module(imp.target)
        return imp.importer == "kvtrim" or t is None or t == "kvtrim" or rank(imp.importer) >= rank(t)

    check(rule, {})


def test_no_import_cycle_between_modules():
    """No two modules import each other, directly or through others (imports inside functions and
    under ``TYPE_CHECKING`` count: a circle is a circle to a reader too)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        t = kvtrim_module(imp.target)
        if t is not None and t != imp.importer and t != "kvtrim" and imp.importer != "kvtrim":
            edges[imp.importer].add(t)
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in MODULES:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    circles.append(sorted(comp))
    assert not circles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in circles)


# -- engines apply decisions, whatever the method ---------------------------------------------------
ENGINE_MODULES = ("kvtrim.storage", "kvtrim.lowbit_storage", "kvtrim.rerotation", "kvtrim.persistence", "kvtrim.cache", "kvtrim.decoding",
                  "kvtrim.integrations.hf", "kvtrim.integrations.batched", "kvtrim.integrations.pruning",
                  "kvtrim.integrations.vllm")


def method_names_and_classes() -> tuple[set[str], set[str]]:
    """The registered methods' names and their policy classes' names."""
    from kvtrim.registry import methods

    return {m.name for m in methods()}, {m.cls for m in methods()}


def test_no_method_name_or_per_method_branch_in_storages_and_engine_integrations():
    """A storage or an engine integration carries out decisions and asks policies for what they need
    (capability flags, ``wants_*``, ``eviction_target``): no string in its code is a method's name
    (what ``if method == "snapkv"`` would compare with), it names no policy class, and it imports no
    single policy's module (``kvtrim.policies.base`` and the registry are general)."""
    names, classes = method_names_and_classes()
    found = []
    for name, path in MODULES.items():
        if not any(inside(name, p) for p in ENGINE_MODULES):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: the string {node.value!r}")
            elif (isinstance(node, ast.Name) and node.id in classes) or (isinstance(node, ast.Attribute) and node.attr in classes):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: the policy class {ast.unparse(node)}")
        found += [imp.where() for imp in IMPORTS if imp.importer == name and inside(imp.target, "kvtrim.policies")
                  and not inside(imp.target, "kvtrim.policies.base")]
    assert not found, "method names in storages or engine integrations:\n" + "\n".join(found)


# -- nothing imports upwards into the top layer ---------------------------------------------------
def test_only_the_top_layer_imports_eval_tools_and_cli():
    def rule(imp: Import) -> bool:
        return top(imp.target) != "kvtrim" or layer(imp.target) != "top" or layer(imp.importer) == "top"

    check(rule, {})


# -- private names ----------------------------------------------------------------------------------
def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_is_imported_from_another_module():
    """A name with a leading underscore belongs to its module: another module that needs it gets a
    public, documented name instead."""

    def rule(imp: Import) -> bool:
        if top(imp.target) != "kvtrim" or imp.target == imp.importer:
            return True
        parts = imp.target.split(".") + ([imp.name] if imp.name else [])
        return not any(is_private(p) for p in parts)

    check(rule, {})


# -- the repository stands on its own -------------------------------------------------------------
ROOT = SRC.parent
# Written in pieces so that this file does not match itself.
OUTSIDE_FILES = ["../" + "shared", "METHODS" + ".md", "STYLE" + ".md", "EVAL" + ".md", "INTEGRATION" + ".md"]
JARGON = {
    r"\bseed 0\d\d\b": "an internal write-up's number; cite the paper by title",
    r"\[open\]": "an outside document's tag; say \"kvtrim's choice\" and what was chosen",
}


def repository_texts() -> list[Path]:
    paths = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    for folder in ("src", "tests", "docs"):
        paths += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    return paths


def test_docs_and_code_cite_nothing_outside_the_repository():
    """Docstrings, comments, docs and tests point at files of this repository and at papers, so a
    person who clones kvtrim can follow every reference."""
    found = []
    for path in repository_texts():
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # images
            continue
        for n, line in enumerate(text.splitlines(), 1):
            hits = [s for s in OUTSIDE_FILES if s in line] + [why for rx, why in JARGON.items() if re.search(rx, line)]
            found += [f"{path.relative_to(ROOT)}:{n}: {h}" for h in hits]
    assert not found, "references to files outside the repository or internal jargon:\n" + "\n".join(found)


def test_docs_links_resolve():
    """Every relative Markdown link in README.md, CONTRIBUTING.md and the hand-written pages of docs/
    names an existing file (docs/eval/ is written by ``kvtrim report``)."""
    missing = []
    for path in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not missing, "links to missing files:\n" + "\n".join(missing)
