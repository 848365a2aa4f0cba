"""Named presets. ``build_policy(name, sink_tokens=..., recent_window=...)`` returns a fresh Policy."""

from __future__ import annotations

from typing import Callable

from .allocators import AdaKVAllocator, UniformAllocator
from .policy import Policy
from .scorers import KeyNormScorer, RecencyScorer, SnapKVScorer
from .selectors import TopKSelector

# name -> (one-line help, factory(**knobs) -> Policy)
_PRESETS: dict[str, tuple[str, Callable[..., Policy]]] = {}


def register_preset(name: str, help_text: str):
    def deco(factory: Callable[..., Policy]):
        _PRESETS[name] = (help_text, factory)
        return factory
    return deco


@register_preset("streaming", "StreamingLLM: attention sinks + most recent tokens, same budget per head")
def _streaming(**kw) -> Policy:
    return Policy("streaming", RecencyScorer(), UniformAllocator(), TopKSelector(), **kw)


@register_preset("snapkv", "SnapKV: observation-window attention (pooled, GQA-averaged), AdaKV head budgets")
def _snapkv(**kw) -> Policy:
    return Policy("snapkv", SnapKVScorer(), AdaKVAllocator(), TopKSelector(), **kw)


@register_preset("knorm", "Key-norm: keep keys with the lowest L2 norm (query-free), same budget per head")
def _knorm(**kw) -> Policy:
    return Policy("knorm", KeyNormScorer(), UniformAllocator(), TopKSelector(), **kw)


def policy_names() -> list[str]:
    return sorted(_PRESETS)


def policy_help() -> dict[str, str]:
    return {name: _PRESETS[name][0] for name in policy_names()}


def build_policy(name: str, **knobs) -> Policy:
    if name not in _PRESETS:
        raise ValueError(f"unknown eviction policy {name!r}; allowed: none, {', '.join(policy_names())}")
    return _PRESETS[name][1](**knobs)
