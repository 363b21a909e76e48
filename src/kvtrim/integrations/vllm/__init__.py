"""kvtrim inside vLLM: sparse prefill and KV compression that frees vLLM's KV blocks.

Installed with ``pip install 'kvtrim[vllm]'``; vLLM loads :func:`register` through the entry point
``kvtrim = kvtrim.integrations.vllm:register`` in the group ``vllm.general_plugins``, in each of
its processes. Settings come only from vLLM's ``additional_config["kvtrim"]`` (see
:mod:`kvtrim.integrations.vllm.config`); without that key the plugin changes nothing.

Modules: ``config`` (settings and start-up checks), ``plan`` (block arithmetic and compaction,
shared by the two sides), ``backend`` (the attention backend wrapping vLLM's ``CPU_ATTN``, one per
worker and tensor-parallel rank), ``scheduler`` (frees the evicted blocks in the engine core).
Only ``register`` imports vLLM at call time; importing this package does not. See docs/vllm.md.
"""

from __future__ import annotations

from kvtrim.integrations.vllm.config import TESTED_VLLM, PluginConfig, parse

__all__ = ["TESTED_VLLM", "PluginConfig", "parse", "register", "BACKEND"]

BACKEND = "kvtrim.integrations.vllm.backend.KVTrimCPUBackend"


def register() -> None:
    """vLLM's plugin hook: point the ``CPU_ATTN`` backend at kvtrim's wrapper (idempotent).

    The wrapper hands vLLM its own implementation and metadata builder unless the engine's
    ``additional_config`` has a ``"kvtrim"`` key, so an installed but unconfigured plugin leaves
    every computation as it was.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
