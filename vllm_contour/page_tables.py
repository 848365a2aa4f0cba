"""Compacted requests' page tables kept as state, and the rows of one engine step that read them.

A compacted request's attention list for KV head (l, h) is its kept run (``RequestLayout.page_ids``, whole
pages) followed by its dense tail: the request's own blocks from ``E`` on, which vLLM's block table already
lists. So the only per-request state the kernels need changes when a round runs (or a request adopts a
shared context): ``PageTables`` keeps it in one slot per request, as tensors on the cache's device. Each
step, ``PageTables.step`` finds which batch rows are compacted requests (by the block that receives the
row's first new token, the key the scheduler sends; see ``integration/messages.py``) and which tokens fall in
an observation window to capture, with tensor ops only: no ``.tolist()`` of batch tensors, no loop over
rows or tokens, nothing that waits for the device. The Triton kernel reads the two-part lists directly;
CPU kernels take per-token tables, which ``StepRows.tables`` expands once per step.

Where vLLM builds a step's attention metadata before the KV connector sees the step (Model Runner V2),
``predict`` finds the compacted rows without the scheduler's keys, so vLLM's kernel still gets a short
context for them: a compacted request's next step starts at the position after its last computed token,
and the block that holds that token sits in its row of the block table (``expect``, kept per slot and
moved on by every step the request runs). A new request cannot match: that block held the compacted
request's tokens, not an earlier token of the new one. Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CaptureWindows:
    """This step's observation-window captures: capture ``c`` takes positions ``[start[c], end[c])`` of the
    row whose key block maps to ``c``, staged at ``offset[c] + position - start[c]`` (``total`` rows)."""

    owners: list[tuple[str, int, int]]  # (req_id, first position, count) per capture, staging order
    total: int
    dst: torch.Tensor  # [T] int64 staging row of every token of the step (``total``: not captured)


@dataclass
class StepRows:
    """The compacted rows of one step, with this step's compacted requests' tables gathered in step order
    (``req_ids[i]`` is step index i). ``token_req[t]`` is the step index of token t's request (-1: an
    ordinary row), ``token_pos[t]`` its position (its list ends at ``token_pos + 1``: causal among a row's
    tokens)."""

    req_ids: list[str]
    run_pages: torch.Tensor  # [n, L, H, P] int32
    run_count: torch.Tensor  # [n, L, H] int32 (pages)
    region: torch.Tensor  # [n] int32
    moment_pages: torch.Tensor  # [n, L, M] int32
    has_moments: torch.Tensor  # [n] bool
    row_req: torch.Tensor  # [B] int32
    q_lens: torch.Tensor  # [B] int32
    token_req: torch.Tensor  # [T] int32
    token_row: torch.Tensor  # [T] int64
    token_pos: torch.Tensor  # [T] int32
    block_table: torch.Tensor  # [B, W] int32 (vLLM's)
    block_size: int
    max_seq_len: int  # host upper bound of any row's length
    with_moments: bool  # some request of the step keeps moments
    _expanded: tuple | None = field(default=None, repr=False)
    _span: tuple | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.token_req.numel()

    def stock_seq_lens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Lengths for the stock kernel, which still runs over the whole batch: compacted rows get a
        harmless context as long as their own query (their output is overwritten)."""
        b = self.row_req.numel()
        return torch.where(self.row_req >= 0, self.q_lens.to(seq_lens.dtype), seq_lens[:b])

    def compacted_span(self) -> tuple[int, int] | None:
        """``(start, stop)`` when the step's compacted tokens are the tokens ``[start, stop)`` (a decode batch of
        compacted requests side by side), else None; from the expanded tables, once per step."""
        exp = self.tables_for_cpu()
        if exp is None:
            return None
        if self._span is None:
            tok = exp[0]
            a, b = int(tok[0]), int(tok[-1]) + 1
            self._span = (a, b) if b - a == tok.numel() else ()
        return self._span or None

    def tables_for_cpu(self):
        """Per-token page tables for kernels that take them (``ops.ragged_decode_attention``), expanded once
        per step on the host: ``(token_idx [R], step index [R], page_table [L, R, H, P], seq_lens [L, R, H])``,
        or None when no token of the step is compacted. Raises ``RowError`` when a row's new tokens reach
        into its compacted region (a scheduler bug: those requests are then failed alone)."""
        if self._expanded is None:
            self._expanded = _expand(self) or ()
        return self._expanded or None


def _expand(rows: StepRows):
    tok = (rows.token_req >= 0).nonzero().squeeze(1)
    if tok.numel() == 0:
        return None
    bs = rows.block_size
    h = rows.run_count.shape[2]
    idx = rows.token_req[tok].to(torch.int64)
    pos = rows.token_pos[tok].to(torch.int64)
    region = rows.region[idx].to(torch.int64)  # [R]
    tail_tok = pos + 1 - region * bs  # [R]: tail tokens each token's list reads, itself included
    if bool((tail_tok < 1).any()):
        bad = sorted({rows.req_ids[i] for i in idx[tail_tok < 1].tolist()})
        raise RowError(bad, "new tokens reach into the compacted region")
    count = rows.run_count[idx].to(torch.int64)  # [R, L, H]
    n_tail = torch.div(tail_tok + bs - 1, bs, rounding_mode="floor")
    width = int((count.amax(dim=(1, 2)) + n_tail).max())
    p = torch.arange(width, device=tok.device)
    run = rows.run_pages[idx].to(torch.int64)  # [R, L, H, Pw]
    run = run.gather(3, p.clamp_max(run.shape[3] - 1).view(1, 1, 1, -1).expand(*count.shape, -1))
    col = (region.view(-1, 1, 1, 1) + p.view(1, 1, 1, -1) - count.unsqueeze(-1))
    col = col.clamp(0, rows.block_table.shape[1] - 1)
    bt = rows.block_table[rows.token_row[tok]].to(torch.int64)  # [R, W]
    lanes = torch.arange(h, device=tok.device).view(1, 1, -1, 1)
    tail = bt.gather(1, col.reshape(col.shape[0], -1)).view(col.shape) * h + lanes
    table = torch.where(p.view(1, 1, 1, -1) < count.unsqueeze(-1), run, tail)
    seq = count * bs + tail_tok.view(-1, 1, 1)
    return (tok, idx, table.permute(1, 0, 2, 3).to(torch.int32).contiguous(),
            seq.permute(1, 0, 2).to(torch.int32).contiguous())


def _on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device``; to a GPU through pinned memory, without waiting."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class PageTables:
    """One slot per compacted request on this worker: ``run_pages [S, L, H, P]`` (kept head-page ids),
    ``run_count [S, L, H]`` (kept pages), ``region [S]`` (``E``, the first dense block), moment pages, on
    the cache's device. ``key_slot [num_blocks]`` maps this step's row keys to slots."""

    def __init__(self, num_layers: int, num_kv_heads: int, block_size: int, num_blocks: int,
                 device: torch.device | str = "cpu", capacity: int = 8, width: int = 4):
        self.num_layers, self.num_kv_heads, self.block_size = num_layers, num_kv_heads, block_size
        self.device = torch.device(device)
        self._slot: dict[str, int] = {}
        self._moments: dict[str, bool] = {}  # host mirror of has_moments
        self._captures: list[tuple[str, int, int, int]] = []
        self._free: list[int] = []
        self.capacity, self.width, self.moment_width = 0, width, 1
        self.run_pages = self.run_count = self.region = self.moment_pages = self.has_moments = None
        self.expect_pos = self.expect_blk = None
        self._grow(capacity, width, 1)
        # the block holding a compacted request's last computed token -> its slot (checked against the slot's
        # expect_blk: an entry left by a request that moved on or left is never trusted)
        self.blk_slot = torch.full((num_blocks + 1,), -1, dtype=torch.int32, device=self.device)
        self.key_slot = torch.full((num_blocks,), -1, dtype=torch.int32, device=self.device)
        self.cap_of_key = torch.full((num_blocks,), -1, dtype=torch.int32, device=self.device)
        self._keyed = torch.empty(0, dtype=torch.int64, device=self.device)
        self._cap_keyed = torch.empty(0, dtype=torch.int64, device=self.device)

    # ---------------------------------------------------------------- state (rounds, adoption, release)
    def _grow(self, capacity: int, width: int, moment_width: int) -> None:
        s, l, h, dev = capacity, self.num_layers, self.num_kv_heads, self.device

        def fit(old, shape, fill, dtype):
            new = torch.full(shape, fill, dtype=dtype, device=dev)
            if old is not None:
                new[tuple(slice(0, n) for n in old.shape)] = old
            return new

        self.run_pages = fit(self.run_pages, (s, l, h, width), 0, torch.int32)
        self.run_count = fit(self.run_count, (s, l, h), 0, torch.int32)
        self.region = fit(self.region, (s,), 0, torch.int32)
        self.moment_pages = fit(self.moment_pages, (s, l, moment_width), 0, torch.int32)
        self.has_moments = fit(self.has_moments, (s,), False, torch.bool)
        # one more entry than slots: where rows that are not compacted write (no test, no sync)
        old = self.capacity
        self.expect_pos = fit(self.expect_pos, (s + 1,), -1, torch.int64)
        self.expect_blk = fit(self.expect_blk, (s + 1,), -1, torch.int64)
        self.expect_pos[old:] = -1
        self._free += list(range(self.capacity, capacity))
        self.capacity, self.width, self.moment_width = capacity, width, moment_width

    def slot_of(self, req_id: str) -> int | None:
        return self._slot.get(req_id)

    def __len__(self) -> int:
        return len(self._slot)

    def put(self, req_id: str, layout) -> int:
        """Set a request's kept run from its layout (after a round, or when it adopts a shared context)."""
        p = layout.page_ids.shape[2]
        m = 0 if layout.moment_page_ids is None else layout.moment_page_ids.shape[1]
        slot = self._slot.get(req_id)
        full = slot is None and not self._free
        if full or p > self.width or m > self.moment_width:
            self._grow(self.capacity * 2 if full else self.capacity, max(self.width, p), max(self.moment_width, m))
        if slot is None:
            slot = self._slot[req_id] = self._free.pop(0)
        dev = self.device
        self.run_pages[slot, :, :, :p] = layout.page_ids.to(dev, torch.int32)
        self.run_count[slot] = layout.pages.to(dev, torch.int32)
        self.region[slot] = layout.region_blocks
        self.has_moments[slot] = m > 0
        self._moments[req_id] = m > 0
        if m:
            self.moment_pages[slot, :, :m] = layout.moment_page_ids.to(dev, torch.int32)
            self.moment_pages[slot, :, m:] = layout.moment_page_ids[:, :1].to(dev, torch.int32)
        return slot

    def drop(self, req_id: str) -> None:
        self._moments.pop(req_id, None)
        slot = self._slot.pop(req_id, None)
        if slot is not None:
            self.expect_pos[slot] = -1
            self._free.append(slot)

    def expect(self, req_id: str, next_pos: int, last_block: int) -> None:
        """The request's next step starts at ``next_pos``; ``last_block`` holds its token ``next_pos - 1``."""
        slot = self._slot.get(req_id)
        if slot is None or next_pos <= 0:
            return
        self.expect_pos[slot] = next_pos
        self.expect_blk[slot] = last_block
        self.blk_slot[last_block] = slot

    def predict(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                num_reqs: int) -> torch.Tensor:
        """``[B]`` bool: the rows that are compacted requests', as far as the tables can tell before the
        step's keys arrive (``expect``); device tensors in and out."""
        dev = block_table.device
        b = num_reqs
        qsl = query_start_loc[: b + 1].to(dev, torch.int64)
        first = seq_lens[:b].to(dev, torch.int64) - (qsl[1:] - qsl[:-1])
        col = torch.div(first - 1, self.block_size, rounding_mode="floor").clamp(0, block_table.shape[1] - 1)
        blk = block_table[:b].gather(1, col.view(-1, 1)).squeeze(1).to(torch.int64)
        blk = blk.clamp(0, self.blk_slot.numel() - 2)
        slot = self.blk_slot[blk].to(torch.int64)
        s = slot.clamp_min(0)
        return (first > 0) & (slot >= 0) & (self.expect_pos[s] == first) & (self.expect_blk[s] == blk)

    # ---------------------------------------------------------------- every step
    def set_keys(self, keys: dict[str, int], captures: list[tuple[str, int, int, int]]) -> list[str]:
        """This step's row keys (req -> key block) of the scheduled requests, and its captures ``(req, key
        block, start, end)``. Returns the compacted requests of the step, in step order."""
        dev = self.device
        self.key_slot.index_fill_(0, self._keyed, -1)  # a scalar fill: nothing copied to the device
        self.cap_of_key.index_fill_(0, self._cap_keyed, -1)
        reqs = [r for r in keys if r in self._slot]
        blocks = _on([keys[r] for r in reqs], torch.int64, dev)
        self.key_slot[blocks] = torch.arange(len(reqs), dtype=torch.int32, device=dev)
        self._keyed = blocks
        cap_blocks = _on([c[1] for c in captures], torch.int64, dev)
        self.cap_of_key[cap_blocks] = torch.arange(len(captures), dtype=torch.int32, device=dev)
        self._cap_keyed = cap_blocks
        self._captures = list(captures)
        return reqs

    def step(self, reqs: list[str], query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
             block_table: torch.Tensor, num_reqs: int, num_tokens: int, max_seq_len: int,
             with_rows: bool = True) -> tuple[StepRows | None, CaptureWindows | None]:
        """Match the step's batch rows to its compacted requests (``reqs``, as ``set_keys`` returned them)
        and captures: device tensors in, device tensors out."""
        captures = self._captures
        if not (reqs and with_rows) and not captures:
            return None, None
        dev = block_table.device
        b = num_reqs
        qsl = query_start_loc[: b + 1].to(dev, torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        first = seq_lens[:b].to(dev, torch.int64) - q_lens
        col = torch.div(first, self.block_size, rounding_mode="floor").clamp(0, block_table.shape[1] - 1)
        key = block_table[:b].gather(1, col.view(-1, 1)).squeeze(1).to(torch.int64)
        token_row = torch.repeat_interleave(torch.arange(b, device=dev), q_lens, output_size=num_tokens)
        token_pos = first[token_row] + torch.arange(num_tokens, device=dev) - qsl[token_row]
        rows = None
        if reqs and with_rows:
            slots = _on([self._slot[r] for r in reqs], torch.int64, dev)
            row_req = self.key_slot[key]
            has = self.has_moments[slots]
            rows = StepRows(reqs, self.run_pages[slots], self.run_count[slots], self.region[slots],
                            self.moment_pages[slots], has, row_req, q_lens.to(torch.int32), row_req[token_row],
                            token_row, token_pos.to(torch.int32), block_table, self.block_size, max_seq_len,
                            with_moments=any(self._moments.get(r, False) for r in reqs))
            self._advance(slots, row_req, first, q_lens, block_table[:b])
        cap = None
        if captures:
            counts = [end - start for _, _, start, end in captures]
            offs = _on([0] + counts[:-1], torch.int64, dev).cumsum(0)
            starts = _on([c[2] for c in captures], torch.int64, dev)
            ends = _on([c[3] for c in captures], torch.int64, dev)
            total = sum(counts)
            c = self.cap_of_key[key][token_row].to(torch.int64)
            cc = c.clamp_min(0)
            inside = (c >= 0) & (token_pos >= starts[cc]) & (token_pos < ends[cc])
            dst = torch.where(inside, offs[cc] + token_pos - starts[cc], torch.full_like(token_pos, total))
            cap = CaptureWindows([(r, s, e - s) for r, _, s, e in captures], total, dst)
        return rows, cap


    def _advance(self, slots: torch.Tensor, row_req: torch.Tensor, first: torch.Tensor, q_lens: torch.Tensor,
                 block_table: torch.Tensor) -> None:
        """Each compacted row's request: its next step starts after this step's tokens (``expect``)."""
        mine = row_req >= 0
        slot = torch.where(mine, slots[row_req.clamp_min(0).to(torch.int64)], torch.full_like(first, self.capacity))
        nxt = first + q_lens
        col = torch.div(nxt - 1, self.block_size, rounding_mode="floor").clamp(0, block_table.shape[1] - 1)
        blk = block_table.gather(1, col.view(-1, 1)).squeeze(1).to(torch.int64)
        self.expect_pos.index_put_((slot,), torch.where(mine, nxt, torch.full_like(nxt, -1)))
        self.expect_blk.index_put_((slot,), blk)
        sink = torch.full_like(blk, self.blk_slot.numel() - 1)
        self.blk_slot.index_put_((torch.where(mine, blk.clamp(0, self.blk_slot.numel() - 2), sink),),
                                 slot.to(torch.int32))


class RowError(RuntimeError):
    """Rows whose tables cannot be built; ``req_ids`` are failed alone."""

    def __init__(self, req_ids: list[str], why: str):
        super().__init__(f"{why}: {req_ids}")
        self.req_ids = req_ids
