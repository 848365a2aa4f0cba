"""A request's blocks in vLLM's pool, as the scheduler side sees them: the evicting group's table (its
manager, ``manager.py``, owns every write), what a request holds (a block n requests hold counts 1/n, its
window queries' blocks included), whether a round may rewrite its blocks in place, the private blocks a
round over shared blocks packs into, the blocks that hold a round's window queries, and the stop of hashing
once a round has run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_contour.integration.scheduler.manager import NO_MORE_HASHING
from vllm_contour.integration.scheduler.records import PrivateBlocks, QueryPages, Tracked

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager


class RequestBlocks:
    def __init__(self, block_size: int, group: int = 0, num_groups: int = 1):
        self.block_size = block_size
        self.group = group  # vLLM's KV cache group eviction works on (the full-attention one)
        self.num_groups = num_groups  # > 1: a hybrid model (its sliding-window groups are vLLM's own)
        self.manager: "KVCacheManager | None" = None
        self.evicting = None
        self.entry_ids: set[int] = set()  # blocks the shared compressed contexts hold (this step)

    def bind(self, kv_cache_manager: "KVCacheManager") -> None:
        from vllm_contour.integration.scheduler.manager import EvictingAttentionManager

        mgr = kv_cache_manager.coordinator.single_type_managers[self.group]
        if not isinstance(mgr, EvictingAttentionManager):
            raise ValueError(f"kv_eviction: the evicting KV cache group is managed by {type(mgr).__name__}, not "
                             "the plugin's EvictingAttentionManager (is another attention backend in use?)")
        self.manager, self.evicting = kv_cache_manager, mgr

    @property
    def caching(self) -> bool:
        return bool(self.manager is not None and self.manager.block_pool.enable_caching)

    def of(self, req_id: str):
        """The request's block list in the evicting group (vLLM's KVCacheBlock objects, null blocks in)."""
        return self.evicting.blocks(req_id)

    def held(self, blocks) -> float:
        """Blocks the request holds in vLLM's pool, a block that n requests hold counting 1/n (a shared
        compressed context's blocks are paid once over the requests on it; its entry's own reference is not
        a request's)."""
        if not self.caching:
            return float(sum(1 for b in blocks if not b.is_null))
        held = 0.0
        for b in blocks:
            if not b.is_null:
                held += 1.0 / max(1, b.ref_cnt - (1 if b.block_id in self.entry_ids else 0))
        return held

    def sample(self, t: Tracked, blocks) -> None:
        """One step's KV held, for the mean / peak metrics: per head over all layers (a hybrid model's other
        groups' blocks averaged in) and in the evicting layers."""
        q = len(t.queries.blocks) if t.queries is not None else 0
        evicting = held = self.held(blocks) + q
        if self.num_groups > 1:
            mgrs = self.manager.coordinator.single_type_managers
            held = (held + sum(self.held(m.req_to_blocks.get(t.request.request_id, []))
                               for i, m in enumerate(mgrs) if i != self.group)) / self.num_groups
        t.held.sample(held * self.block_size, evicting * self.block_size,
                      sum(1 for b in blocks if not b.is_null) + q)

    def shared(self, blocks, num_tokens: int) -> bool:
        """Does any full block a round may rewrite carry a prefix-cache hash or another reference?"""
        return any(not b.is_null and (b.block_hash is not None or b.ref_cnt > 1)
                   for b in blocks[: num_tokens // self.block_size])

    def take_private(self, n: int) -> list | None:
        """``n`` blocks from vLLM's pool for a round over shared blocks; None when the pool has no room now."""
        pool = self.manager.block_pool
        return pool.get_new_blocks(n) if pool.get_num_free_blocks() >= n else None

    def release_private(self, t: Tracked, keep: set[int] = frozenset()) -> None:
        """Give back the private blocks of the round in flight (all but ``keep``, block ids)."""
        if t.fresh is None:
            return
        fresh, t.fresh = t.fresh, None
        back = [b for b in fresh.blocks if b.block_id not in keep]
        if back:
            self.manager.block_pool.free_blocks(back)

    def private_of(self, t: Tracked, seq: int) -> list:
        return t.fresh.blocks if t.fresh is not None and t.fresh.seq == seq else []

    def keep_private(self, t: Tracked, seq: int, blocks: list) -> None:
        t.fresh = PrivateBlocks(seq, blocks)

    def query_pages(self, t: Tracked, round_at: int, start: int, n: int) -> QueryPages | None:
        """The blocks holding the window queries of the request's round at ``round_at``: those it holds, or
        ``n`` new ones from vLLM's pool (None when it has no room now)."""
        if t.queries is not None and t.queries.round_at == round_at:
            return t.queries
        self.release_queries(t)
        got = self.take_private(n)
        if got is None:
            return None
        t.queries = QueryPages(round_at, start, got)
        return t.queries

    def release_queries(self, t: Tracked) -> None:
        """Its round ran (or the request left or starts over): the window queries' blocks go back."""
        if t.queries is not None:
            q, t.queries = t.queries, None
            self.manager.block_pool.free_blocks(q.blocks)

    def stop_hashing(self, req_id: str) -> None:
        """Every group (a hybrid model's sliding-window layers too: their KV after the round was computed
        over the compressed full-attention layers); those are vLLM's own managers (``vllm_hooks``)."""
        for mgr in self.manager.coordinator.single_type_managers:
            if mgr is self.evicting:
                mgr.stop_hashing(req_id)
            else:
                mgr.num_cached_block[req_id] = NO_MORE_HASHING

    def used(self) -> int:
        """Blocks out of vLLM's free queue (the null block left out): vLLM's own count."""
        pool = self.manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks
