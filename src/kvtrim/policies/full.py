"""``full``: no compression. The reference every test and benchmark compares against."""

from __future__ import annotations

from dataclasses import dataclass

from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy


@dataclass
class Full(Policy):
    """Keeps every token (``keep`` may only be 1.0; ``max_tokens`` is refused)."""

    name = "full"
    description = "no compression: every key and value is kept (the reference)"
    takes_budget = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_tokens is not None or (self.keep is not None and self.keep != 1.0):
            raise KVTrimError("full keeps every token; it takes no budget (use keep=1.0 or none)")

    def on_prefill(self, layer, query, key, scaling) -> None:
        pass
