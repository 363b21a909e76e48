"""Vision-language models end to end: tiny random LLaVA and Qwen2-VL (real classes and processors,
photos from scikit-image) with every registered policy."""

from __future__ import annotations

import pytest
import torch
from conftest import skip_reconstruction_method
from transformers import DynamicCache

pytest.importorskip("skimage")

import kvtrim
from kvtrim import vlm
from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.generation import generate_ids
from kvtrim.registry import create_policy, get_policy_class, method_names

BUILDERS = {"llava": vlm.tiny_llava, "qwen2_vl": vlm.tiny_qwen2_vl}


@pytest.fixture(scope="module")
def images():
    return vlm.sample_images()


@pytest.fixture(scope="module", params=list(BUILDERS))
def case(request, images):
    v = BUILDERS[request.param]()
    ids, extra = vlm.prepare(v.processor, "What is in the picture?", [images["chelsea"]])
    return request.param, v, ids, extra


def run_loop(model, ids, extra, cache, steps=4):
    logits = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, **extra)
        logits.append(out.logits[:, -1])
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return logits


# Parameters of the span methods that keep everything / compress (their own knobs beside keep).
KEEP_ALL = {"fastv": {"ratio": 1.0}, "hae": {"keep": 1.0, "r": 0.0, "alpha": 0.0}}
COMPRESS = {"fastv": {}, "hae": {"keep": 0.6, "r": 0.1, "alpha": 1.0}}


def keep_all_kwargs(name):
    if name in KEEP_ALL:
        return KEEP_ALL[name]
    return {"keep": 1.0} if get_policy_class(name).takes_budget or name == "full" else {}


def compress_kwargs(name):
    """A budget that compresses the tiny models' prompts (52-58 tokens): a cap, because under a
    ``keep`` budget a prompt this short is kept whole (``Policy.kept_whole``)."""
    if name in COMPRESS:
        return COMPRESS[name]
    return {"max_tokens": 40} if get_policy_class(name).takes_budget else {}


def test_spans_match_the_processors_image_tokens(case):
    kind, v, ids, extra = case
    cache = KVTrimCache(v.model, "full")
    with kvtrim.attach(v.model):
        run_loop(v.model, ids, extra, cache, steps=0)
    image_pos = [i for i, t in enumerate(ids) if t == v.processor.image_token_id]
    expect = 16 if kind == "llava" else int(extra["image_grid_thw"].prod()) // 4
    assert len(image_pos) == expect
    found = cache.spans.mask(torch.arange(len(ids)), ["image"]).nonzero().flatten().tolist()
    assert found == image_pos
    assert [s.modality for s in cache.spans] == ["text", "image", "text"]


@pytest.mark.parametrize("name", method_names())
def test_keep_everything_equals_uncompressed(case, name):
    kind, v, ids, extra = case
    if get_policy_class(name).default_position != "true" and kind == "qwen2_vl":
        pytest.skip("reassigned positions need a plain RoPE; Qwen2-VL's mrope is refused (tested below)")
    ref = run_loop(v.model, ids, extra, DynamicCache(config=v.model.config))
    with kvtrim.attach(v.model):
        got = run_loop(v.model, ids, extra, KVTrimCache(v.model, name, **keep_all_kwargs(name)))
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", method_names())
def test_every_policy_compresses_a_vlm_and_generate_agrees_with_kvtrims_loop(case, name):
    kind, v, ids, extra = case
    skip_reconstruction_method(name)  # a text prompt's reconstruction: image inputs are refused (test_kvzip.py)
    kw = compress_kwargs(name)
    if get_policy_class(name).default_position != "true":
        if kind == "qwen2_vl":
            pytest.skip("reassigned positions need a plain RoPE; Qwen2-VL's mrope is refused (tested below)")
        kw = {"max_tokens": 40}
    inputs = dict(input_ids=torch.tensor([ids]), **extra)
    with kvtrim.attach(v.model):
        cache = KVTrimCache(v.model, name, **kw)
        out = v.model.generate(**inputs, past_key_values=cache, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    res = generate_ids(v.model, v.tokenizer, ids, create_policy(name, **kw), max_new_tokens=6, stop_at_eos=False, model_inputs=extra)
    assert out[0, len(ids):].tolist() == res.token_ids
    if name != "full":
        assert min(cache.stored_tokens()) < cache.seen_tokens()
        assert cache.kv_bytes_stored() < cache.kv_bytes_full()


def test_mrope_model_refuses_reassigned_positions():
    v = vlm.tiny_qwen2_vl()
    with pytest.raises(KVTrimError, match="cannot be re-rotated"):
        KVTrimCache(v.model, "streaming_llm", max_tokens=40)


def test_video_token_runs_become_video_spans():
    from kvtrim.spans import find_spans

    v = vlm.tiny_qwen2_vl()
    vid, img = v.model.config.video_token_id, v.model.config.image_token_id
    ids = [1, 2, vid, vid, vid, vid, 3, img, img, 4]
    s = find_spans(v.model, ids)
    assert [(x.start, x.end, x.modality) for x in s] == [(0, 2, "text"), (2, 6, "video"), (6, 7, "text"), (7, 9, "image"), (9, 10, "text")]


def test_cli_image_on_a_text_only_model_is_refused(tmp_path, capsys):
    from PIL import Image

    from kvtrim.cli import main

    img = tmp_path / "cat.png"
    Image.new("RGB", (32, 32)).save(img)
    assert main(["generate", "--image", str(img), "--question", "what is this?"]) == 2
    err = capsys.readouterr().err
    assert "text-only model" in err and "--image" in err


def test_cli_image_file_missing(capsys):
    from kvtrim.cli import main

    assert main(["generate", "--image", "/nonexistent.png", "--question", "what?"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_generate_with_image_on_a_saved_vlm(tmp_path, images, capsys):
    import json

    from kvtrim.cli import main

    v = vlm.tiny_llava()
    v.model.save_pretrained(tmp_path / "m")
    v.processor.save_pretrained(tmp_path / "m")
    img = tmp_path / "chelsea.png"
    images["chelsea"].save(img)
    rc = main(["generate", "--model", str(tmp_path / "m"), "--image", str(img), "--question", "what?", "--method", "fastv",
               "--max-new-tokens", "3", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["method"] == "fastv" and d["kv_bytes_stored"] < d["kv_bytes_full"] and d["spans"][1]["modality"] == "image"
