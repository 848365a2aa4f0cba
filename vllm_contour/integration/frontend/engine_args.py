"""``--kv-eviction-policy`` and friends on vLLM's own argument parser, folded into
``additional_config["kv_eviction"]``; when eviction is on, the settings it needs are wired here.

vLLM has no API for a general plugin to add CLI flags. The plugin wraps three EngineArgs methods:
``add_cli_args`` (adds the flag group; ``AsyncEngineArgs.add_cli_args`` loads plugins right before it
calls this), ``from_cli_args`` (folds the flags into ``additional_config``) and ``create_engine_config``
(validates, then sets the KV connector and the plugin's scheduler class and picks a small block size;
prefix caching stays as vLLM sets it, on by default; once vLLM has built the config, checks the budget
against the model's cache: a budget below the per-head floor stops the server with a message naming the
floor and its flags).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_contour.config import ADDITIONAL_CONFIG_KEY, EvictionConfig, EvictionConfigError
from vllm_contour.knobs import BY_FLAG_DEST, add_arguments

if TYPE_CHECKING:
    from vllm_contour.budget import CacheShape

CONNECTOR_NAME = "ContourKVConnector"
CONNECTOR_MODULE = "vllm_contour.integration.connector"
SCHEDULER_CLS = "vllm_contour.integration.scheduler.scheduler.ContourScheduler"
DEFAULT_EVICTION_BLOCK_SIZE = 32

@dataclass
class ServerSettings:
    """The server's eviction settings as this process learned them while vLLM built its config (the API
    server, an offline LLM's process): what per-request keys are validated against (``plugin.py``). One per
    process, written by ``create_engine_config`` only."""

    config: EvictionConfig | None = None  # None: a process that has not built a vLLM config
    shape: "CacheShape | None" = None  # the KV cache of one rank, once vLLM resolved the model


SERVER = ServerSettings()


def add_eviction_args(parser):
    """The ``KVEviction`` flag group (``--help=KVEviction``), generated from ``knobs.KNOBS``."""
    from vllm_contour.policies import policy_help

    if any(getattr(a, "dest", None) == "kv_eviction_policy" for a in parser._actions):
        return parser
    group = parser.add_argument_group(
        title="KVEviction",
        description="Per-head KV-cache eviction after prefill; freed blocks go back to vLLM's pool. "
                    "Same keys as --additional-config '{\"kv_eviction\": {...}}'.")
    policies = "; ".join(f"{k}: {v}" for k, v in policy_help().items())
    add_arguments(group, {"policy": f"Policies: {policies}."}, check=_check_flag)
    return parser


def _check_flag(knob, value: str):
    """A ``--kv-*`` flag's value, as ``additional_config`` would take it: errors name the value's meaning
    (argparse puts the flag in front)."""
    from vllm_contour.config import check_value

    return check_value(knob, "value", value)


def fold_cli_args(args: argparse.Namespace, additional_config) -> dict | None:
    """Merge the flags into a copy of additional_config. Conflicts with values given through
    --additional-config are refused."""
    given = {k.field: (k.flag, getattr(args, dest)) for dest, k in BY_FLAG_DEST.items()
             if getattr(args, dest, None) is not None}
    if not given:
        return additional_config
    ac = copy.deepcopy(dict(additional_config or {}))
    existing = ac.get(ADDITIONAL_CONFIG_KEY) or {}
    if not isinstance(existing, dict):
        raise EvictionConfigError(f"{ADDITIONAL_CONFIG_KEY} must be a JSON object")
    merged = dict(existing)
    for field, (flag, value) in given.items():
        if field in existing and str(existing[field]).lower() != str(value).lower():
            raise EvictionConfigError(
                f"{flag} {value} contradicts --additional-config {ADDITIONAL_CONFIG_KEY}.{field}="
                f"{json.dumps(existing[field])}; give it once")
        merged[field] = value
    ac[ADDITIONAL_CONFIG_KEY] = merged
    return ac


def prepare_engine_args(engine_args) -> EvictionConfig:
    """Validate the eviction config and wire what it needs into the EngineArgs (in place)."""
    from vllm.logger import init_logger

    logger = init_logger("vllm.contour")
    cfg = EvictionConfig.from_additional_config(engine_args.additional_config)
    if cfg.enabled:
        # Normalise (e.g. "128" -> 128) so every process sees the same validated values.
        ac = dict(engine_args.additional_config)
        ac[ADDITIONAL_CONFIG_KEY] = cfg.to_dict()
        engine_args.additional_config = ac
        from vllm.platforms import current_platform

        from vllm_contour.integration import vllm_hooks
        from vllm_contour.integration.frontend.platforms import platform_of

        from vllm_contour.policies import build_policy

        # a vLLM that changed where the plugin hooks in is refused, naming the hook; a feature's hooks (KVzip's
        # hidden requests) only when the server's policy uses it (a request asking for it later checks them)
        features = frozenset({"reconstruction"}) if build_policy(cfg.policy).needs_reconstruction else frozenset()
        vllm_hooks.require(features)
        platform = platform_of(current_platform.device_type)
        platform.prepare(engine_args)
        platform.check_kv_cache_dtype(getattr(engine_args, "kv_cache_dtype", "auto"))
        ktc = engine_args.kv_transfer_config
        if ktc is None:
            from vllm.config import KVTransferConfig

            engine_args.kv_transfer_config = KVTransferConfig(
                kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both")
        else:
            name = ktc.get("kv_connector") if isinstance(ktc, dict) else ktc.kv_connector
            if name != CONNECTOR_NAME:
                raise EvictionConfigError(
                    f"--kv-transfer-config: KV connector {name!r} cannot be combined with "
                    "--kv-eviction-policy (the eviction plugin installs its own connector)")
        if engine_args.block_size is None:
            engine_args.block_size = DEFAULT_EVICTION_BLOCK_SIZE
            logger.info("kv_eviction: block size %d (budgets are handed out in whole pages)",
                        DEFAULT_EVICTION_BLOCK_SIZE)
        if engine_args.speculative_config:
            _check_speculative(engine_args.speculative_config)
        offload = getattr(engine_args, "kv_offloading_size", None)
        if offload:  # vLLM would put its offloading connector (--kv-offloading-backend) in the plugin's slot
            raise EvictionConfigError(
                f"--kv-offloading-size {offload} cannot be combined with --kv-eviction-policy: CPU offloading of "
                "the KV cache takes vLLM's KV connector slot, which eviction needs; drop one of them")
        if engine_args.scheduler_cls not in (None, SCHEDULER_CLS):
            raise EvictionConfigError(
                f"--scheduler-cls {engine_args.scheduler_cls!r} cannot be combined with --kv-eviction-policy: "
                f"eviction needs its own scheduler class ({SCHEDULER_CLS}); drop --scheduler-cls")
        engine_args.scheduler_cls = SCHEDULER_CLS
        logger.info("kv_eviction: %s", cfg.to_dict())
    SERVER.config = cfg
    return cfg


def _check_speculative(spec) -> None:
    """n-gram speculative decoding works with eviction (its drafts are extra query tokens of the target
    model, served as multi-token steps; a round only ever covers verified tokens). A draft model or EAGLE
    keeps a KV cache of its own that the plugin does not evict, so those are refused."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            raise EvictionConfigError(f"--speculative-config: not JSON: {spec!r}") from None
    method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
    if method != "ngram":
        raise EvictionConfigError(
            f"--speculative-config: method {method!r} cannot be combined with --kv-eviction-policy (only "
            "'ngram' can: a draft model or EAGLE keeps its own KV cache, which the plugin does not evict)")


def cache_shape_of(vllm_config):
    """Per-rank KV cache shape from vLLM's config (what the workers' caches will be; an fp8 cache's elements are
    bytes, so budgets in tokens cost half of bf16's bytes and moment pages twice the tokens)."""
    import torch

    from vllm_contour.budget import CacheShape

    from vllm_contour.integration.frontend.platforms import FP8, UNQUANTISED

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    named = UNQUANTISED.get(str(cc.cache_dtype))
    dtype = mc.dtype if cc.cache_dtype in (None, "auto") or named == str(mc.dtype).replace("torch.", "") else None
    if str(cc.cache_dtype) in FP8:  # vLLM stores them as uint8 (the platform's check accepted them)
        dtype = torch.uint8
    if dtype is None:
        raise EvictionConfigError(f"--kv-cache-dtype {cc.cache_dtype} cannot be combined with "
                                  f"--kv-eviction-policy yet (use auto, or the model's dtype {mc.dtype})")
    return CacheShape.of(block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
                         head_dim=mc.get_head_size(), dtype=dtype)


def check_against_cache(cfg: EvictionConfig, vllm_config) -> None:
    """At start-up: the server's budget and decode interval must fit the model's cache (floor, block
    size); remembered so that per-request values are checked the same way (HTTP 400)."""
    from vllm_contour.budget import request_budget
    from vllm_contour.config import resolve_request

    mc = vllm_config.model_config
    if getattr(mc, "use_mla", False):
        raise EvictionConfigError(
            f"--kv-eviction-policy cannot be used with {mc.model}: it uses multi-head latent attention (MLA), "
            "whose compressed KV cache has no per-head pages to evict")
    shape = cache_shape_of(vllm_config)
    request_budget(resolve_request(cfg, None), shape, per_request=False)
    SERVER.shape = shape


# EngineArgs made from a command line (``from_cli_args``): their refusals end the process with one line
# naming the flag, as vLLM's own argument errors do; an offline ``LLM(...)`` gets the exception.
_FROM_CLI: set[int] = set()  # ids, each dropped when its EngineArgs goes


def _mark_cli(engine_args) -> None:
    _FROM_CLI.add(id(engine_args))
    weakref.finalize(engine_args, _FROM_CLI.discard, id(engine_args))


@contextlib.contextmanager
def _one_line(cli: bool = True):
    try:
        yield
    except EvictionConfigError as e:
        if not cli:
            raise
        sys.stderr.write(f"vllm: error: {e}\n")
        raise SystemExit(2) from None


def patch_engine_args() -> None:
    """The three EngineArgs hooks (``vllm_hooks``): flags on vLLM's parser, folded into additional_config,
    eviction's settings wired when the engine config is built."""
    from vllm_contour.integration import vllm_hooks

    def make_add(orig):
        def add_cli_args(parser):
            return add_eviction_args(orig(parser))

        return staticmethod(add_cli_args)

    def make_from(orig):
        def from_cli_args(cls, args):
            engine_args = orig.__func__(cls, args)
            with _one_line():
                engine_args.additional_config = fold_cli_args(args, engine_args.additional_config)
                prepare_engine_args(engine_args)  # refuse conflicting flags now, before vLLM starts anything
            _mark_cli(engine_args)
            return engine_args

        return classmethod(from_cli_args)

    def make_create(orig):
        def create_engine_config(self, *a, **kw):
            with _one_line(id(self) in _FROM_CLI):
                cfg = prepare_engine_args(self)
                vllm_config = orig(self, *a, **kw)
                if cfg.enabled:
                    check_against_cache(cfg, vllm_config)
            return vllm_config

        return create_engine_config

    vllm_hooks.patch_class("vllm.engine.arg_utils:EngineArgs.add_cli_args", make_add)
    vllm_hooks.patch_class("vllm.engine.arg_utils:EngineArgs.from_cli_args", make_from)
    vllm_hooks.patch_class("vllm.engine.arg_utils:EngineArgs.create_engine_config", make_create)
