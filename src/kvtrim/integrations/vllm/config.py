"""The plugin's settings, read from vLLM's ``additional_config["kvtrim"]`` and checked at start-up.

This module does not import vLLM: the checks run (and are tested) in any environment. Keys::

    {"kvtrim": {
        "prefill": "minference",          # or a_shape / vertical_slash / block_sparse / dense; absent: vLLM's own prefill
        "pattern_config": "FILE.json",    # minference only; default: the config kvtrim ships for the model
        "sizes": {"k_v": 400, ...},       # single-pattern modes only
        "min_length": 4096,               # prompts shorter than this prefill dense
        "method": "snapkv",               # or streaming_llm; absent: no KV compression
        "keep": 0.25,                     # fraction of the prompt's tokens kept (rounded up to whole blocks)
        "window": 32, "kernel": 7, "pooling": "max",   # snapkv's observation window and pooling
        "sinks": 4                        # tokens always kept at the start
    }}

Anything else under ``"kvtrim"`` is refused, so a misspelt key cannot be silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtrim import validate
from kvtrim.errors import KVTrimError

#: vLLM releases the plugin is tested on; any other version is refused at start-up.
TESTED_VLLM = ("0.32.0",)
#: KV compression methods the plugin carries out inside vLLM.
METHODS = ("snapkv", "streaming_llm")
PREFILL = ("dense", "minference", "a_shape", "vertical_slash", "block_sparse")
KEYS = ("prefill", "pattern_config", "sizes", "min_length", "method", "keep", "window", "kernel", "pooling", "sinks")
#: Below this prompt length the sparse prefill runs dense (kvtrim's measured crossover on CPU).
DEFAULT_MIN_LENGTH = 4096


@dataclass
class PluginConfig:
    """What the plugin does; built by :func:`parse` (``None`` there means the plugin changes nothing)."""

    prefill: str | None = None
    pattern_config: str | None = None
    sizes: dict = field(default_factory=dict)
    min_length: int = DEFAULT_MIN_LENGTH
    method: str | None = None
    keep: float = 0.25
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    sinks: int = 4

    def __post_init__(self) -> None:
        if self.prefill is not None:
            validate.choice(self.prefill, "kvtrim prefill", PREFILL)
        if self.pattern_config is not None:
            if self.prefill != "minference":
                raise KVTrimError(f"kvtrim pattern_config is used with prefill 'minference' only, not {self.prefill!r}")
            if not isinstance(self.pattern_config, str):
                raise KVTrimError(f"kvtrim pattern_config must be a file path, got {self.pattern_config!r}")
        if not isinstance(self.sizes, dict):
            raise KVTrimError(f"kvtrim sizes must be an object of pattern sizes, got {self.sizes!r}")
        if self.sizes and self.prefill not in ("a_shape", "vertical_slash", "block_sparse"):
            raise KVTrimError(f"kvtrim sizes are used with a single-pattern prefill only, not {self.prefill!r}")
        self.min_length = validate.integer(self.min_length, "kvtrim min_length", minimum=1)
        if self.method is not None:
            validate.choice(self.method, "kvtrim method", METHODS)
        self.keep = validate.fraction(self.keep, "kvtrim keep")
        self.window = validate.integer(self.window, "kvtrim window", minimum=1)
        self.kernel = validate.integer(self.kernel, "kvtrim kernel", minimum=1)
        if self.kernel % 2 == 0:
            raise KVTrimError(f"kvtrim kernel must be a positive odd integer, got {self.kernel!r}")
        validate.choice(self.pooling, "kvtrim pooling", ("avg", "max"))
        self.sinks = validate.integer(self.sinks, "kvtrim sinks", minimum=0)

    @property
    def active(self) -> bool:
        return self.prefill is not None or self.method is not None


def parse(additional_config) -> PluginConfig | None:
    """The plugin's settings from vLLM's ``additional_config``; ``None`` when there is no ``"kvtrim"`` key."""
    if not isinstance(additional_config, dict) or "kvtrim" not in additional_config:
        return None
    raw = additional_config["kvtrim"]
    if not isinstance(raw, dict):
        raise KVTrimError(f"additional_config['kvtrim'] must be an object, got {raw!r}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise KVTrimError(f"unknown kvtrim setting(s) {unknown}; known: {', '.join(KEYS)}")
    if "method" in raw and raw["method"] not in (None, *METHODS):
        raise KVTrimError(f"unknown kvtrim method {raw['method']!r}; the vLLM plugin runs: {', '.join(METHODS)}")
    cfg = PluginConfig(**raw)
    return cfg if cfg.active else None


def check_engine(cfg: PluginConfig, *, vllm_version: str, prefix_caching: bool, speculative: bool,
                 scheduler_cls: str | None, platform: str) -> None:
    """Refuse engine settings the plugin cannot honour (one :class:`KVTrimError` line each)."""
    if vllm_version not in TESTED_VLLM:
        raise KVTrimError(f"kvtrim's vLLM plugin is tested on vLLM {', '.join(TESTED_VLLM)}, not {vllm_version}; "
                          "install a tested version (pip install 'kvtrim[vllm]')")
    if platform != "cpu" and cfg.prefill not in (None, "dense"):
        raise KVTrimError(f"kvtrim's vLLM sparse prefill wraps the CPU backend only (this engine runs on {platform})")
    if cfg.method is None:
        return
    if platform != "cpu":
        raise KVTrimError(f"kvtrim's vLLM KV compression wraps the CPU backend only (this engine runs on {platform})")
    if prefix_caching:
        raise KVTrimError("kvtrim method needs vLLM's prefix caching off: compaction rewrites blocks the prefix cache "
                          "would share (pass --no-enable-prefix-caching / enable_prefix_caching=False)")
    if speculative:
        raise KVTrimError("kvtrim method does not run with speculative decoding")
    if scheduler_cls != SCHEDULER:
        raise KVTrimError(f"kvtrim method needs its scheduler, which frees the evicted blocks: pass "
                          f"--scheduler-cls {SCHEDULER} (scheduler_cls='{SCHEDULER}')")


SCHEDULER = "kvtrim.integrations.vllm.scheduler.KVTrimScheduler"
