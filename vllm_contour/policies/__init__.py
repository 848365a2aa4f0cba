"""Eviction policies in pure torch (no vLLM import): scorer -> allocator -> selector."""

from .base import LayerBudget, LayerInputs, Selection
from .policy import Policy
from .registry import build_policy, policy_help, policy_names, register_preset

__all__ = ["LayerBudget", "LayerInputs", "Selection", "Policy", "build_policy", "policy_help",
           "policy_names", "register_preset"]
