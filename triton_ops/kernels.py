"""Triton kernels of vllm-contour's ops: compaction (two launches through a temporary, so moves may overlap;
the same gather / scatter move whole head-pages for moment storage), moment accumulation and ragged
paged attention (split over segments of each page list when the batch is small). Caches are
``[num_blocks, H, bs, D]`` views with arbitrary strides (head-page id = block * H + lane); every kernel
takes the four strides of each cache. Arithmetic in fp32: bf16 / fp16 caches are loaded and cast
in-kernel (also what the CPU interpreter needs: it has no bf16 arithmetic). Compaction moves raw bits
(the launcher views the caches as same-width integers).
"""

import triton
import triton.language as tl


@triton.jit
def compact_gather_kernel(k_ptr, v_ptr, tmp_ptr, page_ptr, off_ptr, M, H, D,
                          ks0, ks1, ks2, ks3, vs0, vs1, vs2, vs3,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """tmp[0, i] = K[src i], tmp[1, i] = V[src i] (tmp contiguous [2, M, D])."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    page = tl.load(page_ptr + rows, mask=rmask, other=0).to(tl.int64)
    off = tl.load(off_ptr + rows, mask=rmask, other=0).to(tl.int64)
    blk = page // H
    lane = page % H
    cols = tl.arange(0, BLOCK_D).to(tl.int64)
    m = rmask[:, None] & (cols[None, :] < D)
    dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
    kx = tl.load(k_ptr + (blk * ks0 + lane * ks1 + off * ks2)[:, None] + cols[None, :] * ks3, mask=m)
    tl.store(tmp_ptr + dst, kx, mask=m)
    vx = tl.load(v_ptr + (blk * vs0 + lane * vs1 + off * vs2)[:, None] + cols[None, :] * vs3, mask=m)
    tl.store(tmp_ptr + M.to(tl.int64) * D + dst, vx, mask=m)


@triton.jit
def compact_scatter_kernel(k_ptr, v_ptr, tmp_ptr, page_ptr, off_ptr, M, H, D,
                           ks0, ks1, ks2, ks3, vs0, vs1, vs2, vs3,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """K[dst i] = tmp[0, i], V[dst i] = tmp[1, i]."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    page = tl.load(page_ptr + rows, mask=rmask, other=0).to(tl.int64)
    off = tl.load(off_ptr + rows, mask=rmask, other=0).to(tl.int64)
    blk = page // H
    lane = page % H
    cols = tl.arange(0, BLOCK_D).to(tl.int64)
    m = rmask[:, None] & (cols[None, :] < D)
    src = rows.to(tl.int64)[:, None] * D + cols[None, :]
    kx = tl.load(tmp_ptr + src, mask=m)
    tl.store(k_ptr + (blk * ks0 + lane * ks1 + off * ks2)[:, None] + cols[None, :] * ks3, kx, mask=m)
    vx = tl.load(tmp_ptr + M.to(tl.int64) * D + src, mask=m)
    tl.store(v_ptr + (blk * vs0 + lane * vs1 + off * vs2)[:, None] + cols[None, :] * vs3, vx, mask=m)


@triton.jit
def accumulate_moments_kernel(k_ptr, v_ptr, page_ptr, off_ptr, order_ptr, seg_ptr,
                              n_ptr, sk_ptr, sv_ptr, svk_ptr, H, D,
                              ks0, ks1, ks2, ks3, vs0, vs1, vs2, vs3,
                              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (head h, token chunk c, row tile r): the chunk's tokens of head h (``order`` sorted by head,
    ``seg [Hm + 1]`` segment starts) add ``V[:, rows]^T K`` to ``sum_vk[h, rows]`` (fp32 atomics), their
    value rows to ``sum_v``; row tile 0 also adds the count and ``sum_k``. Moments contiguous fp32."""
    h = tl.program_id(0)
    c = tl.program_id(1)
    r = tl.program_id(2)
    start = tl.load(seg_ptr + h)
    end = tl.load(seg_ptr + h + 1)
    t0 = start + c * BLOCK_N
    if t0 < end:
        idx = t0 + tl.arange(0, BLOCK_N)
        tm = idx < end
        tok = tl.load(order_ptr + idx, mask=tm, other=0)
        page = tl.load(page_ptr + tok, mask=tm, other=0).to(tl.int64)
        off = tl.load(off_ptr + tok, mask=tm, other=0).to(tl.int64)
        blk = page // H
        lane = page % H
        cols = tl.arange(0, BLOCK_D)
        cm = cols < D
        k = tl.load(k_ptr + (blk * ks0 + lane * ks1 + off * ks2)[:, None] + cols.to(tl.int64)[None, :] * ks3,
                    mask=tm[:, None] & cm[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        rows = r * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = rows < D
        v = tl.load(v_ptr + (blk * vs0 + lane * vs1 + off * vs2)[:, None] + rows.to(tl.int64)[None, :] * vs3,
                    mask=tm[:, None] & rm[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
        hD = h.to(tl.int64) * D
        svk = tl.dot(tl.trans(v), k, input_precision="ieee")  # [BLOCK_R, BLOCK_D]
        tl.atomic_add(svk_ptr + hD * D + rows[:, None] * D + cols[None, :], svk, mask=rm[:, None] & cm[None, :])
        tl.atomic_add(sv_ptr + hD + rows, tl.sum(v, axis=0), mask=rm)
        if r == 0:
            tl.atomic_add(sk_ptr + hD + cols, tl.sum(k, axis=0), mask=cm)
            tl.atomic_add(n_ptr + h, tl.sum(tm.to(tl.float32), axis=0))


@triton.jit
def _finish_row(acc, m_i, l_i, q, q_base, qrow, qs1, qs2, gm, ds, dm, mom_i, n_ptr, sk_ptr, sv_ptr, svk_ptr,
                D, scale, HAS_MOMENTS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_E: tl.constexpr):
    """Normalise one (row, KV head)'s online-softmax state and mix in the evicted part's moments
    (``vllm_contour.moments.merge_evicted``). ``q`` is the scaled fp32 query group ``[BLOCK_G, BLOCK_D]``."""
    has = l_i > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    if HAS_MOMENTS:
        cnt = tl.load(n_ptr + mom_i)
        cnt_c = tl.maximum(cnt, 1.0)
        mom = mom_i.to(tl.int64) * D
        sk = tl.load(sk_ptr + mom + ds, mask=dm, other=0.0)
        sv = tl.load(sv_ptr + mom + ds, mask=dm, other=0.0)
        mu_q = tl.sum(q * sk[None, :], axis=1) / cnt_c  # scale * q . mu   [BLOCK_G]
        # scale * sum_vk q, tiled over the key dim e
        sq = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for e0 in range(0, BLOCK_D, BLOCK_E):
            es = e0 + tl.arange(0, BLOCK_E)
            em = es < D
            qe = tl.load(q_base + qrow.to(tl.int64)[:, None] * qs1 + es.to(tl.int64)[None, :] * qs2,
                         mask=gm[:, None] & em[None, :], other=0.0).to(tl.float32) * scale  # [BLOCK_G, BLOCK_E]
            w = tl.load(svk_ptr + mom * D + ds[:, None] * D + es[None, :], mask=dm[:, None] & em[None, :],
                        other=0.0)  # [BLOCK_D, BLOCK_E]
            sq += tl.sum(qe[:, None, :] * w[None, :, :], axis=2)
        f_e = (sv[None, :] + sq - sv[None, :] * mu_q[:, None]) / cnt_c
        log_ze = tl.log(cnt_c) + mu_q
        w_r = tl.where(has, 1.0 / (1.0 + tl.exp(log_ze - lse)), 0.0)
        w_r = tl.where(cnt > 0.0, w_r, 1.0)
        out = w_r[:, None] * out + (1.0 - w_r[:, None]) * f_e
        mx = tl.maximum(lse, log_ze)
        mixed_lse = mx + tl.log(1.0 + tl.exp(-tl.abs(lse - log_ze)))
        mixed_lse = tl.where(has, mixed_lse, log_ze)
        lse = tl.where(cnt > 0.0, mixed_lse, lse)
    return out, lse


@triton.jit
def _load_q(q_ptr, t, h, G, D, scale, qs0, qs1, qs2, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    gs = tl.arange(0, BLOCK_G)
    gm = gs < G
    ds = tl.arange(0, BLOCK_D)
    dm = ds < D
    qrow = h * G + gs  # query heads of this KV head's group
    q_base = q_ptr + t.to(tl.int64) * qs0
    q = tl.load(q_base + qrow.to(tl.int64)[:, None] * qs1 + ds.to(tl.int64)[None, :] * qs2,
                mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32) * scale  # [BLOCK_G, BLOCK_D]
    return q, q_base, qrow, gs, gm, ds, dm


@triton.jit
def _list_of(t, h, H, BS, sl_ptr, sls0, sls1, pt_ptr, pts0, pts1, tslot_ptr, trow_ptr, tpos_ptr, rc_ptr, rcs0, rcs1,
             reg_ptr, bt_ptr, bts0, TWO_PART: tl.constexpr):
    """Where row t's list for KV head h is: ``(live, L, table base, run pages, E, block-table row, moment
    index)``. A per-row table (``pt [T, H, P]``, lengths ``sl [T, H]``), or TWO_PART: token t of a compacted
    request in slot ``tslot[t]`` (-1: not one, nothing written) reads that slot's kept run (``pt [S, H, P]``,
    ``rc [S, H]`` pages) and then its blocks from ``E = reg[slot]`` on in vLLM's block table (``bt [B, W]``,
    row ``trow[t]``), up to its own position ``tpos[t]``."""
    if TWO_PART:
        slot = tl.load(tslot_ptr + t)
        live = slot >= 0
        sc = tl.maximum(slot, 0).to(tl.int64)
        rc = tl.load(rc_ptr + sc * rcs0 + h * rcs1)
        e = tl.load(reg_ptr + sc)
        pos = tl.load(tpos_ptr + t)
        L = tl.where(live, rc * BS + pos + 1 - e * BS, 0)
        base = pt_ptr + sc * pts0 + h * pts1
        bt_base = bt_ptr + tl.load(trow_ptr + t).to(tl.int64) * bts0
        mom_i = sc * H + h
    else:
        live = t * 0 == 0  # every row
        L = tl.load(sl_ptr + t.to(tl.int64) * sls0 + h * sls1).to(tl.int32)
        base = pt_ptr + t.to(tl.int64) * pts0 + h * pts1
        rc = L
        e = 0
        bt_base = bt_ptr
        mom_i = t.to(tl.int64) * H + h
    return live, L, base, rc, e, bt_base, mom_i


@triton.jit
def ragged_decode_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, sl_ptr, out_ptr, lse_ptr,
                         n_ptr, sk_ptr, sv_ptr, svk_ptr, seg_acc_ptr, seg_ml_ptr,
                         tslot_ptr, trow_ptr, tpos_ptr, rc_ptr, reg_ptr, bt_ptr,
                         H, G, D, BS, scale,
                         qs0, qs1, qs2, ks0, ks1, ks2, ks3, vs0, vs1, vs2, vs3, pts0, pts1, pts2, sls0, sls1,
                         os0, os1, rcs0, rcs1, bts0, bts1,
                         HAS_MOMENTS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, NATIVE_DOT: tl.constexpr, ONE_PAGE: tl.constexpr,
                         TWO_PART: tl.constexpr):
    """Program (row t, KV head h, segment s): online softmax over the s-th slice of the head's page list
    (``_list_of``) in chunks of ``BLOCK_N`` tokens (``ONE_PAGE``: a chunk is one page, else every token looks
    up its page), the ``G`` query heads of the group at once (``tl.dot``, the group padded to
    ``BLOCK_G >= 16`` rows). Dots: ``NATIVE_DOT`` (16-bit caches on a GPU) in the cache dtype with fp32
    accumulation, like vLLM's kernel; else fp32 operands at ``DOT_PRECISION`` ("ieee" for fp32 caches; the
    interpreter's path). With ``SPLIT`` (``S = grid[1]`` segments) each program writes its partial state
    ``(acc, m, l)`` to the segment scratch and ``ragged_reduce_kernel`` merges them; otherwise it finishes
    the row itself. ``out [T, Hq, D]`` (strides ``os0``, ``os1``; any float dtype) / ``lse [T, Hq]`` fp32;
    moments contiguous fp32 ``[T or S, H, ...]``."""
    th = tl.program_id(0)
    s = tl.program_id(1)
    t = th // H
    h = th % H
    live, L, pt_base, rc, e, bt_base, mom_i = _list_of(t, h, H, BS, sl_ptr, sls0, sls1, pt_ptr, pts0, pts1,
                                                      tslot_ptr, trow_ptr, tpos_ptr, rc_ptr, rcs0, rcs1,
                                                      reg_ptr, bt_ptr, bts0, TWO_PART)
    q, q_base, qrow, gs, gm, ds, dm = _load_q(q_ptr, t, h, G, D, scale, qs0, qs1, qs2, BLOCK_G, BLOCK_D)
    if SPLIT:
        n_seg = tl.num_programs(1)
        seg = tl.cdiv(tl.cdiv(L, n_seg), BLOCK_N) * BLOCK_N
        lo = s * seg
        hi = tl.minimum(L, lo + seg)
    else:
        lo = 0
        hi = L
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    q_dot = q.to(k_ptr.dtype.element_ty) if NATIVE_DOT else q
    for i0 in range(lo, hi, BLOCK_N):
        js = i0 + tl.arange(0, BLOCK_N)
        jm = js < hi
        off = (js % BS).to(tl.int64)
        if ONE_PAGE:  # chunks are whole pages (BLOCK_N == BS, segments page-aligned): one page id per chunk
            pi = (i0 // BS).to(tl.int64)
            if TWO_PART:  # the kept run, then the dense tail's block in vLLM's table (lane = head)
                in_run = pi < rc
                page = tl.where(in_run, tl.load(pt_base + pi * pts2, mask=in_run, other=0).to(tl.int64),
                                tl.load(bt_base + (e + pi - rc) * bts1, mask=pi >= rc, other=0).to(tl.int64) * H + h)
            else:
                page = tl.load(pt_base + pi * pts2).to(tl.int64)
        else:  # a chunk may span pages: every token looks up its page
            pi = (js // BS).to(tl.int64)
            if TWO_PART:
                in_run = pi < rc
                page = tl.where(in_run, tl.load(pt_base + pi * pts2, mask=jm & in_run, other=0).to(tl.int64),
                                tl.load(bt_base + (e + pi - rc) * bts1, mask=jm & (pi >= rc), other=0).to(tl.int64)
                                * H + h)
            else:
                page = tl.load(pt_base + pi * pts2, mask=jm, other=0).to(tl.int64)
        blk = page // H
        lane = page % H
        mk = jm[:, None] & dm[None, :]
        k = tl.load(k_ptr + (blk * ks0 + lane * ks1 + off * ks2)[:, None] + ds.to(tl.int64)[None, :] * ks3,
                    mask=mk, other=0.0)  # [BLOCK_N, BLOCK_D]
        if NATIVE_DOT:  # 16-bit operands, fp32 accumulation (as vLLM's kernel does)
            sc = tl.dot(q_dot, tl.trans(k))
        else:
            sc = tl.dot(q_dot, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        sc = tl.where(jm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (blk * vs0 + lane * vs1 + off * vs2)[:, None] + ds.to(tl.int64)[None, :] * vs3,
                    mask=mk, other=0.0)  # [BLOCK_N, BLOCK_D]
        if NATIVE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        m_i = m_new
    orow = th.to(tl.int64) * G + gs  # = t * Hq + query head
    wm = gm & (tl.zeros([BLOCK_G], tl.int32) + live.to(tl.int32) > 0)
    if SPLIT:
        n_seg = tl.num_programs(1)
        srow = orow * n_seg + s
        tl.store(seg_acc_ptr + srow[:, None] * D + ds[None, :], acc, mask=wm[:, None] & dm[None, :])
        tl.store(seg_ml_ptr + srow * 2, m_i, mask=wm)
        tl.store(seg_ml_ptr + srow * 2 + 1, l_i, mask=wm)
    else:
        out, lse = _finish_row(acc, m_i, l_i, q, q_base, qrow, qs1, qs2, gm, ds, dm, mom_i, n_ptr, sk_ptr, sv_ptr,
                               svk_ptr, D, scale, HAS_MOMENTS, BLOCK_G, BLOCK_D, BLOCK_E)
        o_ptr = out_ptr + t.to(tl.int64) * os0 + qrow.to(tl.int64)[:, None] * os1 + ds[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=wm[:, None] & dm[None, :])
        tl.store(lse_ptr + orow, lse, mask=wm)


@triton.jit
def ragged_reduce_kernel(q_ptr, out_ptr, lse_ptr, n_ptr, sk_ptr, sv_ptr, svk_ptr, seg_acc_ptr, seg_ml_ptr,
                         tslot_ptr, H, G, D, S, scale, qs0, qs1, qs2, os0, os1,
                         HAS_MOMENTS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_E: tl.constexpr, TWO_PART: tl.constexpr):
    """Program (row t, KV head h): merge the ``S`` segments' partial softmax states of the group's query
    heads, then finish the row (moments, log-sum-exp) like the unsplit kernel."""
    th = tl.program_id(0)
    t = th // H
    h = th % H
    if TWO_PART:
        slot = tl.load(tslot_ptr + t)
        live = slot >= 0
        mom_i = tl.maximum(slot, 0).to(tl.int64) * H + h
    else:
        live = t * 0 == 0
        mom_i = th.to(tl.int64)
    q, q_base, qrow, gs, gm, ds, dm = _load_q(q_ptr, t, h, G, D, scale, qs0, qs1, qs2, BLOCK_G, BLOCK_D)
    gm = gm & (tl.zeros([BLOCK_G], tl.int32) + live.to(tl.int32) > 0)
    orow = th.to(tl.int64) * G + gs
    m_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(0, S):
        m_max = tl.maximum(m_max, tl.load(seg_ml_ptr + (orow * S + s) * 2, mask=gm, other=float("-inf")))
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(0, S):
        srow = orow * S + s
        m_s = tl.load(seg_ml_ptr + srow * 2, mask=gm, other=float("-inf"))
        w = tl.exp(m_s - m_ref)
        l_i += w * tl.load(seg_ml_ptr + srow * 2 + 1, mask=gm, other=0.0)
        acc += w[:, None] * tl.load(seg_acc_ptr + srow[:, None] * D + ds[None, :], mask=gm[:, None] & dm[None, :],
                                    other=0.0)
    out, lse = _finish_row(acc, m_max, l_i, q, q_base, qrow, qs1, qs2, gm, ds, dm, mom_i, n_ptr, sk_ptr, sv_ptr,
                           svk_ptr, D, scale, HAS_MOMENTS, BLOCK_G, BLOCK_D, BLOCK_E)
    o_ptr = out_ptr + t.to(tl.int64) * os0 + qrow.to(tl.int64)[:, None] * os1 + ds[None, :]
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
    tl.store(lse_ptr + orow, lse, mask=gm)
