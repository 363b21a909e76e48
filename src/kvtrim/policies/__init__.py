"""KV policies, one method per module. Look them up by name through ``kvtrim.registry``."""

from kvtrim.policies.base import POSITION_POLICIES, Policy

__all__ = ["POSITION_POLICIES", "Policy"]
