"""Random steps of a batch mixing compacted and ordinary requests (the page-table tests and the builder
benchmarks): each compacted request has a random ragged layout (lane borrowing, heads with empty runs) over
its first blocks, vLLM's null block in the freed slots, a dense tail, and 1 to 4 new tokens this step; the
expected per-token page tables come from ``layout.decode_page_table`` built fresh for each token."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from vllm_contour.layout import decode_page_table, kept_blocks_for, plan_layout


@dataclass
class Req:
    req_id: str
    blocks: list[int]  # logical block table (0 = vLLM's null block in freed slots)
    num_computed: int  # tokens with KV before this step
    q_len: int
    layout: object | None = None  # compacted when set


def random_layout(rnd: random.Random, layers: int, h: int, bs: int, targets: list[int], region: int,
                  moments: int = 0):
    """A layout packing random per-head page counts into ``targets`` (the round's target blocks), dense
    tail from logical block ``region`` on."""
    n = len(targets)
    pages = torch.tensor([[rnd.randint(0, n) for _ in range(h)] for _ in range(layers)])
    pages[rnd.randrange(layers), rnd.randrange(h)] = 0
    while kept_blocks_for(pages, h, moments) > n:
        i, j = rnd.randrange(layers), rnd.randrange(h)
        pages[i, j] = max(0, int(pages[i, j]) - 1)
    return plan_layout(pages, targets, bs, h, region, moment_pages=moments)


def make_request(rnd: random.Random, name: str, free: list[int], layers: int, h: int, bs: int,
                 compacted: bool, moments: int = 0) -> Req:
    q_len = rnd.randint(1, 4)
    if not compacted:
        n = rnd.randint(0, 3 * bs)
        blocks = [free.pop() for _ in range((n + q_len + bs - 1) // bs)]
        return Req(name, blocks, n, q_len)
    region = rnd.randint(2, 4)
    tail = rnd.randint(0, 2 * bs)
    n = region * bs + tail
    blocks = [free.pop() for _ in range((n + q_len + bs - 1) // bs)]
    lay = random_layout(rnd, layers, h, bs, blocks[:region], region, moments)
    table = [b if i < lay.kept_blocks or i >= region else 0 for i, b in enumerate(blocks)]
    return Req(name, table, n, q_len, lay)


def batch_tensors(reqs: list[Req], width: int):
    """``(query_start_loc [B+1], seq_lens [B], block_table [B, width])`` as vLLM's builder sees them."""
    qsl = [0]
    for r in reqs:
        qsl.append(qsl[-1] + r.q_len)
    seq = [r.num_computed + r.q_len for r in reqs]
    bt = torch.zeros((len(reqs), width), dtype=torch.int32)
    for i, r in enumerate(reqs):
        bt[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
    return torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32), bt


def key_of(r: Req, bs: int) -> int:
    return r.blocks[r.num_computed // bs]


def expected_tables(reqs: list[Req], bs: int):
    """Per compacted token, freshly built: ``(token index, req_id, table [L, H, P], lens [L, H])``."""
    out, t = [], 0
    for r in reqs:
        for i in range(r.q_len):
            if r.layout is not None:
                e = r.layout.region_blocks
                tail_tokens = r.num_computed + i + 1 - e * bs
                n_tail = (tail_tokens + bs - 1) // bs
                table, lens = decode_page_table(r.layout, r.blocks[e: e + n_tail], tail_tokens)
                out.append((t, r.req_id, table, lens))
            t += 1
    return out
