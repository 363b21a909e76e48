"""Adapters between kvtrim's kernels and policies and an inference engine (Hugging Face transformers).

- :mod:`kvtrim.integrations.hf`: ``attach`` / ``compress``, kvtrim's attention function.
- :mod:`kvtrim.integrations.prefill`: the MInference sparse-prefill hook and per-model pattern configs.

The layering these modules sit in is described in ``docs/architecture.md``.
"""
