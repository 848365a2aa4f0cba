"""One validated eviction configuration (server default) plus per-request overrides; the knobs, their
defaults and minimums come from the table in ``knobs.py``.

Sources, all validated here:
- CLI: ``--kv-eviction-policy NAME --kv-budget N --kv-recent-window W --kv-sink-tokens S ...``
- ``--additional-config '{"kv_eviction": {...}}'`` / ``LLM(..., additional_config={"kv_eviction": {...}})``
- per request: ``SamplingParams(extra_args={"kv_policy": ..., "kv_budget": ...})`` or OpenAI
  ``extra_body={"vllm_xargs": {...}}``.
Pure python: no vLLM import.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Mapping

from vllm_contour.knobs import (ADDITIONAL_CONFIG_KEY, BY_REQUEST_KEY, DEFAULT_BUDGET, DEFAULT_DECODE_INTERVAL,
                                REQUEST_KNOBS, SERVER_KNOBS, Knob, help_text)

__all__ = ["ADDITIONAL_CONFIG_KEY", "DEFAULT_BUDGET", "DEFAULT_DECODE_INTERVAL", "EvictionConfig",
           "EvictionConfigError", "RequestEviction", "REQUEST_KEYS", "RESOLVED_KEY", "check_value",
           "request_overrides", "request_settings", "resolve_request", "resolved_entry"]
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


def check_value(knob: Knob, name: str, value: Any, policy: str | None = None) -> Any:
    """One knob's value, validated by its kind; errors name ``name`` (the config field or the request key).
    ``policy``: the policy a ``policy_args`` value is checked against (None: not checked yet)."""
    if knob.kind == "policy":
        return check_policy(name, value)
    if knob.kind == "int":
        return _check_int(name, value, knob.minimum)
    if knob.kind == "bool":
        return _check_bool(name, value)
    if knob.kind == "json":
        return check_policy_args(name, value, policy)
    if value not in knob.choices:
        raise EvictionConfigError(f"{name} must be one of {', '.join(knob.choices)}, got {value!r}")
    return value


def _field(knob: Knob) -> tuple[str, Any, Any]:
    if isinstance(knob.default, (dict, list)):
        spec = dataclasses.field(default_factory=lambda d=knob.default: copy.deepcopy(d))
    else:
        spec = dataclasses.field(default=knob.default)
    return knob.field, knob.annotation, spec


def _doc(title: str, knobs: tuple[Knob, ...]) -> str:
    return title + "\n\n" + "\n".join(f"{k.field}: {help_text(k)}" for k in knobs)


class _Enabled:
    @property
    def enabled(self) -> bool:
        return self.policy != "none"


class _ServerConfig(_Enabled):
    """Construction of ``EvictionConfig`` (its fields come from ``knobs.SERVER_KNOBS``)."""

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
        for knob in SERVER_KNOBS:  # policy comes first: policy_args are checked against it
            if knob.field in raw and not knob.unset(raw[knob.field]):
                kw[knob.field] = check_value(knob, f"{source}.{knob.field}", raw[knob.field],
                                             kw.get("policy", "none"))
        cfg = cls(**kw)
        if not cfg.enabled:
            off_ok = {k.field for k in SERVER_KNOBS if k.allowed_when_off}
            extra = sorted(k for k in raw if k not in off_ok and raw[k] not in (None, {}))
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


EvictionConfig = dataclasses.make_dataclass(
    "EvictionConfig", [_field(k) for k in SERVER_KNOBS], bases=(_ServerConfig,), frozen=True,
    namespace={"__module__": __name__})
EvictionConfig.__doc__ = _doc("Server-wide eviction settings (``knobs.SERVER_KNOBS``).", SERVER_KNOBS)

RequestEviction = dataclasses.make_dataclass(
    "RequestEviction", [_field(k) for k in REQUEST_KNOBS], bases=(_Enabled,), frozen=True,
    namespace={"__module__": __name__})
RequestEviction.__doc__ = _doc("Effective settings for one request: the server's, overridden by the request's "
                               "keys (``knobs.REQUEST_KNOBS``).", REQUEST_KNOBS)

# Per-request keys accepted in SamplingParams.extra_args / vllm_xargs -> their field.
REQUEST_KEYS = {k.request_key: k.field for k in REQUEST_KNOBS}


def request_overrides(extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate the ``kv_*`` keys of a request's extra_args; returns {config field: value}.
    Keys not starting with ``kv_`` (and vLLM's own ``kv_transfer_params``) belong to others and are
    ignored. ``kv_policy_args`` is checked against the request's policy by ``resolve_request``."""
    out: dict[str, Any] = {}
    if not extra_args:
        return out
    for key, value in extra_args.items():
        if not isinstance(key, str) or not key.startswith("kv_") or key in VLLM_OWNED_KEYS:
            continue
        if key not in BY_REQUEST_KEY:
            raise EvictionConfigError(
                f"unknown per-request eviction key {key!r}; allowed: {', '.join(sorted(BY_REQUEST_KEY))}")
        knob = BY_REQUEST_KEY[key]
        out[knob.field] = check_value(knob, key, value)
    return out


def resolve_request(server: EvictionConfig, extra_args: Mapping[str, Any] | None) -> RequestEviction:
    """Server defaults + the request's overrides. The server's knobs belong to the server's policy: a
    request that picks another policy starts from no knobs; its own ``kv_policy_args`` are checked
    against the policy it ends up with. ``moment_correction`` unset = the preset's method."""
    kw = {f: v for f, v in server.to_dict().items() if f in REQUEST_KEYS.values()}
    over = request_overrides(extra_args)
    if over.get("policy", server.policy) != server.policy:
        kw["policy_args"] = {}
    kw.update(over)
    if "policy_args" in over and kw["policy"] != "none":
        kw["policy_args"] = check_policy_args("kv_policy_args", over["policy_args"], kw["policy"])
    if kw.get("moment_correction") is None:
        kw["moment_correction"] = preset_moments(kw["policy"])
    return RequestEviction(**kw)


# The extra_args entry the front end writes once it has checked a request's kv_* keys against the server's
# settings: the request's effective settings, so that the scheduler does not parse them again. Not a kv_*
# key (clients cannot send it through vllm_xargs, whose values are scalars or lists).
RESOLVED_KEY = "contour_resolved"


def _fingerprint(server: EvictionConfig) -> str:
    return json.dumps(server.to_dict(), sort_keys=True)


def resolved_entry(server: EvictionConfig, params: RequestEviction) -> dict[str, Any]:
    """What the front end stores under ``RESOLVED_KEY``: the settings and the server settings they were
    resolved against."""
    return {"server": _fingerprint(server), "settings": dataclasses.asdict(params)}


def request_settings(server: EvictionConfig, extra_args: Mapping[str, Any] | None) -> RequestEviction:
    """A request's effective settings: the front end's resolved entry when it was made against ``server``
    (nothing parsed again), else ``resolve_request`` (a request the front end did not see, or another
    server's settings)."""
    entry = extra_args.get(RESOLVED_KEY) if extra_args else None
    if isinstance(entry, Mapping) and isinstance(entry.get("settings"), Mapping) and \
            entry.get("server") == _fingerprint(server):
        try:
            return RequestEviction(**entry["settings"])
        except TypeError:
            pass
    return resolve_request(server, extra_args)
