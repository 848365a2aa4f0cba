"""Triton kernels of vllm-contour's three ops. Caches are ``[num_blocks, H, bs, D]`` views with arbitrary
strides (head-page id = block * H + lane); every kernel takes the four strides of each cache. Arithmetic
in fp32: bf16 / fp16 caches are loaded and cast in-kernel (also what the CPU interpreter needs: it has no
bf16 arithmetic). Compaction moves raw bits (the launcher views the caches as same-width integers).
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
def ragged_decode_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, sl_ptr, out_ptr, lse_ptr,
                         n_ptr, sk_ptr, sv_ptr, svk_ptr,
                         H, G, D, BS, scale,
                         qs0, qs1, qs2, ks0, ks1, ks2, ks3, vs0, vs1, vs2, vs3, pts0, pts1, pts2, sls0, sls1,
                         HAS_MOMENTS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program (token t, KV head h): online softmax over the head's page list in chunks of ``BLOCK_N``
    tokens (a chunk may span pages: every token looks up its page), the ``G`` query heads of the group
    at once. ``out [T, Hq, D]`` / ``lse [T, Hq]`` fp32 contiguous; moments contiguous fp32 ``[T, H, ...]``
    (``vllm_contour.moments.merge_evicted``, fused)."""
    th = tl.program_id(0)
    t = th // H
    h = th % H
    L = tl.load(sl_ptr + t.to(tl.int64) * sls0 + h * sls1).to(tl.int32)
    gs = tl.arange(0, BLOCK_G)
    gm = gs < G
    ds = tl.arange(0, BLOCK_D)
    dm = ds < D
    qrow = h * G + gs  # query heads of this group
    q_base = q_ptr + t.to(tl.int64) * qs0
    q = tl.load(q_base + qrow.to(tl.int64)[:, None] * qs1 + ds.to(tl.int64)[None, :] * qs2,
                mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32) * scale  # [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    pt_base = pt_ptr + t.to(tl.int64) * pts0 + h * pts1
    for i0 in range(0, L, BLOCK_N):
        js = i0 + tl.arange(0, BLOCK_N)
        jm = js < L
        page = tl.load(pt_base + (js // BS).to(tl.int64) * pts2, mask=jm, other=0).to(tl.int64)
        off = (js % BS).to(tl.int64)
        blk = page // H
        lane = page % H
        mk = jm[:, None] & dm[None, :]
        k = tl.load(k_ptr + (blk * ks0 + lane * ks1 + off * ks2)[:, None] + ds.to(tl.int64)[None, :] * ks3,
                    mask=mk, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
        s = tl.where(jm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (blk * vs0 + lane * vs1 + off * vs2)[:, None] + ds.to(tl.int64)[None, :] * vs3,
                    mask=mk, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    has = l_i > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    if HAS_MOMENTS:
        cnt = tl.load(n_ptr + th)
        cnt_c = tl.maximum(cnt, 1.0)
        mom = th.to(tl.int64) * D
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
    orow = th.to(tl.int64) * G + gs
    tl.store(out_ptr + orow[:, None] * D + ds[None, :], out, mask=gm[:, None] & dm[None, :])
    tl.store(lse_ptr + orow, lse, mask=gm)
