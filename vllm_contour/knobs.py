"""Every eviction knob, declared once: its config field (= its ``additional_config["kv_eviction"]`` key),
CLI flag, per-request key (``vllm_xargs`` / ``SamplingParams.extra_args``), kind, default, minimum and help.

Generated from this table: ``EvictionConfig`` / ``RequestEviction`` (``config.py``: fields, defaults,
validation), the ``--kv-*`` flags and ``--help=KVEviction`` (``integration/frontend/engine_args.py``) and the README's
configuration table (:func:`readme_table`; a test keeps the README equal to it). Pure python: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ADDITIONAL_CONFIG_KEY = "kv_eviction"
DEFAULT_BUDGET = 128
# Tokens of dense tail a request may grow before the policy runs again (a multiple of the block size;
# 0 = evict once, when the prompt ends). Chosen by the sweep in the README (round cost <= 10 % of decode).
DEFAULT_DECODE_INTERVAL = 64

Kind = Literal["policy", "int", "bool", "json", "choice"]


@dataclass(frozen=True)
class Knob:
    """One setting. ``field`` is its name in ``EvictionConfig`` (when ``server``) and ``RequestEviction``
    (when ``request_key``), and its ``additional_config["kv_eviction"]`` key."""

    field: str
    kind: Kind  # policy: a preset name or none; int: >= minimum; bool; json: an object of policy knobs; choice
    help: str
    default: Any = None
    minimum: int = 0  # int knobs
    flag: str | None = None  # CLI flag (server knobs); None: per request only
    metavar: str | None = None
    request_key: str | None = None  # None: server only
    choices: tuple[str, ...] = ()
    default_doc: str | None = None  # what the default means, when the value alone does not say it
    allowed_when_off: bool = False  # may be given in additional_config with policy none

    @property
    def server(self) -> bool:
        return self.flag is not None

    @property
    def dest(self) -> str:
        """The flag's argparse dest."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def annotation(self) -> Any:
        base = {"policy": str, "int": int, "bool": bool, "json": dict[str, Any], "choice": str}[self.kind]
        return base | None if self.default is None else base

    def unset(self, value: Any) -> bool:
        """In ``additional_config``: a value that means "not given" (the default applies)."""
        if self.kind == "json":
            return not value
        return value is None and (self.default is None or self.kind == "bool")

    def default_text(self) -> str:
        if self.default_doc is not None:
            return self.default_doc
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return str(self.default)


KNOBS: tuple[Knob, ...] = (
    Knob("policy", "policy", "Eviction policy preset; 'none' = off (stock vLLM)", default="none",
         flag="--kv-eviction-policy", metavar="NAME", request_key="kv_policy", allowed_when_off=True),
    Knob("budget", "int", "Tokens kept per KV head per layer on average, moment pages included; rounded down to "
         "whole blocks, at least the per-head floor (sinks + recent window)", default=DEFAULT_BUDGET, minimum=1,
         flag="--kv-budget", metavar="TOKENS", request_key="kv_budget"),
    Knob("recent_window", "int", "Most recent prompt tokens every head keeps (recency floor)", default=32,
         flag="--kv-recent-window", metavar="W", request_key="kv_recent_window"),
    Knob("sink_tokens", "int", "First prompt tokens every head keeps (attention sinks)", default=4,
         flag="--kv-sink-tokens", metavar="S", request_key="kv_sink_tokens"),
    Knob("window", "int", "Last prompt queries that query-aware scorers look at (observation window)", default=32,
         minimum=1, flag="--kv-observation-window", metavar="W", request_key="kv_observation_window"),
    Knob("moment_correction", "bool", "MomentKV: keep per-head moments of the evicted tokens (their pages count "
         "against the budget) and add the evicted part's closed-form estimate at decode; works with every policy",
         flag="--kv-moment-correction", request_key="kv_moment_correction",
         default_doc="on for the moment presets, off otherwise"),
    Knob("decode_interval", "int", "Dense tail (tokens) a request grows before the policy runs again over its kept "
         "tokens plus the tail; a multiple of the block size, 0 = evict only when the prompt ends",
         flag="--kv-decode-interval", metavar="T", request_key="kv_decode_interval",
         default_doc=f"{DEFAULT_DECODE_INTERVAL}, rounded up to whole blocks"),
    Knob("context_len", "int", "Query-agnostic: the first C prompt tokens are context. The prefill stops at C, "
         "the context is compressed, and the rest of the prompt (the question) is computed over the compressed "
         "cache, never scored by that round; a C at or past the prompt end, or a context within the budget, "
         "changes nothing", minimum=1, request_key="kv_context_len", default_doc="none (no context boundary)"),
    Knob("policy_args", "json", "Knobs of the policy's components as a JSON object, e.g. '{\"lam\": 0.3}' "
         "(selector.lam, allocator.mix, allocator.power, scorer.kernel_size, ...; a bare name when unambiguous; "
         "unknown knobs are refused naming them); per request a JSON string", default={},
         flag="--kv-policy-args", metavar="JSON", request_key="kv_policy_args",
         default_doc="none (the components' own)"),
    Knob("agnostic_mode", "choice", "With kv_context_len: 'prefill' stops the prefill at the context boundary "
         "(kvpress's protocol); 'score_only' prefills the whole prompt over the full context and only the "
         "scoring ignores the question (the earlier behaviour, kept to measure the leak)", default="prefill",
         request_key="kv_agnostic_mode", choices=("prefill", "score_only")),
    Knob("share_contexts", "bool", "With prefix caching on: a request's compressed context (kv_context_len) is "
         "shared read-only by later requests with the same context and settings, which prefill only their own "
         "tokens", default=True, flag="--kv-share-contexts", allowed_when_off=True),
)

SERVER_KNOBS = tuple(k for k in KNOBS if k.server)
REQUEST_KNOBS = tuple(k for k in KNOBS if k.request_key is not None)
BY_REQUEST_KEY = {k.request_key: k for k in REQUEST_KNOBS}
BY_FLAG_DEST = {k.dest: k for k in SERVER_KNOBS}


def help_text(k: Knob) -> str:
    """A knob's help line with its default."""
    return f"{k.help}; default {k.default_text()}."


def add_arguments(group, more_help: dict[str, str] | None = None, check=None) -> None:
    """The ``--kv-*`` flags on an argparse group (``more_help``: field -> text appended to its help).
    ``check(knob, value)``: a flag's own value, validated as ``additional_config`` validates it (one set of
    messages), so that argparse refuses a bad one naming the flag; JSON knobs stay strings here (they are
    checked against the policy with the rest of the config)."""
    import argparse

    def typed(k):
        def parse(value: str):
            try:
                return check(k, value)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        parse.__name__ = k.dest  # argparse names the type in some messages
        return parse

    for k in SERVER_KNOBS:
        text = " ".join(filter(None, [help_text(k), (more_help or {}).get(k.field)])).replace("%", "%%")
        if k.kind == "bool":
            group.add_argument(k.flag, dest=k.dest, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            kind = typed(k) if check is not None and k.kind != "json" else str
            group.add_argument(k.flag, dest=k.dest, type=kind, default=None, metavar=k.metavar, help=text)


def readme_table() -> str:
    """The README's configuration table (between ``<!-- knobs -->`` and ``<!-- /knobs -->``)."""
    rows = ["| flag (`vllm serve`) | `additional_config[\"kv_eviction\"]` key | per request (`vllm_xargs` / "
            "`SamplingParams.extra_args`) | default | meaning |", "|---|---|---|---|---|"]
    for k in KNOBS:
        if k.flag is None:
            flag = "—"
        elif k.kind == "bool":
            flag = f"`--[no-]{k.flag[2:]}`"
        else:
            flag = f"`{k.flag} {k.metavar}`"
        key = f"`{k.field}`" if k.server else "—"
        req = f"`{k.request_key}`" if k.request_key else "—"
        rows.append(f"| {flag} | {key} | {req} | {k.default_text()} | {k.help} |")
    return "\n".join(rows)
