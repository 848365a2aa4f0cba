"""Eviction policies in pure torch (no vLLM import): scorer -> allocator -> selector.

Layout: ``base.py`` (the inputs, and the interfaces every component subclasses, which declare its
capabilities), ``planner.py`` (the pipeline over layers and requests), ``policy.py`` (Policy = the three +
forced tokens), ``scorers/``, ``allocators/``, ``selectors/`` (one file per method, each a dataclass citing its paper),
``registry.py`` (named presets: a data table of paper -> components, with their knobs).
"""

from .base import Allocator, Component, LayerBudget, LayerInputs, ModelIdentity, Scorer, Selection, Selector
from .policy import Policy
from .registry import PRESETS, Preset, build_policy, policy_help, policy_knobs, policy_names

__all__ = ["Allocator", "Component", "LayerBudget", "LayerInputs", "ModelIdentity", "Scorer", "Selection", "Selector", "Policy",
           "PRESETS", "Preset", "build_policy", "policy_help", "policy_knobs", "policy_names"]
