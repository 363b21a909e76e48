"""No silent no-op: a method given no budget uses its documented default, and a method that acts only on
image/document spans refuses a prompt without them, in every command and in the Python API."""

from __future__ import annotations

import io
import json

import pytest
import torch

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.cli import main
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import DEFAULT_MAX_TOKENS
from kvtrim.registry import check_text_prompt, create_policy, get_policy_class, method_names, spans_error
from kvtrim.session import Session

#: methods that compress with a budget of their own (the default applies to them)
DEFAULTED = [m for m in method_names() if get_policy_class(m).takes_budget and get_policy_class(m).default_max_tokens]
SPAN_METHODS = [m for m in method_names() if get_policy_class(m).needs_spans]


def test_the_default_budget_is_declared_where_it_is_documented():
    assert DEFAULT_MAX_TOKENS == 1024
    assert set(DEFAULTED) == {"streaming_llm", "h2o", "snapkv", "inf_mllm", "elastic", "expected_attention", "tova",
                              "kvzip"}
    assert set(SPAN_METHODS) == {"fastv", "hae"}
    assert get_policy_class("hae").default_max_tokens is None  # DDES is optional: DAP alone
    assert not get_policy_class("full").takes_budget and not get_policy_class("fastv").takes_budget


@pytest.mark.parametrize("name", DEFAULTED)
def test_no_budget_means_the_default_in_every_entry_point(model, name):
    """create_policy, the class itself, KVTrimCache(model, name), kvtrim.compress and Session all get the
    default, and describe() (generate --json's "policy") reports it."""
    cls = get_policy_class(name)
    reconstructs = cls.needs_reconstruction  # kvzip: sessions and model.generate refuse it (tests/test_kvzip.py)
    sessions = [] if reconstructs else [Session(model, None, name).policy]
    for p in (create_policy(name), cls(), KVTrimCache(model, name).policy, *sessions):
        assert (p.keep, p.max_tokens) == (None, DEFAULT_MAX_TOKENS) and p.compresses
        assert p.describe()["max_tokens"] == DEFAULT_MAX_TOKENS
    if not reconstructs:
        with kvtrim.compress(model, name) as cache:
            assert cache.policy.max_tokens == DEFAULT_MAX_TOKENS
    # a budget given is the budget used; keep=1.0 asks for no eviction explicitly
    assert create_policy(name, keep=0.5).max_tokens is None and create_policy(name, max_tokens=64).max_tokens == 64
    assert not create_policy(name, keep=1.0).compresses


@pytest.mark.parametrize("name", DEFAULTED)
def test_the_default_budget_compresses(name):
    """A prompt longer than the default budget is cut to it (it used to be kept whole)."""
    from conftest import tiny_llama

    model = tiny_llama(max_position_embeddings=2048)
    ids = torch.randint(3, 128, (1, DEFAULT_MAX_TOKENS + 100), generator=torch.Generator().manual_seed(0))
    if get_policy_class(name).needs_reconstruction:  # kvzip: scored by its reconstruction, then replayed
        from kvtrim.reconstruction import prepare, recorded_kv
        from kvtrim.recording import record_prefill, replay

        rec = record_prefill(model, ids[0].tolist())
        policy = prepare(create_policy(name), model, recorded_kv(rec), ids[0].tolist(), [5, 6, 7])
        cache = replay(model, policy, rec)
    else:
        cache = KVTrimCache(model, name)
        with kvtrim.attach(model), torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert cache.seen_tokens() == ids.shape[1]
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    if not cache.policy.uniform_heads:  # kvzip's global scope: the heads' counts sum to the uniform total
        assert sum(sum(layer.head_lengths) for layer in cache.compressed_layers) == DEFAULT_MAX_TOKENS * layers * heads
        return
    assert cache.stored_tokens() == [DEFAULT_MAX_TOKENS] * layers


def test_span_methods_are_refused_on_a_text_prompt_in_python(model, prompt):
    for name in SPAN_METHODS:
        pol = create_policy(name)
        assert spans_error(pol) and f"method {name!r} prunes" in spans_error(pol) and "would run as 'full'" in spans_error(pol)
        with pytest.raises(KVTrimError, match="prune"):
            check_text_prompt(pol)
        with kvtrim.attach(model), pytest.raises(KVTrimError, match=rf"method '{name}' prunes image/video tokens.*--image"):
            model(input_ids=prompt, past_key_values=KVTrimCache(model, name), use_cache=True)
        with pytest.raises(KVTrimError, match="would run as 'full'"), kvtrim.compress(model, name) as cache:
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        s = Session(model, None, name)
        with pytest.raises(KVTrimError, match="would run as 'full'"):
            s.send_ids(prompt[0].tolist(), max_new_tokens=2)
    assert "a budget (--keep/--max-tokens" in spans_error(create_policy("hae"))  # its DDES acts on text
    assert "budget" not in spans_error(create_policy("fastv"))


def test_span_methods_run_with_their_spans_or_hae_with_a_budget(model, prompt):
    n = prompt.shape[1]
    # fastv on a text model with a tagged document prunes it (half of it, after layer k=2)
    cache = KVTrimCache(model, "fastv", targets=("document",), spans=[(10, 70, "document")])
    with kvtrim.attach(model), torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    assert cache.stored_tokens() == [n, n, n - 30]
    # the spans must hold the policy's targets: a document span does not help the default image/video targets
    assert spans_error(create_policy("fastv"), cache.spans) and not spans_error(create_policy("fastv", targets=("document",)), cache.spans)
    # hae with a budget: its decode eviction (DDES) acts on text, so a text prompt is not a no-op
    for kw in ({"max_tokens": 40}, {"keep": 0.5}, {"keep": 1.0}):
        pol = create_policy("hae", **kw)
        assert spans_error(pol) is None
    cache = KVTrimCache(model, "hae", max_tokens=40)
    with kvtrim.attach(model), torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    assert max(cache.stored_tokens()) == 40


def test_fastv_takes_keep_as_its_ratio():
    p = create_policy("fastv", keep=0.3)
    assert (p.ratio, p.keep) == (0.3, None) and p.describe()["ratio"] == 0.3
    assert create_policy("fastv", **p.params()) == p == create_policy("fastv", ratio=0.3)
    assert create_policy("fastv").ratio == 0.5
    assert create_policy("fastv", keep=0.3, ratio=0.3).ratio == 0.3
    with pytest.raises(KVTrimError, match=r"keep=0\.3 and ratio=0\.4 disagree"):
        create_policy("fastv", keep=0.3, ratio=0.4)
    with pytest.raises(KVTrimError, match=r"fastv takes no cache budget \(max_tokens\).*--keep"):
        create_policy("fastv", max_tokens=100)
    with pytest.raises(KVTrimError, match=r"fastv: keep \(the share of image tokens kept\) must be a fraction"):
        create_policy("fastv", keep=1.5)


# --- the commands: refused before the model loads (the --model given does not exist) ----------------
MISSING = "/nonexistent/kvtrim-model"


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--method", "fastv", "--question", "q"], "method 'fastv' prunes image/video tokens"),
    (["generate", "--method", "fastv", "--keep", "0.3", "--question", "q"], "method 'fastv' prunes"),
    (["generate", "--method", "hae", "--question", "q"], "method 'hae' prunes"),
    (["generate", "--method", "fastv", "--max-tokens", "64", "--question", "q"], "set the share of image tokens it keeps with --keep"),
    (["chat", "--method", "fastv"], "method 'fastv' prunes"),
    (["chat", "--method", "hae"], "or a budget (--keep/--max-tokens"),
    (["stream", "--method", "fastv", "--file", "{text}"], "method 'fastv' prunes"),
    (["demo", "--methods", "snapkv,fastv"], "method 'fastv' prunes"),
    (["bench", "--methods", "full,fastv", "--no-rss"], "method 'fastv' prunes"),
    (["eval", "passkey", "--methods", "fastv", "--out", "{out}"], "compresses visual tokens only"),
    (["generate", "--plain-prompt", "--prompt", "raw text"], "--plain-prompt formats a --question"),
    (["chat", "--load", "{out}", "--plain-prompt"], "--plain-prompt cannot change them"),
])
def test_commands_refuse_before_the_model_loads(argv, fragment, tmp_path, monkeypatch, capsys):
    (tmp_path / "text.txt").write_text("Some text. " * 20)
    (tmp_path / "out").mkdir()
    argv = [a.format(text=tmp_path / "text.txt", out=tmp_path / "out") for a in argv]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main([argv[0], "--model", MISSING, *argv[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtrim: error:") and fragment in err[0], err


def test_hae_with_a_budget_passes_the_span_check(tmp_path, capsys):
    """The spans check lets hae's budgeted eviction through: the next error is the missing model."""
    assert main(["chat", "--model", MISSING, "--method", "hae", "--max-tokens", "64"]) == 2
    assert "does not exist" in capsys.readouterr().err


# --- on a saved tiny model (the embedded tokenizer) ------------------------------------------------------
def test_generate_json_reports_the_default_budget(tiny_dir, tmp_path, capsys):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("The house by the river is painted in a bright colour. " * 120)  # > 1024 tokens
    assert main(["generate", "--model", tiny_dir, "--method", "snapkv", "--context-file", str(ctx),
                 "--question", "What colour?", "--max-new-tokens", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["policy"]["max_tokens"] == DEFAULT_MAX_TOKENS and d["policy"]["keep"] is None
    assert d["prompt_tokens"] > DEFAULT_MAX_TOKENS + 100 and d["stored_tokens"] <= DEFAULT_MAX_TOKENS + 2
    assert d["kv_bytes_stored"] < d["kv_bytes_full"]


def test_demo_default_methods_act_on_text(tiny_dir, capsys):
    assert main(["demo", "--model", tiny_dir, "--length", "300"]) == 0
    out, err = capsys.readouterr()
    rows = [ln.split()[0] for ln in out.splitlines() if ln and ln.split()[0] in method_names()]
    assert rows == [m for m in method_names() if m not in SPAN_METHODS]
    assert "fastv, hae act on image tokens" in err
