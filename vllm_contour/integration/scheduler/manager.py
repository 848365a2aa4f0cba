"""The evicting KV cache group's block tables, owned by a manager that vLLM's own registry picks.

vLLM chooses the manager of a KV cache group by its spec's type (``KVCacheSpecRegistry``): the plugin's
attention backends give their full-attention layers ``EvictingAttentionSpec`` (a ``FullAttentionSpec`` that
groups with full attention, ``customize_spec``) when eviction is on, and the registry hands that group
``EvictingAttentionManager``: vLLM's ``FullAttentionManager`` plus what a round does to a request's block
table — the slots it emptied become the null block and go back to the pool, private blocks take the slots
of hashed or shared originals, and the request's blocks are not hashed any more (their KV was computed over
a compressed cache; the manager skips them in ``cache_blocks``). The scheduler side asks the manager; it
writes nothing into vLLM's objects for this group.

The spec is registered through the registry's public entry point (``register_kv_cache_spec``) when this
module is imported — which happens only with eviction on, in every process that meets the spec (the
backend makes it, the engine core unpickles it) — after a lookup has made vLLM register its own specs (it
does so only into an empty registry). With eviction off no spec is changed, nothing is registered and vLLM's
own managers run. Where the registration or a hook the plugin needs is unavailable, ``evicting_spec``
refuses eviction at start-up, naming what and the vLLM version.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

# Written into vLLM's own managers of a hybrid model's other groups only (blocks.py; vllm_hooks says
# why): as many cached blocks as no request has, so vLLM hashes none of the request's blocks again.
NO_MORE_HASHING = 1 << 40

_REGISTRY = "vllm.v1.kv_cache_spec_registry:register_kv_cache_spec"


@dataclass(frozen=True, kw_only=True)
class EvictingAttentionSpec(FullAttentionSpec):
    """A full-attention layer whose requests' block tables eviction rounds rewrite."""


def evicting_spec(spec):
    """The spec a full-attention layer gets with eviction on (any other spec unchanged). Raises
    ``EvictionConfigError`` at start-up where the plugin cannot evict on this vLLM (``vllm_hooks.require``)."""
    if type(spec) is not FullAttentionSpec or spec.sliding_window:
        return spec
    from vllm_contour.integration import vllm_hooks

    vllm_hooks.require()
    return EvictingAttentionSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)})


class EvictingAttentionManager(FullAttentionManager):
    """``FullAttentionManager`` + a round's rewrite of one request's block table."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.not_hashed: set[str] = set()  # requests whose blocks vLLM no longer hashes (a round ran)

    def blocks(self, request_id: str) -> list:
        """The request's blocks in logical order (freed slots: the null block)."""
        return self.req_to_blocks.get(request_id, [])

    def rewrite(self, request_id: str, freed: tuple[tuple[int, int], ...],
                replaced: tuple[tuple[int, int, int], ...], private: dict[int, object]):
        """Apply a round: slots ``freed`` (``(slot, block id)``) become the null block, slots ``replaced``
        (``(slot, old id, new id)``) take the private block ``private[new id]``; every released block goes
        back to the pool. Returns the released blocks (those whose reference count reached 0 are free now),
        or None, changing nothing, when the report does not match the request's table (stale)."""
        blocks = self.blocks(request_id)
        if any(s >= len(blocks) or blocks[s].is_null or blocks[s].block_id != b for s, b in freed) or \
                any(s >= len(blocks) or blocks[s].block_id != old or new not in private for s, old, new in replaced):
            return None
        released = [blocks[s] for s, _ in freed] + [blocks[s] for s, _, _ in replaced]
        for s, _ in freed:
            blocks[s] = self._null_block
        for s, _, new in replaced:
            blocks[s] = private[new]
        self.block_pool.free_blocks(released)
        return released

    def stop_hashing(self, request_id: str) -> None:
        """vLLM hashes none of the request's blocks any more (until the request is freed)."""
        self.not_hashed.add(request_id)

    def cache_blocks(self, request, *args, **kwargs) -> None:
        if request.request_id in self.not_hashed:
            return
        super().cache_blocks(request, *args, **kwargs)

    def free(self, request_id: str, *args, **kwargs) -> None:
        self.not_hashed.discard(request_id)  # preempted: recomputed from its prompt, hashed again
        super().free(request_id, *args, **kwargs)


def register() -> bool:
    """Idempotent. vLLM registers its built-in specs only into an empty registry, so a lookup fills them
    first; then the plugin's spec goes in through ``register_kv_cache_spec``. False (and remembered in
    ``vllm_hooks.NOT_INSTALLED``, never raised) where that cannot be done."""
    import torch

    from vllm_contour.integration import vllm_hooks

    for symbol in (_REGISTRY, "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry.get_manager_class",
                   "vllm.v1.kv_cache_interface:FullAttentionSpec",
                   "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.cache_blocks",
                   "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.free"):
        if vllm_hooks.installable(symbol) is not None:
            vllm_hooks.not_installed(_REGISTRY, f"EvictingAttentionSpec not registered: {symbol} changed")
            return False
    try:
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry, register_kv_cache_spec

        probe = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
        builtin = KVCacheSpecRegistry.get_manager_class(probe)  # fills vLLM's own specs (an empty registry)
        if builtin is not FullAttentionManager:
            vllm_hooks.not_installed(_REGISTRY, f"EvictingAttentionSpec not registered: vLLM's registry gives "
                                                f"{getattr(builtin, '__name__', builtin)} for FullAttentionSpec, "
                                                "not FullAttentionManager")
            return False
        register_kv_cache_spec(manager_class=EvictingAttentionManager,
                               uniform_type_base_spec=FullAttentionSpec)(EvictingAttentionSpec)
        return True
    except Exception as e:  # never into vLLM: eviction is refused at start-up instead (evicting_spec)
        vllm_hooks.not_installed(_REGISTRY, f"EvictingAttentionSpec not registered ({type(e).__name__}: {e})")
        return False


register()
