"""Vision-language models with kvtrim: loading, inputs, small random configs of the real classes.

kvtrim's cache and attention function work unchanged inside transformers' VLM classes: the
language model's attention layers call the registered attention function like a text model's
do, and the vision tower's attention passes straight through (it has no kvtrim cache layer).
Qwen2-VL's 3-D multimodal RoPE (``mrope``) positions are computed by the model from the cache's
*seen* count, which kvtrim keeps true, so every policy with the ``true`` position policy works;
``reassigned``/``compressed`` positions need a plain rotary embedding and are refused for mrope.

Modality spans (``kvtrim.spans``) are found from the prompt's image/video token ids when the
prefill runs inside ``kvtrim.attach``; policies read them from ``cache.spans``.

No VLM weights can be downloaded on kvtrim's machines, so this module also builds *small
randomly initialised* models of the real classes (``LlavaForConditionalGeneration`` with a tiny
CLIP vision tower; ``Qwen2VLForConditionalGeneration``) with real processors made from the
embedded SmolLM2 tokenizer plus the models' placeholder tokens and transformers' PIL image
processors. They exercise the plumbing (spans, pruning, memory, equivalence), not quality.
``llava_from_text_model`` puts a real text model (the embedded SmolLM2) behind a random tiny
vision tower, for timings at realistic visual token counts (576 per 336x336 image).
"""

from __future__ import annotations

import copy
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtrim.errors import KVTrimError
from kvtrim.files import read_bytes
from kvtrim.spans import is_multimodal

LLAVA_IMAGE_TOKEN = "<image>"
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@dataclass
class LoadedVLM:
    model: torch.nn.Module
    processor: Any  # a transformers processor (its tokenizer plus the image processor)
    source: str

    @property
    def tokenizer(self):
        return self.processor.tokenizer


def base_tokenizer():
    """The embedded SmolLM2 tokenizer (a fresh copy each call, so added tokens do not leak)."""
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model

    path, _ = resolve_model(None)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def _add_tokens(tok, tokens) -> None:
    missing = [t for t in tokens if t not in tok.get_vocab()]
    if missing:
        tok.add_special_tokens({"additional_special_tokens": list(missing)}, replace_extra_special_tokens=False)


# --- processors ---------------------------------------------------------------------------------
def llava_processor(tokenizer=None, image_size: int = 56, patch_size: int = 14):
    """A real ``LlavaProcessor``: SmolLM2 tokenizer + ``<image>`` + CLIP's PIL image processor.

    One image becomes ``(image_size // patch_size) ** 2`` image tokens (CLS dropped: the
    "default" feature strategy); 336/14 gives LLaVA-1.5's 576.
    """
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = tokenizer if tokenizer is not None else base_tokenizer()
    _add_tokens(tok, [LLAVA_IMAGE_TOKEN])
    ip = CLIPImageProcessorPil(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    return LlavaProcessor(
        image_processor=ip, tokenizer=tok, patch_size=patch_size, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, image_token=LLAVA_IMAGE_TOKEN,
    )


def _qwen_processor_class():
    from transformers import Qwen2VLProcessor

    class ImageQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2-VL's processor for images only: its video processor needs torchvision, which
        does not match the CPU torch build here, so ``video_processor=None`` is accepted."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageQwen2VLProcessor


def qwen2_vl_processor(tokenizer=None, min_pixels: int = 56 * 56, max_pixels: int = 112 * 112):
    """A real ``Qwen2VLProcessor`` (images; see ``_qwen_processor_class``): SmolLM2 tokenizer +
    Qwen's vision tokens + ``Qwen2VLImageProcessorPil``. An image of h x w pixels (after resizing
    into [min_pixels, max_pixels]) becomes ``(h/28) * (w/28)`` image tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = tokenizer if tokenizer is not None else base_tokenizer()
    _add_tokens(tok, QWEN_TOKENS)
    ip = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    return _qwen_processor_class()(image_processor=ip, tokenizer=tok, video_processor=None)


# --- tiny random models -------------------------------------------------------------------------
def _text_kwargs(vocab: int, layers: int, seed: int) -> dict:
    return dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
    )


def tiny_llava(layers: int = 3, image_size: int = 56, seed: int = 0) -> LoadedVLM:
    """``LlavaForConditionalGeneration``: tiny CLIP vision tower + tiny GQA Llama, random, fp32, SDPA."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    proc = llava_processor(image_size=image_size)
    tok = proc.tokenizer
    text = LlamaConfig(**_text_kwargs(len(tok), layers, seed), rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=image_size,
        patch_size=14, projection_dim=32,
    )
    cfg = LlavaConfig(  # type: ignore[call-arg]  # pad_token_id: transformers' configs take extra keys at run time
        vision_config=vision, text_config=text, image_token_index=proc.image_token_id, vision_feature_layer=-1,
        vision_feature_select_strategy="default", pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    model.set_attn_implementation("sdpa")
    return LoadedVLM(model, proc, "tiny-llava")


def tiny_qwen2_vl(layers: int = 3, seed: int = 0, min_pixels: int = 56 * 56, max_pixels: int = 112 * 112) -> LoadedVLM:
    """``Qwen2VLForConditionalGeneration``: tiny Qwen2-VL vision tower + tiny GQA text model with
    3-D mrope (sections 2/3/3 of the 8 rotary frequencies), random, fp32, SDPA."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    proc = qwen2_vl_processor(min_pixels=min_pixels, max_pixels=max_pixels)
    tok = proc.tokenizer
    text = _text_kwargs(len(tok), layers, seed)
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    cfg = Qwen2VLConfig(  # type: ignore[call-arg]  # token ids: transformers' configs take extra keys at run time
        text_config=text,
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=proc.image_token_id, video_token_id=proc.video_token_id,
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    model.set_attn_implementation("sdpa")
    return LoadedVLM(model, proc, "tiny-qwen2-vl")


def llava_from_text_model(lm, image_size: int = 336, seed: int = 0) -> LoadedVLM:
    """A LLaVA whose language model is ``lm`` (a loaded ``LlamaForCausalLM``, e.g. the embedded
    SmolLM2) behind a random tiny CLIP tower and projector: realistic text-model compute at
    LLaVA-1.5's 576 image tokens per 336x336 image (for timings; the image features are noise)."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    proc = llava_processor(tokenizer=copy.deepcopy(lm.tokenizer), image_size=image_size)
    n_vocab = len(proc.tokenizer)
    text_cfg = copy.deepcopy(lm.model.config)
    text_cfg.vocab_size = n_vocab
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=image_size,
        patch_size=14, projection_dim=32,
    )
    cfg = LlavaConfig(vision_config=vision, text_config=text_cfg, image_token_index=proc.image_token_id,
                      vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).to(next(lm.model.parameters()).dtype).eval()
    state = lm.model.model.state_dict()
    emb = state["embed_tokens.weight"]
    new_emb = model.model.language_model.embed_tokens.weight.detach().clone()
    new_emb[: emb.shape[0]] = emb
    state["embed_tokens.weight"] = new_emb
    model.model.language_model.load_state_dict(state)
    if not text_cfg.tie_word_embeddings:
        w = model.lm_head.weight.detach().clone()
        w[: emb.shape[0]] = lm.model.lm_head.weight
        model.lm_head.weight.data.copy_(w)
    model.tie_weights()
    model.set_attn_implementation("sdpa")
    return LoadedVLM(model, proc, f"llava({lm.source})")


# --- inputs -------------------------------------------------------------------------------------
def sample_images() -> dict:
    """Public-domain photos that ship with scikit-image (``skimage.data``), as PIL images."""
    try:
        import skimage.data as sd
    except ImportError:
        raise KVTrimError("the sample photos need scikit-image: pip install scikit-image (kvtrim's `test` extra)") from None
    from PIL import Image

    return {name: Image.fromarray(getattr(sd, name)()) for name in ("astronaut", "chelsea", "coffee")}


def load_image(path: str | os.PathLike):
    """Open an image file as an RGB PIL image; a clear ``KVTrimError`` when it is missing or not an image."""
    from PIL import Image, UnidentifiedImageError

    data = read_bytes(path, "image file", kind="image")  # a regular file within the image size limit
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise KVTrimError(f"image file {str(path)!r} is not an image PIL can read: {e}") from None


def image_placeholder(processor) -> str:
    """The text a processor expands into one image's tokens."""
    tok = processor.image_token
    if tok == "<|image_pad|>":
        return "<|vision_start|><|image_pad|><|vision_end|>"
    return tok


def prepare(processor, text: str, images=(), *, chat: bool = True) -> tuple[list[int], dict]:
    """Token ids and the extra model inputs for ``text`` about ``images`` (a list of PIL images).

    One placeholder per image is put before the text in the user message; the chat template is
    applied when the tokenizer has one. Returns ``(prompt_ids, model_inputs)`` for
    ``kvtrim.generate_ids(..., model_inputs=...)``.
    """
    images = list(images)
    content = "".join(image_placeholder(processor) + "\n" for _ in images) + text
    tok = processor.tokenizer
    if chat and getattr(tok, "chat_template", None):
        content = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    enc = processor(text=content, images=images or None, return_tensors="pt", add_special_tokens=not chat)
    ids = enc["input_ids"][0].tolist()
    extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    return ids, extra


def load_vlm(path: str | os.PathLike, dtype: torch.dtype | str | None = torch.float32,
             device: torch.device | str | None = "cpu") -> LoadedVLM:
    """Load a vision-language model directory (LLaVA-style or Qwen2-VL-style) and its processor;
    ``dtype`` and ``device`` as :func:`kvtrim.models.load_model` takes them."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from kvtrim.errors import model_load_errors
    from kvtrim.models import plan_dtype, resolve_device

    dev = resolve_device(device)
    plan = plan_dtype(dtype, dev)  # "auto": per phase (kvtrim.models.plan_dtype)
    dtype = plan.storage

    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise KVTrimError(f"{str(path)!r} is not a Hugging Face model directory (no config.json)")
    with model_load_errors("load the model config", str(path)):
        cfg = AutoConfig.from_pretrained(str(p), trust_remote_code=False)
    if not is_multimodal(cfg):
        raise KVTrimError(f"{str(path)!r} (model_type {cfg.model_type!r}) is a text-only model; --image needs a vision-language model")
    with model_load_errors("load the model", str(path)):
        model = AutoModelForImageTextToText.from_pretrained(
            str(p), dtype=dtype, attn_implementation="sdpa", trust_remote_code=False
        ).to(dev).eval()  # type: ignore[arg-type]  # transformers types .to as a decorated method
    if plan.mixed:
        from kvtrim import mixed_precision

        mixed_precision.install(model)
    with model_load_errors("load the processor", str(path)):
        try:
            proc = AutoProcessor.from_pretrained(str(p), backend="pil", trust_remote_code=False)
        except Exception:  # noqa: BLE001 - older/newer processor APIs; fall back to the default backend
            proc = AutoProcessor.from_pretrained(str(p), trust_remote_code=False)
    return LoadedVLM(model, proc, p.name)


def generate_with_images(args, policy, context: str = "") -> dict:
    """``kvtrim generate --image FILE ...``: load the VLM, prepare the inputs, run ``generate_ids``.

    Returns the result as a dict (with the prompt's modality spans). Refuses a text-only model.
    """
    from kvtrim.cache import KVTrimCache
    from kvtrim.generation import generate_ids
    from kvtrim.gguf import DEFAULT_NAME

    imgs = [load_image(p) for p in args.image]  # fail on a bad file before the slow load
    if args.model is None:
        raise KVTrimError(
            f"the embedded model {DEFAULT_NAME} is a text-only model; --image needs a vision-language model "
            "directory (LLaVA-style or Qwen2-VL-style) passed with --model"
        )
    if args.prompt is not None:
        raise KVTrimError("--image goes with --question (the chat template places the image); --prompt is raw text")
    v = load_vlm(args.model, dtype=getattr(args, "dtype", None), device=getattr(args, "device", None))
    text = f"{context}\n\n{args.question}" if context else args.question
    ids, extra = prepare(v.processor, text, imgs)
    cache = KVTrimCache(v.model, policy, kv_bits=getattr(args, "kv_bits", 16))
    res = generate_ids(
        v.model, v.tokenizer, ids, policy, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
        temperature=args.temperature, top_p=getattr(args, "top_p", 1.0), top_k=getattr(args, "top_k", 0), seed=args.seed,
        cache=cache, model_inputs=extra,
    )
    d = res.to_dict()
    d.pop("token_ids")
    d["model"] = v.source
    d["spans"] = [{"start": s.start, "end": s.end, "modality": s.modality} for s in (cache.spans or [])]
    return d
