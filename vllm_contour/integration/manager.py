"""The evicting KV cache group's block tables, owned by a manager that vLLM's own registry picks.

vLLM 0.32 chooses the manager of a KV cache group by its spec's type (``KVCacheSpecRegistry``): the plugin's
attention backends give their full-attention layers ``EvictingAttentionSpec`` (a ``FullAttentionSpec`` that
groups with full attention, ``customize_spec``) when eviction is on, and the registry hands that group
``EvictingAttentionManager``: vLLM's ``FullAttentionManager`` plus what a round does to a request's block
table — the slots it emptied become the null block and go back to the pool, private blocks take the slots
of hashed or shared originals, and the request's blocks are not hashed any more (their KV was computed over
a compressed cache). The scheduler side asks the manager; it writes nothing into vLLM's objects for this
group. With eviction off no spec is changed and vLLM's own managers run.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

NO_MORE_HASHING = 1 << 40  # as many cached blocks as no request has: vLLM hashes none of its blocks again


@dataclass(frozen=True, kw_only=True)
class EvictingAttentionSpec(FullAttentionSpec):
    """A full-attention layer whose requests' block tables eviction rounds rewrite."""


def evicting_spec(spec):
    """The spec a full-attention layer gets with eviction on (any other spec unchanged)."""
    if type(spec) is not FullAttentionSpec or spec.sliding_window:
        return spec
    return EvictingAttentionSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)})


class EvictingAttentionManager(FullAttentionManager):
    """``FullAttentionManager`` + a round's rewrite of one request's block table."""

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
        """vLLM hashes none of the request's blocks any more."""
        self.num_cached_block[request_id] = NO_MORE_HASHING


def register() -> None:
    """Idempotent. vLLM registers its built-in specs only into an empty registry, so they go first."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(EvictingAttentionSpec, EvictingAttentionManager,
                                 uniform_type_base_spec=FullAttentionSpec)
