"""Named presets, as a data table: each row is a paper's method as scorer + allocator + selector.

``build_policy(name, sink_tokens=..., recent_window=..., args={...})`` returns a fresh Policy. ``args`` sets
component knobs (``policy_args``: ``--kv-policy-args``, per request ``kv_policy_args``): a knob is a scalar
field of a component, named ``scorer.kernel_size`` / ``allocator.mix`` / ``selector.lam`` /
``alloc_scorer.kernel_size``, or by its bare name when only one component of the preset has it;
``policy_knobs(name)`` lists them. Unknown knobs and bad values raise ``ValueError`` naming the knob.

Presets whose components all have ``needs_queries=False`` (streaming, knorm, keydiff, expected_attention)
run without captured queries; kvzip and contour_kvzip score with the engine's context reconstruction. Every
preset ignores the question tokens (those at or after ``window_end``) in query-agnostic mode.

ContourKV scorer choice. ``contour`` uses SnapKV window scores for both the head allocation and the ranking
(the mass signal the allocation is built on). On the small default model (SmolLM2-135M; the passkey table in
docs/results.md) key norm ranks needles far better than window attention, so ``contour_knorm``
keeps the mass-based allocation (window attention decides HOW MANY pages a head gets) but ranks tokens
inside each head by key norm (WHICH tokens it keeps).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .allocators import AdaKVAllocator, ContourAllocator, KVzipAllocator, PyramidAllocator, UniformAllocator
from .policy import Policy
from .scorers import (ExpectedAttentionScorer, H2OScorer, KeyDiffScorer, KeyNormScorer, KVzipScorer, MomentScorer,
                      RecencyScorer, SnapKVScorer, TOVAScorer)
from .selectors import DiversitySelector, TopKSelector


@dataclass(frozen=True)
class Preset:
    name: str
    paper: str
    scorer: type
    allocator: type
    selector: type = TopKSelector
    alloc_scorer: type | None = None
    # the method includes MomentKV's corrected inference (the default of moment_correction for it)
    moment_correction: bool = False
    cost: str = "one window-attention pass per round"
    differs: str = ""  # where this implementation differs from the paper

    @property
    def help(self) -> str:
        parts = [f"{self.paper}: {self.scorer.__name__}", self.allocator.__name__, self.selector.__name__]
        if self.alloc_scorer is not None:
            parts.insert(2, f"alloc by {self.alloc_scorer.__name__}")
        return " + ".join(parts) + (" + moment correction" if self.moment_correction else "")


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("streaming", "StreamingLLM (Xiao et al., ICLR 2024)", RecencyScorer, UniformAllocator,
           cost="no scoring"),
    Preset("snapkv", "SnapKV (Li et al., 2024)", SnapKVScorer, UniformAllocator,
           differs="budget in whole pages per head"),
    Preset("adakv", "Ada-KV (Feng et al., 2024) on SnapKV scores", SnapKVScorer, AdaKVAllocator,
           differs="AdaKV's safeguard is a page floor per head"),
    Preset("pyramidkv", "PyramidKV (Cai et al., 2024)", SnapKVScorer, PyramidAllocator,
           differs="the largest layer gets the budget (a block holds every layer), not the mean"),
    Preset("knorm", "Key norm (Devoto et al., EMNLP 2024)", KeyNormScorer, UniformAllocator,
           cost="no queries; one norm per key"),
    Preset("h2o", "H2O (Zhang et al., NeurIPS 2023)", H2OScorer, UniformAllocator,
           differs="mass accumulated over each round's captured window, not every step"),
    Preset("tova", "TOVA (Oren et al., 2024)", TOVAScorer, UniformAllocator,
           differs="re-scored every round, not every step"),
    Preset("keydiff", "KeyDiff (Park et al., 2025)", KeyDiffScorer, UniformAllocator,
           cost="no queries; one cosine per key"),
    Preset("expected_attention", "Expected Attention (Devoto et al., 2025)", ExpectedAttentionScorer,
           UniformAllocator, differs="query statistics from the captured post-RoPE window"),
    Preset("contour", "ContourKV (this project)", SnapKVScorer, ContourAllocator),
    Preset("contour_knorm", "ContourKV allocation, key-norm ranking (this project)", KeyNormScorer,
           ContourAllocator, alloc_scorer=SnapKVScorer),
    Preset("contour_diverse", "ContourKV + diversity penalty (this project; MMR, Carbonell & Goldstein 1998)",
           SnapKVScorer, ContourAllocator, DiversitySelector,
           cost="one window-attention pass + a greedy pick per kept token (a few tensor ops each; ~85x top-k's "
                "selection time at 384 tokens per head)"),
    Preset("kvzip", "KVzip (Kim et al., NeurIPS 2025)", KVzipScorer, KVzipAllocator,
           cost="the context's reconstruction once per context (hidden requests: about the context's length in "
                "tokens with prefix caching, twice that without)",
           differs="one round at the context boundary (or the prompt end), and one at the end of each later "
                   "streaming-input chunk (its new tokens reconstructed over the session's uncompressed tokens); "
                   "generated tokens stay dense; the score threshold is per layer, not across layers; sinks and "
                   "recent window kept"),
    Preset("contour_kvzip", "ContourKV allocation over KVzip scores (this project)", KVzipScorer,
           ContourAllocator,
           cost="the context's reconstruction once per context (hidden requests: about the context's length in "
                "tokens with prefix caching, twice that without)",
           differs="rounds as kvzip's"),
    Preset("moment", "MomentKV (this project)", MomentScorer, UniformAllocator, moment_correction=True,
           cost="two moment/residual passes (O(N D^2)) per round; moment pages inside the budget",
           differs="the residual puts the key k_j where a query belongs (a proxy)"),
    Preset("moment_contour", "MomentKV scores with ContourKV allocation (this project)", MomentScorer,
           ContourAllocator, moment_correction=True,
           cost="two moment/residual passes (O(N D^2)) per round; moment pages inside the budget"),
]}


def policy_names() -> list[str]:
    return sorted(PRESETS)


def policy_help() -> dict[str, str]:
    return {name: PRESETS[name].help for name in policy_names()}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown eviction policy {name!r}; allowed: none, {', '.join(policy_names())}")
    return PRESETS[name]


_SCALARS = (bool, int, float, str)


def _roles(p: Preset) -> dict[str, type]:
    roles = {"scorer": p.scorer, "allocator": p.allocator, "selector": p.selector}
    if p.alloc_scorer is not None:
        roles["alloc_scorer"] = p.alloc_scorer
    return roles


def _fields(cls: type) -> dict[str, Any]:
    """Settable scalar knobs of a component: name -> default (its declared capabilities are class-level, not
    fields, so never knobs)."""
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, _SCALARS):
            out[f.name] = default
    return out


def policy_knobs(name: str) -> dict[str, Any]:
    """``{"role.knob": default}`` for every settable knob of the preset."""
    return {f"{role}.{k}": v for role, cls in _roles(preset(name)).items() for k, v in _fields(cls).items()}


def _coerce(knob: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, str) and isinstance(value, str):
        return value
    raise ValueError(f"policy knob {knob}: expected {type(default).__name__}, got {value!r}")


def resolve_knobs(name: str, args: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``args`` -> ``{role: {field: value}}``, validated (names, types)."""
    knobs = policy_knobs(name)
    out: dict[str, dict[str, Any]] = {}
    for key, value in (args or {}).items():
        if not isinstance(key, str):
            raise ValueError(f"policy knob {key!r}: names are strings")
        full = key if key in knobs else None
        if full is None:
            matches = [k for k in knobs if k.split(".", 1)[1] == key]
            if len(matches) > 1:
                raise ValueError(f"policy knob {key!r} is ambiguous for {name}: say {' or '.join(matches)}")
            full = matches[0] if matches else None
        if full is None:
            raise ValueError(f"policy {name} has no knob {key!r}; knobs: {', '.join(knobs) or 'none'}")
        role, field = full.split(".", 1)
        out.setdefault(role, {})[field] = _coerce(full, value, knobs[full])
    return out


def build_policy(name: str, args: dict[str, Any] | None = None, **kw) -> Policy:
    """A fresh Policy for preset ``name``; ``args`` sets component knobs; ``kw`` (sink_tokens,
    recent_window, description) go to ``Policy``."""
    p = preset(name)
    set_ = resolve_knobs(name, args)
    parts = {}
    for role, cls in _roles(p).items():
        try:
            parts[role] = cls(**set_.get(role, {}))
        except ValueError as e:
            knobs = ", ".join(f"{role}.{k}" for k in set_.get(role, {}))
            raise ValueError(f"policy knob {knobs}: {e}") from None
    return Policy(name, parts["scorer"], parts["allocator"], parts["selector"],
                  alloc_scorer=parts.get("alloc_scorer"), **kw)
