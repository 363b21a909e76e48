"""Do no harm by default: on short prompts every compressing method answers as the full cache does.

Every method always keeps the attention sinks and its observation window, and a prompt too short
for compression to save memory is kept whole (``Policy.kept_whole``). Evidence on the real
embedded model: 30 short factual questions, every text method at every budget, greedy, compared
token by token with ``full``.
"""

from __future__ import annotations

import pytest
import torch

import kvtrim
from kvtrim import decoding
from kvtrim.eval.replay import record_prefill, replay
from kvtrim.integrations.batched import drive
from kvtrim.models import build_prompt_ids
from kvtrim.policies.base import SINKS, Policy
from kvtrim.registry import create_policy, get_policy_class, method_names

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the capital of Italy?",
    "What is the capital of Germany?",
    "What is the capital of Spain?",
    "What is the capital of Canada?",
    "What is the capital of Egypt?",
    "What is the capital of Russia?",
    "What is 2 + 2?",
    "What is 3 times 3?",
    "What is 10 minus 4?",
    "What is 100 divided by 10?",
    "What is 7 plus 5?",
    "What colour is the sky on a clear day?",
    "What colour is grass?",
    "What colour is snow?",
    "What colour do you get by mixing blue and yellow?",
    "How many days are in a week?",
    "How many legs does a spider have?",
    "How many continents are there?",
    "What is the largest planet in the solar system?",
    "Which planet is closest to the Sun?",
    "What is the boiling point of water in Celsius?",
    "What gas do plants absorb from the air?",
    "Who wrote Romeo and Juliet?",
    "What is the chemical symbol for gold?",
    "What is the freezing point of water in Fahrenheit?",
    "What language is spoken in Brazil?",
    "What is the longest river in Africa?",
    "How many hours are in a day?",
]
BUDGETS = (0.1, 0.25, 0.5, 0.9)
NEW_TOKENS = 12


def text_methods() -> list[str]:
    """Every registered compressing method that acts on plain text (capability flags, not names) and
    runs in any loop (``kvzip``'s reconstruction runs in kvtrim's own: the same checks in tests/test_kvzip.py)."""
    out = []
    for name in method_names():
        cls = get_policy_class(name)
        if cls.takes_budget and not cls.needs_spans and not cls.rewrites_forward and not cls.needs_reconstruction:
            out.append(name)
    return out


def answer_table(lm, questions=QUESTIONS, budgets=BUDGETS, methods=None) -> dict:
    """``{(method, budget): number of questions whose greedy ids equal full's}`` plus the ids.

    Each question's prompt runs through the model once (``kvtrim.eval.replay``: the prefill forward
    does not depend on the method; every cache is built from the recorded q/k/v), then its runs
    (full and every method x budget) decode together as the rows of one batch
    (``kvtrim.integrations.batched.drive``), so they share the same rounding.
    """
    methods = methods or text_methods()
    equal = {(m, b): 0 for m in methods for b in budgets}
    outputs = []

    stop = (lm.tokenizer.eos_token_id,)

    def program(cache, logits):
        return (yield from decoding.decode(cache, logits, NEW_TOKENS, stop_ids=stop))

    with kvtrim.attach(lm.model):
        for q in questions:
            ids = build_prompt_ids(lm.tokenizer, q)
            rec = record_prefill(lm.model, ids)
            caches = {("full", None): replay(lm.model, create_policy("full"), rec)}
            for m in methods:
                for b in budgets:
                    caches[(m, b)] = replay(lm.model, create_policy(m, keep=b), rec)
            got = drive(lm.model, {k: program(c, rec.logits) for k, c in caches.items()})
            ref = got[("full", None)][0]
            outputs.append((q, len(ids), {k: v[0] for k, v in got.items()}))
            for m in methods:
                for b in budgets:
                    equal[(m, b)] += got[(m, b)][0] == ref
    return {"equal": equal, "outputs": outputs}


def format_table(equal: dict, n: int) -> str:
    budgets = sorted({b for _, b in equal})
    methods = list(dict.fromkeys(m for m, _ in equal))
    rows = ["method         " + " ".join(f"{b:>6}" for b in budgets)]
    for m in methods:
        rows.append(f"{m:<15}" + " ".join(f"{equal[(m, b)]:>3}/{n:<2}" for b in budgets))
    return "\n".join(rows)


def test_text_methods_are_found_by_capability():
    names = text_methods()
    assert {"snapkv", "h2o", "inf_mllm", "elastic", "streaming_llm"} <= set(names)
    assert "full" not in names and "fastv" not in names


@pytest.mark.model
def test_short_factual_prompts_answer_as_full(real):
    table = answer_table(real)
    n = len(QUESTIONS)
    print("\n" + format_table(table["equal"], n))
    wrong = {k: v for k, v in table["equal"].items() if v != n}
    assert not wrong, f"answers differ from full (equal out of {n}):\n{format_table(table['equal'], n)}"


def test_every_method_keeps_the_sinks_and_its_window():
    """``protected`` of every budgeted method includes the first SINKS tokens and its window."""
    from conftest import tiny_llama

    from kvtrim.cache import KVTrimCache

    model = tiny_llama()
    ids = torch.randint(3, 100, (1, 300), generator=torch.Generator().manual_seed(0))
    for name in text_methods():
        policy: Policy = create_policy(name, keep=0.1)
        cache = KVTrimCache(model, policy)
        with kvtrim.attach(model):
            model(ids, past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            pos = layer.positions[0]
            for h in range(pos.shape[0]):
                kept = set(pos[h].tolist())
                assert set(range(SINKS)) <= kept, (name, layer.layer_idx, h)
                assert 299 in kept, (name, layer.layer_idx, h)


@pytest.mark.model
def test_the_issues_cli_examples_answer_as_full_and_say_why(real, capsys):
    """``kvtrim generate`` on a short question: SnapKV at keep 0.9 and Inf-MLLM at keep 0.5 (which
    answered "...is France." and "...is 2 Hugging Face" before the rule) give full's answer, and
    ``--json`` says the prompt was kept whole."""
    import json

    from kvtrim.cli import main

    def run(*method: str) -> dict:
        assert main(["generate", *method, "--question", "What is the capital of France?",
                     "--max-new-tokens", str(NEW_TOKENS), "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    full = run("--method", "full")
    assert "Paris" in full["answer"] and full["compressed"] is False
    for method in (["--method", "snapkv", "--keep", "0.9"], ["--method", "inf_mllm", "--keep", "0.5"]):
        got = run(*method)
        assert got["answer"] == full["answer"], method
        assert got["compressed"] is False and "kept whole" in got["reason"], got["reason"]


def test_a_prompt_above_the_threshold_is_compressed_and_reported(model):
    """Above ``min_length`` the budget applies as before (the rule changes nothing for long prompts)."""
    from kvtrim.generation import generate_ids

    policy = create_policy("snapkv", keep=0.5)
    long_ids = torch.randint(3, 100, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    res = generate_ids(model, None, long_ids, policy, max_new_tokens=2)
    assert res.compressed and res.reason is None
    assert res.stored_tokens == policy.budget(200) + 1  # the prompt's budget + one appended decoded token
    short = generate_ids(model, None, long_ids[: policy.min_length], policy, max_new_tokens=2)
    assert not short.compressed and "kept whole" in short.reason
    assert short.stored_tokens == policy.min_length + 1
