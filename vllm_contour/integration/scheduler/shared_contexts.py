"""Compressed contexts shared between requests (the scheduler room's cache of them).

With prefix caching on and a context boundary ``C`` (``kv_context_len``, query-agnostic ``prefill`` mode), the
round that compresses a request's context ``[0, C)`` packs the kept head-pages into private blocks (the
dense ones are hashed for prefix caching). When that round succeeds its result becomes an *entry*:

- the request's block table up to the compacted region ``E = C // block_size`` (the ``K`` blocks of kept
  pages and moments, the null blocks the round put in), plus, when ``C`` is not block-aligned, a private
  snapshot of the block holding tokens ``[E * bs, C)``, which the worker copies right after the round (before
  any question token is written into it);
- keyed by vLLM's block-hash chain of the first ``E`` blocks (it covers the tokens, the LoRA and
  ``cache_salt`` of vLLM's prefix caching), the ``C - E * bs`` tokens after them, every eviction setting of
  the request, the LoRA and ``cache_salt`` again and the model: settings that differ never share;
- the worker keeps the round's layout under the entry's id.

A later request with the same key gets the entry's block table and ``C`` tokens as its local prefix-cache hit
(``hit``): vLLM touches the blocks (reference-counted, read-only), its partial-hit copy-on-write gives the
request a private copy of the snapshot block, the worker gives it the entry's layout, and it prefills only
its own tokens from ``C`` on over the compressed context with the ragged op, as the first request did. The
blocks of a request that adopted an entry are never hashed (they hold KV computed over a compressed cache);
compressed blocks never carry vLLM's token hashes.

Decode-time rounds copy on write: a round over a block another request or an entry holds packs into private
blocks (the scheduler side's existing path for shared blocks), because a decode round re-selects over the
context and the generated tokens together under the request's one budget, exactly as on an engine that
shares nothing (so outputs equal a fresh engine's). The shared pages stay shared until a request's first
decode round (``T`` tokens after its prompt), for the whole request when ``T = 0``.

Eviction, like vLLM's own cache: an entry holds one reference on each of its blocks; blocks that only an
entry holds count as free in vLLM's pool, and the pool takes them back, least recently used entry first,
when it runs out (``get_new_blocks``). ``reset_prefix_cache`` drops every entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

    from vllm_contour.config import RequestEviction

MAX_ENTRIES = 64


@dataclass
class Entry:
    entry_id: int
    key: bytes
    context_len: int  # C
    region_blocks: int  # E
    table: list  # KVCacheBlock objects: logical blocks [0, E) (+ the snapshot of the partial block)
    users: set[str] = field(default_factory=set)  # requests that adopted it (still holding its blocks)
    pins: int = 0  # hits handed out in this scheduling step, not yet allocated

    @property
    def blocks(self) -> list:
        return [b for b in self.table if not b.is_null]


class SharedContexts:
    def __init__(self, block_size: int, model_id: str = ""):
        self.block_size = block_size
        self.model_id = model_id
        self.manager: "KVCacheManager | None" = None
        self.entries: "OrderedDict[bytes, Entry]" = OrderedDict()  # LRU order: oldest first
        self.by_id: dict[int, Entry] = {}
        self.pending: dict[str, Entry] = {}  # request -> entry handed out as its hit this step
        self.dropped: list[int] = []  # entry ids the workers must forget
        self._next_id = 1

    # ------------------------------------------------------------------ vLLM's pool
    def bind(self, manager: "KVCacheManager") -> None:
        """Count blocks only entries hold as free, give them back when the pool runs out, and keep the blocks
        of requests that adopt an entry out of vLLM's prefix-cache hashing."""
        from vllm_contour.integration import vllm_hooks

        self.manager = manager
        pool = manager.block_pool
        self._free0 = pool.get_num_free_blocks

        def free_blocks(free0):
            return lambda: free0() + self.reclaimable()

        def new_blocks(new0):
            def get_new_blocks(num_blocks: int):
                short = num_blocks - self._free0()
                if short > 0:
                    self.reclaim(short)
                return new0(num_blocks)

            return get_new_blocks

        def allocate(alloc0):
            def allocate_slots(request, *args, **kwargs):
                if request.request_id in self.pending:
                    kwargs["delay_cache_blocks"] = True  # never hash KV computed over a compressed context
                return alloc0(request, *args, **kwargs)

            return allocate_slots

        vllm_hooks.wrap_instance(pool, "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", free_blocks)
        vllm_hooks.wrap_instance(pool, "vllm.v1.core.block_pool:BlockPool.get_new_blocks", new_blocks)
        vllm_hooks.wrap_instance(manager, "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", allocate)

    def pool_free_blocks(self) -> int:
        """vLLM's own count of blocks in its free queue (entries' blocks not included)."""
        return self._free0()

    def reclaimable(self) -> int:
        return sum(sum(1 for b in e.blocks if b.ref_cnt == 1) for e in self.entries.values() if not e.pins)

    def reclaim(self, num_blocks: int) -> None:
        for e in list(self.entries.values()):
            if num_blocks <= 0:
                break
            if e.pins:
                continue
            num_blocks -= sum(1 for b in e.blocks if b.ref_cnt == 1)
            self.drop(e)

    # ------------------------------------------------------------------ keys
    def key(self, request: "Request", params: "RequestEviction") -> bytes | None:
        c = params.context_len
        e = (c or 0) // self.block_size
        if self.manager is None or not self.manager.block_pool.enable_caching or not c or e == 0 or \
                len(request.block_hashes) < e or request.num_prompt_tokens <= c:
            return None
        lora = getattr(request, "lora_request", None)
        parts = [bytes(request.block_hashes[e - 1]).hex(), list(request.prompt_token_ids[e * self.block_size: c]),
                 json.dumps(dataclasses.asdict(params), sort_keys=True, default=str),
                 getattr(lora, "lora_name", None), getattr(lora, "lora_int_id", None),
                 getattr(request, "cache_salt", None), self.model_id, self.block_size]
        return hashlib.sha256(json.dumps(parts, default=str).encode()).digest()

    # ------------------------------------------------------------------ entries
    def hit(self, request: "Request", key: bytes | None) -> Entry | None:
        """The entry a new request may adopt as its prefix-cache hit (pinned until it is allocated or the
        scheduling step ends)."""
        e = self.entries.get(key) if key is not None else None
        if e is None:
            return None
        e.pins += 1
        self.pending[request.request_id] = e
        return e

    def adopted(self, request: "Request") -> Entry | None:
        """Called once the request's blocks were allocated: it holds the entry's blocks now."""
        e = self.pending.pop(request.request_id, None)
        if e is None:
            return None
        e.pins -= 1
        e.users.add(request.request_id)
        self.entries.move_to_end(e.key)
        return e

    def end_schedule(self) -> None:
        for e in self.pending.values():
            e.pins -= 1
        self.pending.clear()

    def release_user(self, req_id: str) -> None:
        for e in self.entries.values():
            e.users.discard(req_id)

    def new_id(self) -> int:
        i, self._next_id = self._next_id, self._next_id + 1
        return i

    def add(self, entry_id: int, key: bytes, context_len: int, table: list) -> Entry:
        """Register an entry over ``table``, whose non-null blocks the caller has given one reference for
        the entry (it is released when the entry is dropped)."""
        old = self.entries.get(key)
        if old is not None:
            self.drop(old)
        e = Entry(entry_id, key, context_len, context_len // self.block_size, list(table))
        self.entries[key] = e
        self.by_id[entry_id] = e
        while len(self.entries) > MAX_ENTRIES:
            self.drop(next(iter(self.entries.values())))
        return e

    def drop(self, e: Entry) -> None:
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
        self.by_id.pop(e.entry_id, None)
        self.dropped.append(e.entry_id)
        blocks, e.table = e.blocks, []
        if blocks:
            self.manager.block_pool.free_blocks(blocks)

    def drop_all(self) -> None:
        for e in list(self.entries.values()):
            self.drop(e)

    def take_dropped(self) -> list[int]:
        out, self.dropped = self.dropped, []
        return out

    # ------------------------------------------------------------------ accounting
    def entry_block_ids(self) -> set[int]:
        return {b.block_id for e in self.entries.values() for b in e.blocks}

    def gauges(self) -> dict[str, int]:
        return {"shared_context_entries": len(self.entries),
                "shared_context_blocks": sum(len(e.blocks) for e in self.entries.values()),
                "shared_context_requests": sum(len(e.users) for e in self.entries.values())}
