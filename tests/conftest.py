"""Shared fixtures: tiny randomly initialised models (built from configs here) and the real model."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks its interpreter when it is first imported, and transformers imports triton when
    # it is installed: set this before transformers so kernels run on CPU (tests/test_sparse_attention.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import LlamaConfig, LlamaForCausalLM

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package); the
    scripts it imports from its folder are loaded with it (``kvtrim.tools.docs_tables.load_script``)."""
    from kvtrim.tools.docs_tables import load_script

    return load_script(BENCHMARKS / f"{name}.py")


def tiny_llama(n_kv: int = 2, groups: int = 3, layers: int = 3, head_dim: int = 16, seed: int = 0, **extra):
    """A tiny Llama with GQA ``groups``:1, float32, SDPA attention, eval mode."""
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=n_kv * groups,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg = LlamaConfig(**(kw | extra))
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


def eager_attentions(model, ids):
    """Full softmax attention probabilities per layer from transformers' eager path (an independent
    oracle for the methods' prefill scores), float64 ``[B, Hq, T, T]``."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    return [a.double() for a in out.attentions]


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def prompt():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 128, (1, 97), generator=g)


@pytest.fixture(scope="session")
def embedded_tokenizer():
    """The embedded model's tokenizer (skips the test when the embedded model is not installed)."""
    from transformers import AutoTokenizer

    from kvtrim.errors import KVTrimError
    from kvtrim.models import resolve_model

    try:
        path = resolve_model(None)[0]
    except KVTrimError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, embedded_tokenizer):
    """A tiny random Llama saved as a model directory with the embedded model's tokenizer (4k positions)."""
    d = tmp_path_factory.mktemp("tiny-instruct")
    tiny_llama(vocab_size=len(embedded_tokenizer), max_position_embeddings=4096).save_pretrained(d)
    embedded_tokenizer.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def real():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache)."""
    from kvtrim.models import load_model

    return load_model()


def cli_status(argv: list[str]) -> int:
    """``kvtrim.cli.main(argv)``'s exit status, whether the command returned it or the command line was
    refused as it was parsed (argparse exits; kvtrim's parser prints its one ``kvtrim: error:`` line first)."""
    from kvtrim.cli import main

    try:
        return main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


def pytest_collection_modifyitems(config, items):
    """A test that takes the real embedded model (the ``real`` fixture) is in the ``model`` tier whether
    or not it says so, so the fast tier (``-m "not model and not slow and not qwen"``, README) leaves
    out every test that loads it through the fixture."""
    for item in items:
        if "real" in getattr(item, "fixturenames", ()) and item.get_closest_marker("model") is None:
            item.add_marker(pytest.mark.model)


def spy_fed(session) -> list[int]:
    """Record every token id ``session`` feeds its model from now on (wraps its ``_forward``)."""
    fed: list[int] = []
    forward = session._forward

    def spy(ids, all_logits=False):
        fed.extend(ids)
        return forward(ids, all_logits)

    session._forward = spy
    return fed


def skip_reconstruction_method(name: str) -> None:
    """Skip a test that drives a method through a loop of its own (``model(...)``, ``model.generate``)
    when the method scores the prompt by a reconstruction forward only kvtrim's loops run (``kvzip``:
    ``Policy.needs_reconstruction``); tests/test_kvzip.py runs those checks, and the refusals, for it."""
    from kvtrim.registry import get_policy_class, split_method

    if get_policy_class(split_method(name)[0]).needs_reconstruction:
        pytest.skip("scores the prompt by a reconstruction forward that kvtrim's own loops run: tested in test_kvzip.py")
