"""The plugin's settings, read from vLLM's ``additional_config["kvtrim"]`` and checked at start-up.

This module does not import vLLM: the checks run (and are tested) in any environment. Keys::

    {"kvtrim": {
        "prefill": "minference",          # or a_shape / vertical_slash / block_sparse / dense; absent: vLLM's own prefill
        "pattern_config": "FILE.json",    # minference only; default: the config kvtrim ships for the model
        "sizes": {"k_v": 400, ...},       # single-pattern modes only
        "min_length": 4096,               # prompts shorter than this prefill dense
        "method": "snapkv",               # any text method of `kvtrim methods`; absent: no KV compression
        "keep": 0.25, ...                 # every other key is a parameter of the method (keep, max_tokens, window, ...)
    }}

The method's policy is built with ``kvtrim.registry.create_policy(method, **parameters)``, the
same call and checks as everywhere else in kvtrim: an unknown parameter or a bad value is one
``KVTrimError`` line. Methods that rewrite the prefill forward (they drop tokens from the hidden
states inside the model, which vLLM runs itself) are refused, and so is a position policy other
than ``true`` (vLLM rotates each new query at its true position; kvtrim cannot re-rotate cached keys
inside vLLM's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtrim import validate
from kvtrim.errors import KVTrimError
from kvtrim.registry import create_policy, method_names

#: vLLM releases the plugin is tested on; any other version is refused at start-up.
TESTED_VLLM = ("0.32.0",)
PREFILL = ("dense", "minference", "a_shape", "vertical_slash", "block_sparse")
#: the plugin's own keys; every other key is a parameter of the method
KEYS = ("prefill", "pattern_config", "sizes", "min_length", "method")
#: Below this prompt length the sparse prefill runs vLLM's kernel: the same default as on transformers
#: (kvtrim.integrations.prefill.DEFAULT_MIN_LENGTH; docs/minference.md says why), so both engines
#: prefill the same prompts sparsely.
DEFAULT_MIN_LENGTH = 4096
#: vLLM ``kv_cache_dtype`` kinds the plugin runs with: those vLLM's CPU attention backend lists
#: (``CPUAttentionBackend.supported_kv_cache_dtypes``). vLLM's CPU build does not check the others
#: (``bfloat16``, ``float16``, ``int8_per_token_head``, ...) and decodes wrong tokens with them (docs/vllm.md).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class PluginConfig:
    """What the plugin does; built by :func:`parse` (``None`` there means the plugin changes nothing)."""

    prefill: str | None = None
    pattern_config: str | None = None
    sizes: dict = field(default_factory=dict)
    min_length: int = DEFAULT_MIN_LENGTH
    method: str | None = None
    params: dict = field(default_factory=dict)

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
        if self.method is None:
            if self.params:
                raise KVTrimError(f"kvtrim setting(s) {sorted(self.params)} are method parameters; give a method too "
                                  f"(known: {', '.join(KEYS)}, and a method's parameters)")
            return
        if self.method not in method_names():
            raise KVTrimError(f"unknown kvtrim method {self.method!r}; known methods: {', '.join(method_names())}")
        self.policy()  # every parameter checked now, by the policy class itself

    def policy(self):
        """A fresh policy for this configuration (each engine process and rank builds its own)."""
        assert self.method is not None
        params = {"position": "true", **self.params}
        policy = create_policy(self.method, **params)
        if policy.rewrites_forward:
            raise KVTrimError(
                f"kvtrim method {self.method!r} rewrites the prefill forward (it drops tokens from the hidden states "
                "inside the model, which vLLM runs itself), so the vLLM plugin cannot run it; use it on transformers "
                "(kvtrim generate)")
        if policy.needs_reconstruction:
            raise KVTrimError(
                f"kvtrim method {self.method!r} scores the prompt by a second forward that reconstructs it, which "
                "kvtrim runs itself and vLLM's scheduler does not; use it on transformers (kvtrim generate, kvtrim eval)")
        if not policy.uniform_layers:
            raise KVTrimError(
                f"kvtrim method {self.method!r} with per-layer budgets keeps a different number of tokens in each "
                "layer, and vLLM's layers share one block table per request; use layers 'uniform' (the default) "
                "with the vLLM plugin, or per-layer budgets on transformers (kvtrim generate)")
        if not policy.uniform_heads:
            raise KVTrimError(
                f"kvtrim method {self.method!r} with per-head budgets keeps a different number of tokens in each KV "
                "head, and a request's heads share one block table in vLLM; use heads 'uniform' (the default) with "
                "the vLLM plugin, or per-head budgets on transformers (kvtrim generate)")
        if policy.position_policy != "true":
            raise KVTrimError(
                f"kvtrim position {policy.position_policy!r} re-rotates cached keys, which the vLLM plugin cannot do "
                "inside vLLM's blocks; use position 'true' (the plugin's default)")
        return policy

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
    own = {k: v for k, v in raw.items() if k in KEYS}
    cfg = PluginConfig(**own, params={k: v for k, v in raw.items() if k not in KEYS})
    return cfg if cfg.active else None


def check_engine(cfg: PluginConfig, *, vllm_version: str, prefix_caching: bool, speculative: bool,
                 scheduler_cls: str | None, platform: str, kv_cache_dtype: str = "auto") -> None:
    """Refuse engine settings the plugin cannot honour (one :class:`KVTrimError` line each)."""
    if vllm_version not in TESTED_VLLM:
        raise KVTrimError(f"kvtrim's vLLM plugin is tested on vLLM {', '.join(TESTED_VLLM)}, not {vllm_version}; "
                          "install a tested version (pip install -e '.[vllm]' in a clone of kvtrim)")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise KVTrimError(f"kvtrim's vLLM plugin runs with kv_cache_dtype {', '.join(KV_CACHE_DTYPES)} (the kinds vLLM's "
                          f"CPU attention backend lists), not {kv_cache_dtype!r}")
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
