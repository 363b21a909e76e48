"""A long chat session stays flat: each turn renders the chat template over the last few messages,
not the whole history, and feeds exactly what rendering the whole history would (checked on the
first turns; a template that numbers or otherwise depends on earlier messages falls back to whole
renders); benchmarks/bench_long_session.py runs and writes its result through the harness."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import spy_fed

from kvtrim.session import HISTORY_WINDOW, Session

NUMBERED = ("{% for m in messages %}<|im_start|>{{ m['role'] }} #{{ loop.index }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant #{{ messages|length + 1 }}\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_chat(embedded_tokenizer):
    from conftest import tiny_llama

    return tiny_llama(vocab_size=len(embedded_tokenizer), max_position_embeddings=4096), embedded_tokenizer


def _conversation(model, tok, turns: int):
    """A session over ``turns`` turns (generated and scripted replies mixed) and every id it fed."""
    s = Session(model, tok, "inf_mllm", max_tokens=128, position="reassigned")
    fed = spy_fed(s)
    for i in range(turns):
        if i % 3 == 1:
            s.add_turn(f"Note {i}.", f"Noted {i}.")
        else:
            s.send(f"What is {i} plus {i}?", max_new_tokens=3 + i % 2, stop_ids=())
    s.send_ids(s._turn_ids("Bye.")[0], max_new_tokens=1, stop_ids=())
    return s, fed


@pytest.mark.parametrize("template", [None, NUMBERED], ids=["smollm2", "numbered"])
def test_many_turns_feed_exactly_the_templated_conversation(tiny_chat, template):
    model, tok = tiny_chat
    if template is not None:
        tok = type(tok).from_pretrained(tok.name_or_path)
        tok.chat_template = template
    s, fed = _conversation(model, tok, 9)
    assert len(s.messages) > 2 * HISTORY_WINDOW
    text = tok.apply_chat_template(s.messages + [{"role": "user", "content": "Bye."}], add_generation_prompt=True,
                                   tokenize=False)
    assert tok.decode(fed) == text and s.seen == len(fed)
    assert s._window == (template is None)  # a template that numbers the messages renders them whole


def test_a_turn_renders_a_bounded_window(tiny_chat, monkeypatch):
    model, tok = tiny_chat
    s, _ = _conversation(model, tok, 7)
    sizes = []
    real = s._render
    monkeypatch.setattr(s, "_render", lambda messages, gen: sizes.append(len(messages)) or real(messages, gen))
    s.send("One more?", max_new_tokens=2, stop_ids=())
    assert sizes and max(sizes) <= HISTORY_WINDOW + 2  # the window, the new message and the reply: not the history


def test_the_benchmark_writes_its_result_and_table(tmp_path, capsys):
    from conftest import load_benchmark

    bench = load_benchmark("bench_long_session")
    out = tmp_path / "ls.json"
    torch.manual_seed(0)
    assert bench.main(["--tiny", "--turns", "32", "--window", "5", "--new", "2", "--threads", "1",
                       "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["turns_done"] == 32 and len(r["turn_ms"]) == 32 and len(r["windows"]) == 7
    assert r["summary"]["late_turns"] == [27, 31] and r["summary"]["late_over_early"] > 0
    assert all(st[0] <= 256 + 64 for st in r["stored_seen"]) and r["stored_seen"][-1][1] > 256  # bounded: the budget plus a turn
    assert "late / early" in capsys.readouterr().out
    assert bench.main(["--table", str(out)]) == 0
