"""One eviction round of one request: plan first (policy -> layout -> moves; nothing is written), then apply
(moments -> compaction -> moment storage, only through ``ops``). Pure torch.

The caller hands per-layer ``(key_cache, value_cache)`` views ``[num_blocks, H, bs, D]`` (any strides, or
the two-level form of ``ops.paged``; an fp8 cache's as ``ops.fp8.KVViews`` with each layer's tables: scoring
and moments read its numbers, compaction moves its bytes), the request's block ids in logical order (freed
blocks may appear as anything: they are never read), how many tokens have KV, the request's page budget
and, for query-aware policies, the captured window queries.

A round looks at the request's *candidates*. The first round: every token of its full blocks ``[0, E2)``
(with ``kv_context_len`` in ``score_only`` mode: of the context's full blocks). A later round: each head's
kept run from the previous layout plus the full tail blocks ``[E, E2)``. Each layer keeps its page budget
(``PageBudget.token_pages``); the layout packs the kept pages, plus the moment pages, into the first of the
*target* blocks (the blocks that held the candidates, in logical order) and the remaining targets empty.
With ``fresh_ids`` (private blocks the scheduler allocated because some targets are hashed for prefix
caching or shared with other requests) the kept pages go into those instead: the round only reads the
request's blocks, every target is released, and the first fresh blocks take the first target slots.
A plan that fails raises before any byte moved; the caller then leaves the request as it was.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from vllm_contour import moments as mom_math
from vllm_contour import ops
from vllm_contour.budget import PageBudget
from vllm_contour.config import RequestEviction
from vllm_contour.layout import RequestLayout, compaction_indices, plan_layout, region_source_table
from vllm_contour.ops.fp8 import dequant_of, luts_of
from vllm_contour.ops.paged import dims, head_pages
from vllm_contour.policies import LayerInputs, Policy, Selection, build_policy


class PlanError(RuntimeError):
    """The round cannot be planned within the budget and the request's blocks; nothing was written."""


@dataclass
class LayerPlan:
    moves: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # src page/off, dst page/off
    evicted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # page ids, offsets, heads (moments)


@dataclass
class RoundPlan:
    layout: RequestLayout
    freed_slots: list[int]  # logical indices of target blocks that hold nothing after the round
    freed_blocks: list[int]  # their physical ids
    layers: list[LayerPlan]
    prev: RequestLayout | None
    evicted_tokens: int  # over all layers and heads
    replaced: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, original id, fresh id)
    seconds: float = 0.0
    stats: dict = field(default_factory=dict)

    @property
    def fresh(self) -> bool:
        """The round writes only private blocks: a failure while applying leaves the request's cache as
        it was."""
        return bool(self.replaced)


def on_device(t: torch.Tensor):
    """Tensors a round creates live where the cache lives: a default-device scope for CUDA caches (policies,
    layouts and indices are then made on the GPU); nothing on CPU."""
    return torch.device(t.device) if t.device.type != "cpu" else contextlib.nullcontext()


def plan_round(caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], num_tokens: int,
               params: RequestEviction, budget: PageBudget, scale: float, prev: RequestLayout | None = None,
               queries: dict[int, torch.Tensor] | None = None, query_positions: torch.Tensor | None = None,
               policy: Policy | None = None, fresh_ids: list[int] | None = None,
               layers: tuple[int, int] | None = None, reconstruction: torch.Tensor | None = None) -> RoundPlan | None:
    """Plan one round. Returns None when there is nothing to evict (every layer's candidates fit in its
    budget, or no new full block since the last round). Raises ``PlanError`` (or the policy's error) when
    the round cannot be planned; nothing has been written then. ``layers``: (index of ``caches[0]`` among
    the model's layers, the model's layer count) when these caches are one pipeline stage's (policies that
    depend on depth, e.g. PyramidKV, see the whole model); default ``(0, len(caches))``. ``reconstruction``:
    ``[L, H, C]`` KVzip scores of the context by position (policies that score with the context
    reconstruction; a later round reads its kept tokens' and new tail's)."""
    req = RoundRequest(block_ids, num_tokens, prev, queries, query_positions, fresh_ids, reconstruction)
    return plan_rounds(caches, [req], params, budget, scale, policy, layers)[0]


@dataclass
class RoundRequest:
    """One request's part of ``plan_rounds`` (``plan_round``'s per-request arguments)."""

    block_ids: list[int]
    num_tokens: int
    prev: RequestLayout | None = None
    queries: dict[int, torch.Tensor] | None = None
    query_positions: torch.Tensor | None = None
    fresh_ids: list[int] | None = None
    reconstruction: torch.Tensor | None = None


def plan_rounds(caches: list[tuple[torch.Tensor, torch.Tensor]], requests: list[RoundRequest],
                params: RequestEviction, budget: PageBudget, scale: float, policy: Policy | None = None,
                layers: tuple[int, int] | None = None) -> list[RoundPlan | None]:
    """Plan the rounds of several requests with the same eviction parameters in one policy pass
    (``Policy.plan_requests``: the per-layer allocation and the selection once for all). Each plan equals
    ``plan_round`` of its request alone; each plan's ``seconds`` is its share of the whole. Every request's
    policy input (its candidates' keys) stays alive until the joint selection: meant for decode-time rounds,
    whose candidates are their kept tokens and tail. Raises when any request's round cannot be planned (the
    caller plans them one by one to find which)."""
    with on_device(caches[0][0]):
        t0 = time.perf_counter()
        policy = policy or build_policy(params.policy, params.policy_args, sink_tokens=params.sink_tokens,
                                        recent_window=params.recent_window)
        layers = layers or (0, len(caches))
        preps = [_prepare(caches, r, params, budget, scale, policy, layers) for r in requests]
        live = [p for p in preps if p is not None]
        sels = iter(policy.plan_requests([p.inp for p in live], [[budget.token_pages] * len(caches)] * len(live),
                                         budget.num_kv_heads))
        plans = [None if p is None else _finish(caches, p, next(sels), policy, budget) for p in preps]
        share = (time.perf_counter() - t0) / max(1, sum(p is not None for p in plans))
        for plan in plans:
            if plan is not None:
                plan.seconds = share
        return plans


@dataclass
class _Prepared:
    """A request's round before the policy ran: its candidates as the policy's input."""

    inp: LayerInputs
    src_tables: list[torch.Tensor]  # per layer [H, width]: each row's candidate pages
    cand: tuple[torch.Tensor, torch.Tensor]  # candidates' positions [L * H, width], their counts [L, H]
    targets: list[int]
    e_new: int
    block_ids: list[int]
    prev: RequestLayout | None
    fresh_ids: list[int] | None


def _prepare(caches, req: RoundRequest, params, budget, scale, policy, layers) -> _Prepared | None:
    block_ids, num_tokens, prev, queries = req.block_ids, req.num_tokens, req.prev, req.queries
    query_positions, reconstruction = req.query_positions, req.reconstruction
    key0 = caches[0][0]
    _, h, bs, d = dims(key0)
    if h != budget.num_kv_heads or bs != budget.block_size:
        raise PlanError(f"budget for {budget.num_kv_heads} heads x page {budget.block_size}, cache has "
                        f"{h} x {bs}")
    n_blocks = (num_tokens + bs - 1) // bs
    if len(block_ids) < n_blocks:
        raise PlanError(f"request has {len(block_ids)} blocks, {n_blocks} needed for {num_tokens} tokens")
    if policy.needs_queries and not queries:
        raise PlanError(f"policy {policy.name} needs window queries; none were captured")
    if policy.needs_reconstruction and reconstruction is None:
        raise PlanError(f"policy {policy.name} scores with the context's reconstruction: none ran for this round")
    if prev is None:
        window_end = min(num_tokens, params.context_len) if params.context_len else num_tokens
        e_new = window_end // bs
        if e_new == 0 or not budget.evicts(h * e_new):
            return None
        targets = list(range(e_new))
    else:
        window_end = None
        e_new = num_tokens // bs
        if e_new <= prev.region_blocks:
            return None
        targets = list(prev.block_slots) + list(range(prev.region_blocks, e_new))
    blocks = torch.tensor(block_ids[:n_blocks], dtype=torch.int64)
    num_layers = len(caches)
    if policy.needs_queries and any(queries.get(layer) is None for layer in range(num_layers)):
        raise PlanError(f"policy {policy.name} needs window queries; some layers have none")
    q_all = None if not queries else torch.cat([queries[layer] for layer in range(num_layers)])
    if prev is None:
        inp, src_tables, cand = _first_round_inputs(caches, blocks, num_tokens, e_new, block_ids, h, scale,
                                                        q_all, query_positions, window_end, layers,
                                                        policy.needs_values)
        if policy.needs_reconstruction:
            if reconstruction.shape[:2] != (num_layers, h) or reconstruction.shape[2] < inp.region_len:
                raise PlanError(f"reconstruction scores {tuple(reconstruction.shape)} do not cover {num_layers} "
                                f"layers x {h} heads x {inp.region_len} tokens")
            inp.reconstruction = reconstruction.reshape(num_layers * h, -1)
    else:
        inp, src_tables, cand = _round_inputs(caches, blocks, num_tokens, prev, e_new, scale, q_all,
                                                  query_positions, policy.accumulates, layers, policy.needs_values)
        if policy.needs_reconstruction:  # each row's kept tokens and new tail by their original positions
            if reconstruction.shape[:2] != (num_layers, h) or reconstruction.shape[2] < e_new * bs:
                raise PlanError(f"reconstruction scores {tuple(reconstruction.shape)} do not cover {num_layers} "
                                f"layers x {h} heads x {e_new * bs} tokens")
            flat = reconstruction.reshape(num_layers * h, -1)
            inp.reconstruction = flat.gather(1, inp.positions.clamp(0, flat.shape[1] - 1).to(flat.device))
    return _Prepared(inp, src_tables, cand, targets, e_new, block_ids, prev, req.fresh_ids)


def _finish(caches, prep: _Prepared, sels: list[Selection], policy: Policy, budget: PageBudget) -> RoundPlan:
    """The round's layout, moves and evicted sets from the policy's selections (nothing is written)."""
    src_tables, cand, targets, e_new = prep.src_tables, prep.cand, prep.targets, prep.e_new
    block_ids, prev, fresh_ids = prep.block_ids, prep.prev, prep.fresh_ids
    _, h, bs, _ = dims(caches[0][0])
    num_layers = len(caches)
    kept_all = [sel.kept for sel in sels]
    pages = torch.tensor([[k.numel() // bs for k in sel.kept] for sel in sels], dtype=torch.int64)
    cand_pos, n_cand = cand  # [L * H, width] candidates' positions (a row's first n_cand[l, h]), [L, H]
    evicted_n = n_cand - pages * bs
    kept_flat = [k for sel in kept_all for k in sel]  # rows l * H + h
    counts = torch.tensor([k.numel() for k in kept_flat], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(num_layers * h), counts)
    slot = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    col = torch.cat(kept_flat) if kept_flat else torch.empty(0, dtype=torch.int64)
    n_cand_rows = n_cand.reshape(-1).tolist()
    evicted_sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = []
    for layer, sel in enumerate(sels):
        if not budget.moment_pages:
            evicted_sets.append(None)
            continue
        src = src_tables[layer]
        ev_p, ev_o, ev_h = [], [], []
        for hh, k in enumerate(sel.kept):
            mask = torch.ones(n_cand_rows[layer * h + hh], dtype=torch.bool)
            mask[k] = False
            j = mask.nonzero().squeeze(1)
            ev_p.append(src[hh, j // bs])
            ev_o.append(j % bs)
            ev_h.append(torch.full_like(j, hh))
        evicted_sets.append((torch.cat(ev_p), torch.cat(ev_o), torch.cat(ev_h)))

    target_ids = [int(block_ids[s]) for s in targets]
    dest_ids, dest_slots = target_ids, targets
    if fresh_ids is not None:
        n_fresh = min(len(fresh_ids), len(targets))
        dest_ids, dest_slots = [int(b) for b in fresh_ids[:n_fresh]], targets[:n_fresh]
    max_tok = max(1, int(pages.max())) * bs
    positions = torch.full((num_layers * h, max_tok), -1, dtype=torch.int64)
    positions[rows, slot] = cand_pos[rows, col]  # every row's kept positions, in its kept order
    positions = positions.view(num_layers, h, max_tok)
    carry = None
    if policy.accumulates:  # plan_rows gives an accumulating scorer's kept scores
        carry = torch.zeros((num_layers * h, max_tok))
        carry[rows, slot] = torch.cat([x for sel in sels for x in sel.scores]).to(torch.float32).nan_to_num(0.0, 0.0, 0.0)
        carry = carry.view(num_layers, h, max_tok)
    try:
        layout = plan_layout(pages, dest_ids, bs, h, e_new, moment_pages=budget.moment_pages,
                             block_slots=dest_slots, positions=positions)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if layout.kept_blocks > max(budget.kept_blocks, 1):
        raise PlanError(f"layout needs {layout.kept_blocks} blocks, the budget allows {budget.kept_blocks}")
    layout.carry = carry
    layout.evicted = evicted_n if prev is None or prev.evicted is None else prev.evicted + evicted_n
    layout.rounds = 1 if prev is None else prev.rounds + 1
    # every layer's moves at once (rows l * H + h), then split by layer
    moves = compaction_indices([k for sel in kept_all for k in sel], layout.page_ids.reshape(num_layers * h, -1),
                               torch.stack(src_tables).reshape(num_layers * h, -1), bs)
    per_layer = (pages.sum(dim=1) * bs).tolist()
    moves = list(zip(*(torch.split(m, per_layer) for m in moves))) if moves[0].numel() else [moves] * num_layers
    layers = [LayerPlan(moves=moves[layer], evicted=evicted_sets[layer]) for layer in range(num_layers)]
    k = layout.kept_blocks
    replaced = []
    if fresh_ids is not None:
        replaced = [(s, target_ids[i], layout.block_ids[i]) for i, s in enumerate(targets[:k])]
    return RoundPlan(layout=layout, freed_slots=targets[k:], freed_blocks=target_ids[k:], layers=layers,
                     prev=prev, evicted_tokens=int(evicted_n.sum()), replaced=replaced)


def _gather(caches, side: int, ids: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Head-pages ``ids`` of every layer's key (``side`` 0) or value (1) cache as ``[rows, width, D]`` (an fp8
    cache's numbers, fp32)."""
    return ops.gather_pages([c[side] for c in caches], ids, luts=luts_of(caches, side)).view(rows, width, -1)


def _first_round_inputs(caches, blocks, num_tokens, e_new, block_ids, h, scale, q_all, query_positions,
                        window_end, layers, with_values: bool):
    """Every layer of a first round as one input: rows ``l * H + h``; every head's candidates are the full
    blocks ``[0, E)`` (the prompt's partial last block and, query-agnostic, the question are context).
    Values only when a component of the policy reads them (else an empty ``[L * H, 0, D]``)."""
    n_blocks = blocks.numel()
    _, _, bs, d = dims(caches[0][0])
    num_layers = len(caches)
    ids = head_pages(blocks, h)  # [H * n]: head-major
    keys = _gather(caches, 0, ids, num_layers * h, n_blocks * bs)[:, :num_tokens]
    values = _gather(caches, 1, ids, num_layers * h, n_blocks * bs)[:, :num_tokens] if with_values else \
        keys.new_empty((num_layers * h, 0, d))
    inp = LayerInputs(keys=keys, values=values, region_len=e_new * bs, page_size=bs, layer_idx=layers[0],
                      num_layers=layers[1], scale=scale, queries=q_all, query_positions=query_positions,
                      window_end=window_end)
    src = region_source_table(block_ids[:e_new], h)
    pos = torch.arange(e_new * bs).expand(num_layers * h, -1)
    return inp, [src] * num_layers, (pos, torch.full((num_layers, h), e_new * bs, dtype=torch.int64))


def _round_inputs(caches, blocks, num_tokens, prev: RequestLayout, e_new, scale, q_all, query_positions,
                  with_prior, layers, with_values: bool):
    """Every layer of a later round as one padded input (rows ``l * H + h``): head h's kept run (original
    positions) then the new full tail blocks ``[E, E2)``, padding up to the widest head, then the partial
    last block (context only, never a candidate)."""
    h, bs = prev.num_kv_heads, prev.block_size
    d = dims(caches[0][0])[3]
    num_layers = len(caches)
    e_old = prev.region_blocks
    n_tail = e_new - e_old
    p = prev.pages.to(torch.int64)  # [L, H]
    width = int(p.max()) + n_tail
    run = torch.nn.functional.pad(prev.page_ids.to(torch.int64), (0, max(0, width - prev.page_ids.shape[2])))
    run = run[:, :, :width]
    tail = blocks[e_old:e_new].view(1, 1, -1) * h + torch.arange(h).view(1, -1, 1)  # [1, H, n_tail]
    j = torch.arange(width).view(1, 1, -1)
    tail_idx = (j - p.unsqueeze(-1)).clamp(0, max(0, n_tail - 1))
    src = torch.where(j < p.unsqueeze(-1), run, torch.gather(tail.expand(num_layers, -1, -1), 2, tail_idx))
    ids = src.reshape(num_layers, -1)  # [L, H * W]
    keys = _gather(caches, 0, ids, num_layers * h, width * bs)
    values = _gather(caches, 1, ids, num_layers * h, width * bs) if with_values else \
        keys.new_empty((num_layers * h, 0, d))
    n_part = num_tokens - e_new * bs
    tok = torch.arange(width * bs).view(1, 1, -1)
    run_tok = p.unsqueeze(-1) * bs  # [L, H, 1]
    kept_pos = torch.nn.functional.pad(prev.positions, (0, max(0, width * bs - prev.positions.shape[2])))
    kept_pos = kept_pos[:, :, : width * bs]
    pos = torch.where(tok < run_tok, kept_pos, e_old * bs + (tok - run_tok))  # [L, H, W*bs]
    n_cand = (p + n_tail) * bs
    valid = tok < n_cand.unsqueeze(-1)
    if n_part:
        part_ids = blocks[e_new] * h + torch.arange(h)
        pk = _gather(caches, 0, part_ids, num_layers * h, bs)[:, :n_part]
        keys = torch.cat([keys, pk], dim=1)
        if with_values:
            values = torch.cat([values, _gather(caches, 1, part_ids, num_layers * h, bs)[:, :n_part]], dim=1)
        part = torch.arange(e_new * bs, num_tokens).view(1, 1, -1).expand(num_layers, h, -1)
        pos = torch.cat([pos, part], dim=2)
        valid = torch.cat([valid, torch.ones_like(part, dtype=torch.bool)], dim=2)
    prior = None
    if with_prior and prev.carry is not None:
        carry = torch.nn.functional.pad(prev.carry, (0, max(0, width * bs - prev.carry.shape[2])))[:, :, : width * bs]
        prior = torch.where(tok < run_tok, carry, torch.zeros_like(carry)).reshape(num_layers * h, width * bs)
    inp = LayerInputs(keys=keys, values=values, region_len=width * bs, page_size=bs, layer_idx=layers[0],
                      num_layers=layers[1], scale=scale, queries=q_all, query_positions=query_positions,
                      positions=pos.reshape(num_layers * h, -1), prior=prior,
                      head_pages=(p + n_tail).reshape(-1), valid=valid.reshape(num_layers * h, -1),
                      window_end=num_tokens)  # every row ends with the tail: its context is the whole request
    return inp, [src[layer] for layer in range(num_layers)], (pos.reshape(num_layers * h, -1), n_cand)


def clear_moment_pages(caches: list[tuple[torch.Tensor, torch.Tensor]], layout: RequestLayout | None) -> None:
    """Zero a layout's moment pages in every layer (before their blocks go back to vLLM's pool)."""
    if layout is None or layout.moment_page_ids is None:
        return
    for layer, (kc, vc) in enumerate(caches):
        ops.clear_pages(kc, vc, layout.moment_page_ids[layer].to(torch.int64))


def apply_round(caches: list[tuple[torch.Tensor, torch.Tensor]], plan: RoundPlan) -> RequestLayout:
    """Move the bytes of a planned round, layer by layer: add the evicted tokens to the layer's moments
    (read where they still sit), compact the kept tokens, store the moments in their new pages. Returns
    the new layout."""
    return apply_rounds(caches, [plan])[0]


def apply_rounds(caches: list[tuple[torch.Tensor, torch.Tensor]], plans: list[RoundPlan]) -> list[RequestLayout]:
    """Move the bytes of the rounds of several requests due in the same step: per layer, every round's
    moments, then one compaction over all their moves, then every round's moment storage. No round writes
    what another reads (a round over blocks another request holds writes only its private blocks), so this
    equals applying them one after another. A failure leaves every round of the batch partly applied."""
    with on_device(caches[0][0]):
        for layer, (kc, vc) in enumerate(caches):
            stats = [_layer_moments(kc, vc, plan, layer, dequant_of(caches, layer)) for plan in plans]
            moves = [plan.layers[layer].moves for plan in plans]
            ops.compact(kc, vc, *(moves[0] if len(moves) == 1 else [torch.cat(m) for m in zip(*moves)]))
            for plan, st in zip(plans, stats):  # after the compaction: moment pages may have held source tokens
                if st is not None:
                    packed = mom_math.pack(mom_math.Moments(st["n"], st["sum_k"], st["sum_v"], st["sum_vk"]))
                    ops.store_moments(kc, vc, plan.layout.moment_page_ids[layer].to(torch.int64), packed)
    return [plan.layout for plan in plans]


def _layer_moments(kc, vc, plan: RoundPlan, layer: int, dequant=None) -> dict | None:
    """The layer's moments of the evicted set after this round (the previous round's, read from their
    pages, plus this round's evicted tokens, read where they still sit); None without moment pages."""
    layout, prev = plan.layout, plan.prev
    if layout.moment_page_ids is None:
        return None
    h, d = layout.num_kv_heads, dims(kc)[3]
    if prev is not None and prev.moment_page_ids is not None:
        old_ids = prev.moment_page_ids[layer].to(torch.int64)
        old = ops.load_moments(kc, vc, old_ids, h, d)
        stats = {k: v.clone().to(torch.float32) for k, v in old.items()}
        if not plan.fresh:  # their blocks may be freed now: no raw moment bits left in the pool
            ops.clear_pages(kc, vc, old_ids)
    else:
        stats = mom_math.Moments.zeros((h,), d).as_dict()
    ev_p, ev_o, ev_h = plan.layers[layer].evicted
    ops.accumulate_moments(kc, vc, ev_p, ev_o, ev_h, stats, dequant=dequant)
    return stats
