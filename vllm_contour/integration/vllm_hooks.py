"""Every place the plugin reaches into vLLM beyond its public plugin API, in one table, checked against the
installed vLLM (checked here against vLLM 0.32.0).

vLLM gives a plugin supported ways in for some of what eviction needs (``register_backend`` for the
attention backend, a KV connector, ``--scheduler-cls``) and none for the rest: CLI flags of its own, request
validation, a scheduler that fails or recomputes one request, and a few block-table operations. Those are
the hooks below. ``check()`` finds each symbol and compares its parameters with the ones recorded here; a
server started with ``--kv-eviction-policy`` on a vLLM where one changed refuses to start, naming the hook.
With no policy configured only the two front-end hooks (flags and request validation) are installed.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

CHECKED_AGAINST = "0.32.0"


@dataclass(frozen=True)
class Hook:
    symbol: str  # "module:Class.attr"
    params: tuple[str, ...] | None  # the parameters it had when checked (None: an attribute)
    how: str  # patched on the class / wrapped on the instance / overridden in a subclass / called / written
    why: str
    where: str  # the plugin module that uses it


HOOKS: tuple[Hook, ...] = (
    Hook("vllm.sampling_params:SamplingParams._verify_extra_args", ("self",), "patched on the class",
         "per-request kv_* keys validated where vLLM validates a request (HTTP 400 naming the key)",
         "integration/vllm_hooks.py"),
    Hook("vllm.engine.arg_utils:EngineArgs.add_cli_args", ("parser",), "patched on the class",
         "the --kv-* flags on vLLM's own parser (--help=KVEviction)", "integration/vllm_hooks.py"),
    Hook("vllm.engine.arg_utils:EngineArgs.from_cli_args", ("cls", "args"), "patched on the class",
         "the flags folded into additional_config", "integration/vllm_hooks.py"),
    Hook("vllm.engine.arg_utils:EngineArgs.create_engine_config", ("self", "usage_context", "headless"),
         "patched on the class", "eviction's settings wired (connector, scheduler class, block size, platform) "
         "and the budget checked against the model's cache", "integration/vllm_hooks.py"),
    Hook("vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", ("self",), "wrapped on the instance",
         "blocks only shared compressed contexts hold count as free", "integration/shared_contexts.py"),
    Hook("vllm.v1.core.block_pool:BlockPool.get_new_blocks", ("self", "num_blocks"), "wrapped on the instance",
         "shared compressed contexts are given back (LRU) when the pool runs short", "integration/shared_contexts.py"),
    Hook("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
         ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
          "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks", "num_encoder_tokens",
          "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs", "skip_zeroing_group_ids"),
         "wrapped on the instance", "KV computed over a shared compressed context is never hashed "
         "(delay_cache_blocks)", "integration/shared_contexts.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler._reserve_prefill_lookahead",
         ("self", "request", "num_computed_tokens", "num_new_tokens"), "overridden in a subclass",
         "a prefill chunk stops at the context boundary", "integration/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler._get_local_prefix_cache_hit", ("self", "request"),
         "overridden in a subclass", "a prefix hit is cut where a round needs its window computed; a shared "
         "compressed context is handed out as the hit", "integration/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
         ("self", "scheduler_output", "model_runner_output"), "overridden in a subclass",
         "a request whose attention failed finishes alone with an error; one whose round failed after bytes "
         "moved is recomputed", "integration/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler.schedule", ("self", "throttle_prefills"),
         "overridden in a subclass", "the step's shared-context pins are settled after scheduling",
         "integration/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler.reset_prefix_cache",
         ("self", "reset_running_requests", "reset_connector"), "overridden in a subclass",
         "reset_prefix_cache drops the shared compressed contexts too", "integration/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler._preempt_request", ("self", "request", "timestamp",
                                                                     "drop_stale_output"), "called",
         "recompute a request without eviction", "integration/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler.finish_requests", ("self", "request_ids", "finished_status"),
         "called", "finish one request with FINISHED_ERROR", "integration/scheduler.py"),
    Hook("vllm.v1.core.kv_cache_manager:KVCacheManager.truncate_computed_blocks",
         ("self", "blocks", "num_computed_tokens"), "called", "cut a prefix hit", "integration/scheduler.py"),
    Hook("vllm.v1.core.kv_cache_manager:KVCacheManager.create_kv_cache_blocks", ("self", "blocks"), "called",
         "a shared compressed context as a prefix hit", "integration/scheduler.py"),
    Hook("vllm.v1.core.block_pool:BlockPool.free_blocks", ("self", "ordered_blocks"), "called",
         "blocks a round emptied go back to the pool", "integration/request_blocks.py"),
    Hook("vllm.v1.core.block_pool:BlockPool.touch", ("self", "blocks"), "called",
         "a published compressed context holds its own reference on its blocks",
         "integration/context_publisher.py"),
    Hook("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.req_to_blocks", None,
         "read (other groups)", "the KV-held metrics of a hybrid model count its sliding-window groups' blocks "
         "(the evicting group's table is the plugin's own manager's)", "integration/request_blocks.py"),
    Hook("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.num_cached_block", None,
         "written (other groups)", "a hybrid model's sliding-window groups stop hashing a compacted request "
         "too (their KV was computed over the compressed layers)", "integration/request_blocks.py"),
    Hook("vllm.v1.request:Request.__init__",
         ("self", "request_id", "prompt_token_ids", "sampling_params", "pooling_params", "client_index",
          "arrival_time", "prompt_embeds", "prompt_is_token_ids", "mm_features", "lora_request", "cache_salt",
          "priority", "trace_headers", "block_hasher", "resumable", "session_id", "reasoning_ended",
          "reasoning_parser_kwargs", "abort_immediately", "kv_hints"), "called",
         "the hidden requests that reconstruct a context (KVzip)", "integration/reconstruction.py"),
    Hook("vllm.v1.request:Request._block_hasher", None, "read",
         "a hidden reconstruction request hashes its blocks as its owner does (its context is a prefix hit)",
         "integration/reconstruction.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler.add_request", ("self", "request"), "called",
         "hidden reconstruction requests join the waiting queue between steps", "integration/scheduler.py"),
    Hook("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.__init__",
         ("self", "kv_cache_spec", "block_pool", "enable_caching", "kv_cache_group_id", "scheduler_block_size",
          "dcp_world_size", "pcp_world_size", "needs_kv_cache_zeroing", "max_admission_blocks_per_request"),
         "subclassed", "EvictingAttentionManager: the evicting group's block tables (chosen by vLLM's registry)",
         "integration/manager.py"),
    Hook("vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry._ensure_registered", ("cls", "vllm_config"),
         "called", "vLLM registers its built-in specs only into an empty registry: first, then the plugin's",
         "integration/manager.py"),
)


def _resolve(symbol: str):
    mod, _, path = symbol.partition(":")
    owner = importlib.import_module(mod)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name


def check(hooks: tuple[Hook, ...] = HOOKS) -> list[str]:
    """Problems with the installed vLLM, one line per hook that is missing or changed (empty: all fine)."""
    problems = []
    for h in hooks:
        try:
            owner, name = _resolve(h.symbol)
            if h.params is None:  # an instance attribute: set in the class's __init__
                src = inspect.getsource(owner.__init__)
                if f"self.{name}" not in src:
                    problems.append(f"{h.symbol}: attribute no longer set in {owner.__name__}.__init__")
                continue
            fn = inspect.getattr_static(owner, name)
            fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
            got = tuple(inspect.signature(getattr(fn, "__contour_original__", fn)).parameters)
            if got != h.params:
                problems.append(f"{h.symbol}: parameters {got}, the plugin was written for {h.params}")
        except Exception as e:  # missing module, class or attribute
            problems.append(f"{h.symbol}: {type(e).__name__}: {e}")
    return problems


def require() -> None:
    """At start-up with eviction on: refuse a vLLM whose hooked symbols changed, naming them."""
    problems = check()
    if problems:
        from vllm_contour.config import EvictionConfigError

        raise EvictionConfigError(
            f"--kv-eviction-policy: this vLLM differs from {CHECKED_AGAINST} (which vllm-contour was checked "
            "against) where the plugin hooks in: " + "; ".join(problems))


def hook(symbol: str) -> Hook:
    """The declared hook (every patch and wrap names the one it installs)."""
    for h in HOOKS:
        if h.symbol == symbol:
            return h
    raise KeyError(f"{symbol} is not a declared hook of vllm_hooks.HOOKS")


def patch_class(symbol: str, make) -> None:
    """Replace a class attribute with ``make(original)`` once (idempotent across plugin loads)."""
    hook(symbol)
    owner, name = _resolve(symbol)
    raw = inspect.getattr_static(owner, name)
    if getattr(raw, "__contour_original__", None) is not None or getattr(
            getattr(raw, "__func__", None), "__contour_original__", None) is not None:
        return
    original = getattr(owner, name)
    new = make(original)
    target = new.__func__ if isinstance(new, (classmethod, staticmethod)) else new
    target.__contour_original__ = getattr(original, "__func__", original)
    setattr(owner, name, new)


def wrap_instance(obj, symbol: str, make) -> None:
    """Replace a method on one vLLM object with ``make(bound original)``."""
    hook(symbol)
    name = symbol.rsplit(".", 1)[1]
    setattr(obj, name, make(getattr(obj, name)))
