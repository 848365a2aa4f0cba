"""Page tables kept as state (``vllm_contour.page_tables``) equal tables built fresh from each request's
layout and block table, after random sequences of rounds, new tail blocks, preemptions, finishes and
block reuse; the step's row matching and capture staging are tensor ops over the batch."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_contour.page_tables import PageTables, RowError

from benchmarks.page_table_cases import Req, batch_tensors, expected_tables, key_of, make_request, random_layout

L, H, BS, NB = 3, 2, 16, 400


def _check_step(pt: PageTables, reqs: list[Req], captures=(), seen: set | None = None):
    """One step as the builder and the impl see it. ``seen``: the compacted requests that ran in an earlier
    step since they were compacted; before the step's keys, the tables predict exactly those rows (Model
    Runner V2 builds the metadata first), never an ordinary row."""
    qsl, seq, bt = batch_tensors(reqs, width=16)
    if seen is not None:
        predicted = pt.predict(qsl, seq, bt, len(reqs)).tolist()
        assert predicted == [r.layout is not None and r.req_id in seen for r in reqs], predicted
        seen.update(r.req_id for r in reqs if r.layout is not None)
    keys = {r.req_id: key_of(r, BS) for r in reqs}
    compacted = pt.set_keys(keys, list(captures))
    rows, cap = pt.step(compacted, qsl, seq, bt, len(reqs), int(qsl[-1]), int(seq.max()))
    want = expected_tables(reqs, BS)
    assert sorted(compacted) == sorted({r for _, r, _, _ in want})
    if not want:
        assert rows is None or rows.tables_for_cpu() is None
        return rows, cap
    tok, idx, table, lens = rows.tables_for_cpu()
    assert tok.tolist() == [t for t, _, _, _ in want]
    for i, (t, req_id, w_table, w_lens) in enumerate(want):
        assert rows.req_ids[int(idx[i])] == req_id
        assert torch.equal(lens[:, i], w_lens), (req_id, t)
        for layer in range(L):
            for h in range(H):
                n_pages = (int(w_lens[layer, h]) + BS - 1) // BS
                assert torch.equal(table[layer, i, h, :n_pages], w_table[layer, h, :n_pages]), (req_id, layer, h)
    stock = rows.stock_seq_lens(seq)
    for i, r in enumerate(reqs):
        assert int(stock[i]) == (r.q_len if r.layout is not None else r.num_computed + r.q_len)
    return rows, cap


@pytest.mark.parametrize("seed", range(6))
def test_incremental_tables_equal_fresh_ones_over_random_events(seed):
    rnd = random.Random(seed)
    free = list(range(1, NB))
    rnd.shuffle(free)
    pt = PageTables(L, H, BS, NB, capacity=2, width=1)  # small: rounds and new requests must grow it
    live: list[Req] = []
    seen: set = set()
    n = 0
    for step in range(40):
        ev = rnd.random()
        if ev < 0.3 or not live:  # a new request, compacted (first round) or ordinary
            r = make_request(rnd, f"r{n}", free, L, H, BS, compacted=rnd.random() < 0.6,
                             moments=rnd.choice([0, 0, 2]))
            n += 1
            if r.layout is not None:
                pt.put(r.req_id, r.layout)
            live.append(r)
        elif ev < 0.45:  # finish or preemption: state dropped, blocks back to the pool (reused later)
            r = live.pop(rnd.randrange(len(live)))
            pt.drop(r.req_id)
            seen.discard(r.req_id)
            free[:0] = [b for b in r.blocks if b]
        elif ev < 0.6:  # a decode round on a compacted request: its kept blocks and full tail blocks are
            cands = [r for r in live if r.layout is not None and r.num_computed // BS > r.layout.region_blocks]
            if cands:  # the targets; the new layout keeps the first of them, the rest go back to the pool
                r = rnd.choice(cands)
                e_old, e_new = r.layout.region_blocks, r.num_computed // BS
                targets = list(r.layout.block_ids) + r.blocks[e_old:e_new]
                r.layout = random_layout(rnd, L, H, BS, targets, e_new, moments=rnd.choice([0, 1]))
                kept = r.layout.block_ids
                free[:0] = [b for b in targets if b not in kept]
                # the worker's block table never learns of the freed slots (vLLM sends new blocks only): they
                # keep ids the pool may hand to another request
                r.blocks = kept + r.blocks[len(kept):]
                pt.put(r.req_id, r.layout)
        # every live request computes its tokens; a new tail block when it crosses a page boundary
        sched = [r for r in live if rnd.random() < 0.8]
        rnd.shuffle(sched)
        if sched:
            _check_step(pt, sched, seen=seen)
        for r in sched:
            r.num_computed += r.q_len
            r.q_len = rnd.randint(1, 3)
            while len(r.blocks) * BS < r.num_computed + r.q_len:
                r.blocks.append(free.pop())


def test_a_reused_key_block_does_not_route_an_ordinary_row():
    """Last step's key of a compacted request that finished is now an ordinary request's key block, while
    another compacted request took the finished one's slot."""
    rnd = random.Random(1)
    free = list(range(1, NB))
    pt = PageTables(L, H, BS, NB, capacity=1)
    a = make_request(rnd, "a", free, L, H, BS, compacted=True)
    pt.put("a", a.layout)
    _check_step(pt, [a])
    pt.drop("a")
    c = make_request(rnd, "c", free, L, H, BS, compacted=True)
    assert pt.put("c", c.layout) == 0  # a's slot
    b = Req("b", [key_of(a, BS)], 3, 1)  # a's key block, now b's
    rows, _ = _check_step(pt, [b, c])
    assert rows.row_req.tolist() == [-1, 0] and rows.req_ids == ["c"]


def test_new_tokens_inside_the_compacted_region_fail_that_request_alone():
    rnd = random.Random(2)
    free = list(range(1, NB))
    pt = PageTables(L, H, BS, NB)
    a = make_request(rnd, "a", free, L, H, BS, compacted=True)
    pt.put("a", a.layout)
    a.num_computed = a.layout.region_blocks * BS - 2  # (a scheduler bug)
    a.blocks[a.num_computed // BS] = 77
    qsl, seq, bt = batch_tensors([a], 16)
    reqs = pt.set_keys({"a": 77}, [])
    rows, _ = pt.step(reqs, qsl, seq, bt, 1, int(qsl[-1]), int(seq.max()))
    with pytest.raises(RowError) as e:
        rows.tables_for_cpu()
    assert e.value.req_ids == ["a"]


def test_capture_staging_rows():
    """Window tokens of the requests with captures land at their offset in the staging rows, in position
    order; every other token of the batch goes to the spare row ``total``."""
    rnd = random.Random(3)
    free = list(range(1, NB))
    pt = PageTables(L, H, BS, NB)
    reqs = [make_request(rnd, f"r{i}", free, L, H, BS, compacted=False) for i in range(4)]
    for r in reqs:
        r.q_len = 6
        while len(r.blocks) * BS < r.num_computed + r.q_len:
            r.blocks.append(free.pop())
    c0 = (reqs[1].req_id, key_of(reqs[1], BS), reqs[1].num_computed + 2, reqs[1].num_computed + 6)
    c1 = (reqs[3].req_id, key_of(reqs[3], BS), reqs[3].num_computed, reqs[3].num_computed + 3)
    _, cap = _check_step(pt, reqs, captures=[c0, c1])
    assert cap.total == 7 and cap.owners == [(c0[0], c0[2], 4), (c1[0], c1[2], 3)]
    want = [7] * 24
    want[6 + 2: 6 + 6] = [0, 1, 2, 3]
    want[18: 21] = [4, 5, 6]
    assert cap.dst.tolist() == want


def _step_of(flags, seed):
    """The checked rows of one step over requests made from ``flags`` (True: compacted), pages shuffled."""
    rnd = random.Random(seed)
    free = list(range(1, NB))
    rnd.shuffle(free)
    reqs = [make_request(rnd, f"r{i}", free, L, H, BS, compacted=c) for i, c in enumerate(flags)]
    pt = PageTables(L, H, BS, NB)
    for r in reqs:
        if r.layout is not None:
            pt.put(r.req_id, r.layout)
    rows, _ = _check_step(pt, reqs)
    return rows


@pytest.mark.parametrize("mixed", [False, True])
def test_compacted_attention_writes_each_token_of_the_step_its_own_rows(mixed):
    """``ops.compacted_attention`` over a step's rows: compacted requests side by side (their tokens one span:
    read and written as slices) or between ordinary rows (gathered and scattered) give every compacted token
    the reference attention over its own table, and leave every ordinary row's output as it was."""
    from vllm_contour import ops
    from vllm_contour.ops.reference import ragged_decode_attention_ref

    from tests.unit.ops_cases import make_cache

    flags = [True, False, True, True, False] if mixed else [True] * 4
    rows = _step_of(flags, seed=31 + mixed)
    tok, idx, table, lens = rows.tables_for_cpu()
    assert (rows.compacted_span() is None) == mixed
    assert mixed or rows.compacted_span() == (0, tok.numel())
    _, k, v = make_cache("cpu_rows", NB, H, BS, 8, torch.float32, seed=32)
    n = rows.num_tokens
    q = torch.randn(n, H * 2, 8, generator=torch.Generator().manual_seed(33))
    for layer in range(L):
        out = torch.full((n, H * 2, 8), 5.0)
        ops.compacted_attention(q, k, v, rows, layer, 0.3, out=out)
        want, _ = ragged_decode_attention_ref(q[tok], k, v, table[layer], lens[layer], 0.3)
        torch.testing.assert_close(out[tok], want, rtol=1e-5, atol=1e-5)
        others = torch.ones(n, dtype=torch.bool)
        others[tok] = False
        assert bool(others.any()) == mixed and bool((out[others] == 5.0).all())


@pytest.mark.parametrize("flags", [[True] * 3, [True, True, False, True], [False, True, True], [True, True, False]])
def test_vllms_kernel_runs_only_for_a_step_with_tokens_that_are_not_compacted(flags, monkeypatch):
    """The CPU impl leaves vLLM's attention kernel out when every token of the step is a compacted request's
    (the compacted attention writes every output row; vLLM writes the cache apart): the outputs are the
    compacted attention's. With an ordinary row anywhere in the step (between, before or after the compacted
    ones) vLLM's kernel runs and that row keeps its output."""
    mixed = not all(flags)
    from types import SimpleNamespace

    from vllm_contour.integration.backends import common, cpu
    from vllm_contour.integration.worker.step import StepField
    from vllm_contour.ops.reference import ragged_decode_attention_ref

    from tests.unit.ops_cases import make_cache

    rows = _step_of(flags, seed=41 + len(flags))
    _, k, v = make_cache("cpu_rows", NB, H, BS, 8, torch.float32, seed=42)
    calls = []

    class VllmImpl:  # stands in for vLLM's CPU impl: its kernel writes 7 everywhere
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a):
            calls.append(layer.layer_name)
            output.fill_(7.0)
            return output

    class Impl(common.ContourImpl, VllmImpl):
        num_heads, head_size, scale = H * 2, 8, 0.3
        kv_views = staticmethod(lambda kv_cache: (k, v))
        _compacted_only = staticmethod(cpu.ContourCPUAttentionImpl._compacted_only)

        def __init__(self):
            pass

    class Metadata(StepField):  # vLLM's metadata as the plugin's builder returns it
        def __init__(self, step, num_actual_tokens):
            self.contour, self.num_actual_tokens = step, num_actual_tokens

    step = SimpleNamespace(layer={"l1": 1}.get, resolve=lambda: (rows, None), fail=None)
    n = rows.num_tokens
    q = torch.randn(n, H * 2 * 8, generator=torch.Generator().manual_seed(43))
    out = torch.full((n, H * 2 * 8), 5.0)
    Impl().forward(SimpleNamespace(layer_name="l1"), q, None, None, torch.zeros(1), Metadata(step, n), out)
    assert calls == (["l1"] if mixed else [])
    tok, _, table, lens = rows.tables_for_cpu()
    want, _ = ragged_decode_attention_ref(q.view(n, H * 2, 8)[tok], k, v, table[1], lens[1], 0.3)
    torch.testing.assert_close(out.view(n, H * 2, 8)[tok], want, rtol=1e-5, atol=1e-5)
    others = torch.ones(n, dtype=torch.bool)
    others[tok] = False
    assert bool(others.any()) == mixed and bool((out[others] == 7.0).all())


def test_prediction_never_takes_a_reused_block_for_a_compacted_request():
    """Before the step's keys arrive (Model Runner V2) a row is predicted compacted only when its request's
    expected next position and the block holding the token before it both match: a request that finished, or
    a block a round freed, leaves its block to another request whose row must not be taken for it."""
    rnd = random.Random(5)
    free = list(range(1, NB))
    pt = PageTables(L, H, BS, NB, capacity=1)

    def predicted(reqs):
        qsl, seq, bt = batch_tensors(reqs, width=16)
        return pt.predict(qsl, seq, bt, len(reqs)).tolist()

    a = make_request(rnd, "a", free, L, H, BS, compacted=True)
    a.num_computed, a.q_len = a.num_computed - a.num_computed % BS + BS - 1, 1  # its next token starts a block
    while len(a.blocks) * BS < a.num_computed + a.q_len:
        a.blocks.append(free.pop())
    pt.put("a", a.layout)
    _check_step(pt, [a])
    x = a.blocks[(a.num_computed + a.q_len - 1) // BS]  # holds a's last token
    a.num_computed += 1
    a.blocks.append(free.pop())
    assert predicted([a]) == [True]
    # a finishes; b gets x as its first block and, one step later, computes from a's expected position on
    pt.drop("a")
    b = Req("b", [x] + [free.pop() for _ in range(16)], a.num_computed, 1)
    b.blocks = [free.pop() for _ in range(b.num_computed // BS - 1)] + [x] + [free.pop(), free.pop()]
    assert b.blocks[(b.num_computed - 1) // BS] == x
    assert predicted([b]) == [False]
    # c is compacted; its first step ends a block (x2), its next starts one (y): x2 is no longer where its next
    # step starts, and a row that has x2 there is not c's
    c = make_request(rnd, "c", free, L, H, BS, compacted=True)
    assert pt.put("c", c.layout) == 0  # a's slot
    c.q_len = BS - c.num_computed % BS
    while len(c.blocks) * BS < c.num_computed + c.q_len + 1:
        c.blocks.append(free.pop())
    _check_step(pt, [c])
    c.num_computed += c.q_len
    x2, y = c.blocks[c.num_computed // BS - 1], c.blocks[c.num_computed // BS]
    c.q_len = 1
    _check_step(pt, [c])
    c.num_computed += 1
    d = Req("d", [free.pop() for _ in range(c.num_computed // BS)] + [x2, free.pop()], c.num_computed, 1)
    assert d.blocks[(d.num_computed - 1) // BS] == x2 and c.blocks[(c.num_computed - 1) // BS] == y
    assert predicted([c, d]) == [True, False]
