"""Named presets. ``build_policy(name, sink_tokens=..., recent_window=...)`` returns a fresh Policy.

Presets whose components all have ``needs_queries=False`` (streaming, knorm, keydiff,
expected_attention) run without captured queries. Every preset ignores the question tokens (those at
or after ``window_end``) in query-agnostic mode.

ContourKV scorer choice. ``contour`` uses SnapKV window scores for both the head allocation and the
ranking (the mass signal the allocation is built on). On the small default model (SmolLM2-135M,
/work/shared/notes/anchors.md) key norm ranks needles far better than window attention, so
``contour_knorm`` keeps the mass-based allocation (window attention decides HOW MANY pages a head
gets) but ranks tokens inside each head by key norm (WHICH tokens it keeps); it is the variant to try
first on that model. ``snapkv`` and ``adakv`` are the same policy (SnapKV scores + AdaKV head budgets).
"""

from __future__ import annotations

from typing import Callable

from .allocators import AdaKVAllocator, ContourAllocator, PyramidAllocator, UniformAllocator
from .policy import Policy
from .scorers import (ExpectedAttentionScorer, H2OScorer, KeyDiffScorer, KeyNormScorer, MomentScorer,
                      RecencyScorer, SnapKVScorer, TOVAScorer)
from .selectors import DiversitySelector, TopKSelector

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


@register_preset("adakv", "AdaKV: SnapKV window scores with AdaKV head budgets (same behaviour as snapkv)")
def _adakv(**kw) -> Policy:
    return Policy("adakv", SnapKVScorer(), AdaKVAllocator(), TopKSelector(), **kw)


@register_preset("pyramidkv", "PyramidKV: SnapKV window scores, more pages in lower layers (beta=20), "
                              "uniform within a layer")
def _pyramidkv(**kw) -> Policy:
    return Policy("pyramidkv", SnapKVScorer(), PyramidAllocator(), TopKSelector(), **kw)


@register_preset("knorm", "Key-norm: keep keys with the lowest L2 norm (query-free), same budget per head")
def _knorm(**kw) -> Policy:
    return Policy("knorm", KeyNormScorer(), UniformAllocator(), TopKSelector(), **kw)


@register_preset("h2o", "H2O heavy hitters: window-attention mass accumulated over the captured window, "
                        "same budget per head")
def _h2o(**kw) -> Policy:
    return Policy("h2o", H2OScorer(), UniformAllocator(), TopKSelector(), **kw)


@register_preset("tova", "TOVA: attention of the last context query, same budget per head")
def _tova(**kw) -> Policy:
    return Policy("tova", TOVAScorer(), UniformAllocator(), TopKSelector(), **kw)


@register_preset("keydiff", "KeyDiff: keep keys least similar to the mean key direction (query-free), "
                            "same budget per head")
def _keydiff(**kw) -> Policy:
    return Policy("keydiff", KeyDiffScorer(), UniformAllocator(), TopKSelector(), **kw)


@register_preset("expected_attention", "Expected Attention: Gaussian model of future queries (window "
                                       "queries, or key statistics without them) x ||v||, same budget per head")
def _expected_attention(**kw) -> Policy:
    return Policy("expected_attention", ExpectedAttentionScorer(), UniformAllocator(), TopKSelector(), **kw)


@register_preset("contour", "ContourKV: SnapKV window scores, pages to heads where they add the most "
                            "attention mass (greedy water-filling)")
def _contour(**kw) -> Policy:
    return Policy("contour", SnapKVScorer(), ContourAllocator(), TopKSelector(), **kw)


@register_preset("contour_knorm", "ContourKV allocation by window-attention mass, tokens ranked by key norm "
                                  "within each head")
def _contour_knorm(**kw) -> Policy:
    return Policy("contour_knorm", KeyNormScorer(), ContourAllocator(), TopKSelector(),
                  alloc_scorer=SnapKVScorer(), **kw)


@register_preset("contour_diverse", "ContourKV + diversity selector (score - 0.5 x max value-cosine to "
                                    "kept tokens); slower selection")
def _contour_diverse(**kw) -> Policy:
    return Policy("contour_diverse", SnapKVScorer(), ContourAllocator(), DiversitySelector(), **kw)


@register_preset("moment", "MomentKV: window attention x moment residual norm, same budget per head")
def _moment(**kw) -> Policy:
    return Policy("moment", MomentScorer(), UniformAllocator(), TopKSelector(), **kw)


@register_preset("moment_contour", "MomentKV scores with ContourKV head allocation")
def _moment_contour(**kw) -> Policy:
    return Policy("moment_contour", MomentScorer(), ContourAllocator(), TopKSelector(), **kw)


def policy_names() -> list[str]:
    return sorted(_PRESETS)


def policy_help() -> dict[str, str]:
    return {name: _PRESETS[name][0] for name in policy_names()}


def build_policy(name: str, **knobs) -> Policy:
    if name not in _PRESETS:
        raise ValueError(f"unknown eviction policy {name!r}; allowed: none, {', '.join(policy_names())}")
    return _PRESETS[name][1](**knobs)
