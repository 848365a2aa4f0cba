"""A request's part in shared compressed contexts (``shared_contexts.py`` holds the entries): adopting an
entry as its prefix-cache hit, planning the context round that publishes one (a snapshot block for a partial
last block), turning that round's result into an entry, and letting go of both when the request leaves,
starts over or copies on write. Failures surface as exceptions; the scheduler side decides what they cost
the request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_contour.integration.messages import Round
from vllm_contour.integration.scheduler.records import Publishing, Tracked
from vllm_contour.integration.scheduler.shared_contexts import Entry, SharedContexts

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request


class ContextPublisher:
    def __init__(self, shared: SharedContexts, block_size: int):
        self.shared = shared
        self.block_size = block_size
        self.pool: "BlockPool | None" = None
        self._adopt: dict[str, int] = {}  # request -> entry id, for the workers at its next scheduled step

    def bind(self, pool: "BlockPool") -> None:
        self.pool = pool

    def hit(self, request: "Request", t: Tracked) -> tuple[list, int] | None:
        """``(block table, C)`` of an entry with the request's first C tokens and settings, else None."""
        e = self.shared.hit(request, self.shared.key(request, t.params))
        return None if e is None else (list(e.table), e.context_len)

    def adopt(self, t: Tracked, e: Entry) -> None:
        """The request starts with the entry's compressed context: compacted up to E from its first step."""
        t.compacted, t.prefill_tried, t.region_blocks = True, True, e.region_blocks
        t.adopted = e.entry_id
        self._adopt[t.request.request_id] = e.entry_id

    def take_adoptions(self, scheduled: set[str] | dict, alive: set[str] | dict) -> dict[str, int]:
        """Adoptions of the requests scheduled this step (the workers set their layouts); others wait."""
        out = {r: eid for r, eid in self._adopt.items() if r in scheduled}
        self._adopt = {r: eid for r, eid in self._adopt.items() if r not in out and r in alive}
        return out

    def plan(self, t: Tracked, blocks, c: int) -> tuple[int, int | None, int | None] | None:
        """The context round of a request whose compressed context can be shared: ``(entry id, partial
        block id, snapshot block id)`` for the worker (block ids None when C is block-aligned); None when
        there is nothing to publish (already an entry, no key, no room for the snapshot)."""
        key = self.shared.key(t.request, t.params)
        if key is None or key in self.shared.entries:
            return None
        src = snap = None
        if c % self.block_size:
            if self.shared.pool_free_blocks() < 1:
                return None
            snap = self.pool.get_new_blocks(1)[0]
            src = blocks[c // self.block_size].block_id
        eid = self.shared.new_id()
        t.publishing = Publishing(t.seq, eid, key, snap)
        return (eid, src, None if snap is None else snap.block_id)

    def publish(self, t: Tracked, out: Round, blocks) -> bool:
        """The context round succeeded: its compacted region (+ the snapshot) becomes an entry. False when
        the outcome is not the round that was planned (the plan is released)."""
        p = t.publishing
        if p.seq != out.seq or out.published != p.entry_id or \
                out.region_blocks != t.params.context_len // self.block_size:
            self.release(t)
            return False
        t.publishing = None
        table = list(blocks[: out.region_blocks])
        self.pool.touch([b for b in table if not b.is_null])
        if p.snapshot is not None:
            table.append(p.snapshot)
        self.shared.add(p.entry_id, p.key, t.params.context_len, table)
        return True

    def release(self, t: Tracked) -> None:
        """A planned publication that will not happen: its snapshot block goes back, the workers forget it."""
        if t.publishing is None:
            return
        p, t.publishing = t.publishing, None
        if p.snapshot is not None:
            self.pool.free_blocks([p.snapshot])
        self.shared.dropped.append(p.entry_id)

    def leave(self, t: Tracked) -> None:
        """The request no longer holds its adopted entry's blocks (finished, started over, copied on write)."""
        if t.adopted is not None:
            self.shared.release_user(t.request.request_id)
            t.adopted = None

    def forget(self, req_id: str) -> None:
        self._adopt.pop(req_id, None)
