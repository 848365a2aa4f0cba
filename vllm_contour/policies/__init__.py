"""Eviction policies in pure torch (no vLLM import): scorer -> allocator -> selector.

Layout: ``base.py`` (interfaces), ``policy.py`` (Policy = the three + forced tokens), ``scorers/``,
``allocators/``, ``selectors/`` (one file per method, each a dataclass citing its paper),
``registry.py`` (named presets).
"""

from .base import Allocator, LayerBudget, LayerInputs, Scorer, Selection, Selector
from .policy import Policy
from .registry import build_policy, policy_help, policy_names, register_preset

__all__ = ["Allocator", "LayerBudget", "LayerInputs", "Scorer", "Selection", "Selector", "Policy",
           "build_policy", "policy_help", "policy_names", "register_preset"]
