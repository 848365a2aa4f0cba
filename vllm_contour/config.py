"""One validated eviction configuration (server default) plus per-request overrides.

Sources, all validated here:
- CLI: ``--kv-eviction-policy NAME --kv-budget N --kv-recent-window W --kv-sink-tokens S ...``
- ``--additional-config '{"kv_eviction": {...}}'`` / ``LLM(..., additional_config={"kv_eviction": {...}})``
- per request: ``SamplingParams(extra_args={"kv_policy": ..., "kv_budget": ...})`` or OpenAI
  ``extra_body={"vllm_xargs": {...}}``.
Pure python: no vLLM import.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

ADDITIONAL_CONFIG_KEY = "kv_eviction"
DEFAULT_BUDGET = 128
# Tokens of dense tail a request may grow before the policy runs again (a multiple of the block size;
# 0 = evict once, when the prompt ends). Chosen by the sweep in the README (round cost <= 10 % of decode).
DEFAULT_DECODE_INTERVAL = 64
# extra_args keys that start with "kv_" but belong to vLLM itself, not to this plugin.
VLLM_OWNED_KEYS = frozenset({"kv_transfer_params"})


class EvictionConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


def _policy_names() -> list[str]:
    from vllm_contour.policies import policy_names

    return policy_names()


def _check_int(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        # Accept integral floats from JSON (e.g. 128.0) but not 12.5 or strings.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        else:
            raise EvictionConfigError(f"{field} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise EvictionConfigError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_bool(field: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    # vLLM hands JSON booleans of vllm_xargs over as 1 / 0
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise EvictionConfigError(f"{field} must be true or false, got {value!r}")


def check_policy(field: str, value: Any) -> str:
    names = _policy_names()
    if not isinstance(value, str) or (value != "none" and value not in names):
        raise EvictionConfigError(
            f"{field}: unknown eviction policy {value!r}; allowed: none, {', '.join(names)}")
    return value


def check_policy_args(field: str, value: Any, policy: str | None = None) -> dict[str, Any]:
    """Component knobs: a JSON object, or a JSON string of one (``vllm_xargs`` values are scalars). With
    ``policy`` given, every knob is checked against that preset (errors name the knob)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise EvictionConfigError(f"{field} must be a JSON object, got {value!r} ({e.msg})") from None
    if not isinstance(value, Mapping):
        raise EvictionConfigError(f"{field} must be a JSON object of policy knobs, got {value!r}")
    out = dict(value)
    if policy is not None and policy != "none":
        from vllm_contour.policies import build_policy

        try:
            build_policy(policy, out)
        except ValueError as e:
            raise EvictionConfigError(f"{field}: {e}") from None
    return out


def preset_moments(policy: str) -> bool:
    """Whether the preset's method includes MomentKV's corrected inference (the default for it)."""
    if policy == "none":
        return False
    from vllm_contour.policies.registry import preset

    return preset(policy).moment_correction


@dataclass(frozen=True)
class EvictionConfig:
    """Server-wide eviction settings.

    policy: preset name, or ``none`` (eviction off: vLLM behaves exactly as stock).
    budget: tokens kept per KV head per layer on average (the compacted part, moment pages included),
        rounded down to whole blocks and shared by the heads in whole head-pages.
    decode_interval: dense tail (tokens) a request grows before the policy runs again over its kept
        tokens plus the tail; a multiple of the block size, 0 = evict only when the prompt ends; None
        (default) = DEFAULT_DECODE_INTERVAL rounded up to whole blocks.
    recent_window: most recent prompt tokens every head keeps (recency floor).
    sink_tokens: first tokens every head keeps (attention sinks).
    window: observation window (last prompt queries) that query-aware scorers look at.
    moment_correction: keep MomentKV statistics of the evicted tokens (stored in the request's own
        head-pages and counted against the budget) and correct decode attention with them; None (default)
        = what the preset's method does (on for the MomentKV presets, off otherwise).
    policy_args: knobs of the preset's components (``vllm_contour.policies.policy_knobs``).
    share_contexts: with prefix caching on, a request's compressed context (``kv_context_len``) is shared by
        later requests that start with the same context and settings (default on).
    """

    policy: str = "none"
    budget: int = DEFAULT_BUDGET
    recent_window: int = 32
    sink_tokens: int = 4
    window: int = 32
    moment_correction: bool | None = None
    decode_interval: int | None = None
    policy_args: dict[str, Any] = field(default_factory=dict)
    share_contexts: bool = True

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, *, source: str = ADDITIONAL_CONFIG_KEY) -> "EvictionConfig":
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise EvictionConfigError(f"{source} must be a JSON object, got {type(raw).__name__}")
        allowed = cls.fields()
        unknown = sorted(set(raw) - set(allowed))
        if unknown:
            raise EvictionConfigError(
                f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        kw: dict[str, Any] = {}
        if "policy" in raw:
            kw["policy"] = check_policy(f"{source}.policy", raw["policy"])
        for name, minimum in (("budget", 1), ("recent_window", 0), ("sink_tokens", 0), ("window", 1),
                              ("decode_interval", 0)):
            if name in raw and not (name == "decode_interval" and raw[name] is None):
                kw[name] = _check_int(f"{source}.{name}", raw[name], minimum)
        for name in ("moment_correction", "share_contexts"):
            if raw.get(name) is not None:
                kw[name] = _check_bool(f"{source}.{name}", raw[name])
        if raw.get("policy_args"):
            kw["policy_args"] = check_policy_args(f"{source}.policy_args", raw["policy_args"],
                                                  kw.get("policy", "none"))
        cfg = cls(**kw)
        if not cfg.enabled:
            extra = sorted(k for k in raw if k not in ("policy", "share_contexts") and raw[k] not in (None, {}))
            if extra:
                raise EvictionConfigError(
                    f"{source}: {', '.join(extra)} given but the eviction policy is 'none' (eviction off); "
                    f"set {source}.policy (--kv-eviction-policy) to one of: {', '.join(_policy_names())}")
        return cfg

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> "EvictionConfig":
        if not additional_config:
            return cls()
        if isinstance(additional_config, Mapping):
            return cls.from_dict(additional_config.get(ADDITIONAL_CONFIG_KEY))
        return cls()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Per-request keys accepted in SamplingParams.extra_args / vllm_xargs.
REQUEST_KEYS = {
    "kv_policy": "policy",
    "kv_budget": "budget",
    "kv_recent_window": "recent_window",
    "kv_sink_tokens": "sink_tokens",
    "kv_moment_correction": "moment_correction",
    "kv_decode_interval": "decode_interval",
    "kv_observation_window": "window",
    # component knobs as a JSON string (vLLM's vllm_xargs values are scalars), e.g. '{"lam": 0.3}'
    "kv_policy_args": "policy_args",
    # Query-agnostic mode: the first kv_context_len prompt tokens are context (compressed before the
    # question is seen); the rest is the question, kept dense and never scored.
    "kv_context_len": "context_len",
    # "prefill" (default): the prefill stops at the context boundary, the context is compressed, the rest of
    # the prompt is computed over the compressed cache (kvpress's protocol). "score_only": the whole prompt
    # is prefilled over the full context and only the scoring ignores the question (the earlier behaviour,
    # kept to measure the leak).
    "kv_agnostic_mode": "agnostic_mode",
}


@dataclass(frozen=True)
class RequestEviction:
    """Effective settings for one request (server default + overrides)."""

    policy: str
    budget: int
    recent_window: int
    sink_tokens: int
    window: int
    moment_correction: bool = False
    decode_interval: int | None = None
    context_len: int | None = None
    policy_args: dict[str, Any] = field(default_factory=dict)
    agnostic_mode: str = "prefill"

    @property
    def enabled(self) -> bool:
        return self.policy != "none"


AGNOSTIC_MODES = ("prefill", "score_only")


def request_overrides(extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate the ``kv_*`` keys of a request's extra_args; returns {config field: value}.
    Keys not starting with ``kv_`` (and vLLM's own ``kv_transfer_params``) belong to others and are
    ignored."""
    out: dict[str, Any] = {}
    if not extra_args:
        return out
    for key, value in extra_args.items():
        if not isinstance(key, str) or not key.startswith("kv_") or key in VLLM_OWNED_KEYS:
            continue
        if key not in REQUEST_KEYS:
            raise EvictionConfigError(
                f"unknown per-request eviction key {key!r}; allowed: {', '.join(sorted(REQUEST_KEYS))}")
        field = REQUEST_KEYS[key]
        if field == "policy":
            out[field] = check_policy(key, value)
        elif field == "moment_correction":
            out[field] = _check_bool(key, value)
        elif field == "policy_args":
            out[field] = check_policy_args(key, value)
        elif field == "agnostic_mode":
            if value not in AGNOSTIC_MODES:
                raise EvictionConfigError(f"{key} must be one of {', '.join(AGNOSTIC_MODES)}, got {value!r}")
            out[field] = value
        else:
            out[field] = _check_int(key, value, 1 if field in ("budget", "context_len", "window") else 0)
    return out


def resolve_request(server: EvictionConfig, extra_args: Mapping[str, Any] | None) -> RequestEviction:
    """Server defaults + the request's overrides. The server's knobs belong to the server's policy: a
    request that picks another policy starts from no knobs; its own ``kv_policy_args`` are checked
    against the policy it ends up with. ``moment_correction`` unset = the preset's method."""
    kw = server.to_dict()
    kw.pop("share_contexts")
    over = request_overrides(extra_args)
    if over.get("policy", server.policy) != server.policy:
        kw["policy_args"] = {}
    kw.update(over)
    if "policy_args" in over and kw["policy"] != "none":
        kw["policy_args"] = check_policy_args("kv_policy_args", over["policy_args"], kw["policy"])
    if kw.get("moment_correction") is None:
        kw["moment_correction"] = preset_moments(kw["policy"])
    return RequestEviction(**kw)
