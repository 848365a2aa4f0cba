"""KVzip's pieces in pure torch: the reconstruction chunks (token ids), the max attention over the context
keys against a direct loop, the scorer and the allocator's threshold across heads."""

import math

import pytest
import torch

from vllm_contour.policies import LayerInputs, build_policy
from vllm_contour.policies.allocators import KVzipAllocator
from vllm_contour.policies.base import LayerBudget
from vllm_contour.policies.scorers.kvzip import reconstruction_max
from vllm_contour.integration.reconstruction.prompt import RepeatPrompt, chunks

RP = RepeatPrompt(prefix=(1, 2, 3), first=(90, 91), later=(80, 81), suffix=(70,))


def test_chunks_repeat_the_context_after_the_template_prefix():
    ids = [1, 2, 3] + list(range(100, 110)) + [555, 556]  # prefix, context of 10, then the question
    out = chunks(ids, 13, RP, size=4, overlap=2)
    assert [c.span for c in out] == [(3, 7), (7, 11), (11, 13)]
    assert out[0].repeat == (90, 91, 70, 100, 101, 102, 103)
    assert out[1].repeat == (80, 81, 102, 103, 70, 104, 105, 106, 107)  # the previous chunk's last 2 tokens
    assert out[2].repeat == (80, 81, 106, 107, 70, 108, 109)
    # no template prefix in front: the context is repeated from token 0
    assert [c.span for c in chunks([9] + ids[1:], 13, RP, size=8)] == [(0, 8), (8, 13)]


def _direct(q, qpos, k, span, r, scale, sinks):
    """Per KV head, query head and query: softmax over [sinks, chunk, repeat keys up to the query]."""
    s, e = span
    h, _, d = k.shape
    g = q.shape[0] // h
    sink = min(sinks, s)
    out = torch.zeros(h, e - s, dtype=torch.float64)
    for hh in range(h):
        for gg in range(g):
            for i, p in enumerate(qpos.tolist()):
                cols = list(range(sink)) + list(range(s, e)) + list(range(r, p + 1))
                logits = torch.tensor([float(q[hh * g + gg, i].double() @ k[hh, c].double()) * scale for c in cols])
                w = torch.softmax(logits, 0)[sink:sink + e - s]
                out[hh] = torch.maximum(out[hh], w)
    return out


def test_a_sessions_next_chunk_is_repeated_alone_as_a_later_part():
    """A streaming-input session's appended tokens ``[start_at, C)``: repeated as a later part of the same
    context, starting with the tokens before them; the earlier context is not repeated again."""
    ids = list(range(100, 140))
    (only,) = chunks(ids, 40, RP, size=2048, overlap=8, start_at=25)
    assert only.span == (25, 40)
    assert list(only.repeat) == [80, 81] + ids[17:25] + [70] + ids[25:40]
    first, second = chunks(ids, 40, RP, size=10, overlap=4, start_at=25)
    assert first.span == (25, 35) and second.span == (35, 40)
    assert list(second.repeat) == [80, 81] + ids[31:35] + [70] + ids[35:40]


@pytest.mark.parametrize("span,slice_size", [((0, 12), 256), ((6, 15), 3)])
def test_reconstruction_max_equals_a_direct_loop(span, slice_size):
    g = torch.Generator().manual_seed(0)
    h, hq, d, c, n = 2, 6, 8, 20, 9
    k = torch.randn(h, c + n + 2, d, generator=g)
    q = torch.randn(hq, n - 2, d, generator=g)  # the step computes repeat tokens 2..n-1 (chunked prefill)
    qpos = torch.arange(c + 2, c + n)
    got = reconstruction_max(q, qpos, k, span, c, 1 / math.sqrt(d), sinks=4, slice_size=slice_size)
    want = _direct(q, qpos, k, span, c, 1 / math.sqrt(d), 4)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


def test_kvzip_scorer_reads_the_reconstruction_and_refuses_without_it():
    h, t, page = 2, 64, 16
    keys = torch.randn(h, t, 4)
    recon = torch.rand(h, t)
    inp = LayerInputs(keys=keys, values=keys[:, :0], region_len=48, page_size=page, layer_idx=0, num_layers=1,
                      scale=0.5, reconstruction=recon)
    pol = build_policy("kvzip", sink_tokens=0, recent_window=0)
    assert pol.needs_reconstruction and not pol.needs_queries and not pol.needs_values
    sel = pol.plan_layer(inp, 3)
    pages = torch.tensor([k.numel() // page for k in sel.kept])
    assert int(pages.sum()) == 3 and torch.equal(pages, KVzipAllocator().allocate(
        recon[:, :48], inp, LayerBudget(total_pages=3, floor_pages=1)))
    for hh in range(h):  # each head keeps its best-scored tokens
        want = torch.topk(recon[hh, :48], sel.kept[hh].numel()).indices.sort().values
        assert torch.equal(sel.kept[hh], want)
    with pytest.raises(ValueError, match="reconstruction"):
        pol.plan_layer(LayerInputs(keys=keys, values=keys[:, :0], region_len=48, page_size=page, layer_idx=0,
                                   num_layers=1, scale=0.5), 3)


def test_kvzip_allocation_does_not_normalise_heads():
    """AdaKV normalises each head to a distribution; KVzip's threshold is on the raw scores: a head whose
    scores are all small gets the floor, however they are spread."""
    h, page = 2, 4
    s = torch.cat([torch.full((1, 32), 0.001), torch.linspace(0.1, 0.9, 32).view(1, -1)])
    s[0, 0] = 0.0011  # head 0: one token above its own flat rest
    inp = LayerInputs(keys=torch.zeros(h, 32, 1), values=torch.zeros(h, 0, 1), region_len=32, page_size=page,
                      layer_idx=0, num_layers=1, scale=1.0)
    b = LayerBudget(total_pages=8, floor_pages=1)
    assert KVzipAllocator().allocate(s, inp, b).tolist() == [1, 7]
    from vllm_contour.policies.allocators import AdaKVAllocator

    assert AdaKVAllocator().allocate(s, inp, b).tolist() != [1, 7]


def test_hidden_requests_fit_max_model_len_or_the_reconstruction_is_refused_naming_it():
    """A hidden request holds the context, a chunk's repeat ids and one sampled token: its chunks shrink to
    fit ``max_model_len`` (vLLM's input batch is sized by it; a longer prompt would break the engine's
    step); a context that leaves fewer than ``MIN_CHUNK`` tokens is refused with an error naming it."""
    from types import SimpleNamespace

    import pytest

    from vllm_contour.integration.reconstruction.scheduler import MIN_CHUNK, Reconstructions

    ids = list(range(1000, 3000))
    owner = SimpleNamespace(request_id="o", all_token_ids=ids, client_index=0, lora_request=None, cache_salt=None,
                            priority=0, _block_hasher=None)
    recon = Reconstructions(32, lambda: RP, max_model_len=2343)
    n = recon.start(SimpleNamespace(request=owner, epoch=1), 2000)
    hidden = recon.take_new()
    assert n == len(hidden) > 1
    assert all(len(r.prompt_token_ids) + 1 <= 2343 for r in hidden)
    spans = [recon.companions[r.request_id].span for r in hidden]
    assert spans[0][0] == 0 and spans[-1][1] == 2000 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    tight = Reconstructions(32, lambda: RP, max_model_len=2000 + MIN_CHUNK)
    with pytest.raises(ValueError, match="max_model_len 2032"):
        tight.start(SimpleNamespace(request=owner, epoch=1), 2000)
    assert not tight.waiting and not tight.take_new()


def _request(rid, ids, salt=None, lora=None):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=rid, all_token_ids=ids, client_index=0, lora_request=lora, cache_salt=salt,
                           priority=0, _block_hasher=None)


def test_kept_scores_are_found_by_the_context_and_bounded():
    """A context's scores are kept under its tokens, cache salt and LoRA adapter: another request with the same
    first C tokens finds them (whatever follows C), a different token, salt, adapter or C does not; past
    ``KEPT_SCORES`` the least recently used key is named for the workers to drop; reset drops every key."""
    from types import SimpleNamespace

    from vllm_contour.integration.reconstruction.scheduler import KEPT_SCORES, Reconstructions, context_key

    ids = list(range(100, 400))
    recon = Reconstructions(32, lambda: RP)
    recon.start(SimpleNamespace(request=_request("a", ids), epoch=0), 256, key=context_key(_request("a", ids), 256))
    key = recon.waiting["a"].key
    assert key == context_key(_request("x", ids), 256)
    assert not recon.kept_scores(context_key(_request("b", ids[:256] + [7, 8]), 256))  # not yet
    recon.keep_scores(key)
    assert context_key(_request("b", ids[:256] + [7, 8]), 256) == key and recon.kept_scores(key)
    for other in (_request("c", ids[:255] + [1] + ids[256:]), _request("d", ids, salt="t2"),
                  _request("e", ids, lora=SimpleNamespace(lora_int_id=3))):
        assert not recon.kept_scores(context_key(other, 256))
    assert not recon.kept_scores(context_key(_request("f", ids), 255))
    # a streaming-input session's later chunk (start_at > 0) keeps nothing under a key
    recon.start(SimpleNamespace(request=_request("s", ids), epoch=0), 300, start_at=256, key=key)
    assert recon.waiting["s"].key is None
    keys = [context_key(_request("k", [i] + ids), 256) for i in range(KEPT_SCORES)]
    for k in keys[:-1]:
        recon.keep_scores(k)
    assert recon.take_dropped_scores() == []
    assert recon.kept_scores(context_key(_request("b", ids), 256))  # the oldest key, used again: kept
    recon.keep_scores(keys[-1])
    assert recon.take_dropped_scores() == [keys[0]]  # the least recently used, not the first key
    assert key in recon.scored and len(recon.scored) == KEPT_SCORES
    recon.drop_all_scores()
    assert sorted(recon.take_dropped_scores()) == sorted([key] + keys[1:]) and not recon.scored


def test_the_worker_keeps_a_context_s_scores_and_gives_a_copy_to_a_later_request():
    """``ContextScores.for_round``: the owner's round with ``store`` keeps a copy under the key; a later
    request's round gets its own copy (a later streaming chunk folds in place, never into the kept scores); a
    key the worker does not hold is an error (that request is served densely)."""
    import pytest
    import torch

    from vllm_contour.integration.messages import RoundItem, ScoresRef
    from vllm_contour.integration.reconstruction.worker import ContextScores

    cs = ContextScores()
    own = torch.rand(2, 3, 40)
    cs.held["a"] = (1, own)
    item = lambda rid, ref: RoundItem(rid, [], 40, None, None, 1, scores=ref)  # noqa: E731
    assert cs.for_round(item("a", ScoresRef("K", 1, store=True))) is own
    assert torch.equal(cs.kept["K"], own) and cs.kept["K"] is not own
    got = cs.for_round(item("b", ScoresRef("K", 5, store=False)))
    assert torch.equal(got, own) and got is not cs.kept["K"] and cs.held["b"][0] == 5
    got.zero_()
    assert torch.equal(cs.kept["K"], own)
    with pytest.raises(ValueError, match="not on this worker"):
        cs.for_round(item("c", ScoresRef("other", 0, store=False)))
    assert cs.for_round(item("d", None)) is None


def test_a_reconstruction_on_a_vllm_whose_hooks_changed_serves_its_request_densely(monkeypatch):
    """KVzip's component checks the hooks its hidden requests need when the first one would start: on a vLLM
    where they changed, the request's round is not started, the request is served without eviction, and the
    failure is counted under ``reconstruction`` naming the hook; other requests are untouched."""
    from types import SimpleNamespace

    from vllm_contour.integration.reconstruction import scheduler as rs
    from vllm_contour.integration.scheduler.events import SchedulerEvents

    monkeypatch.setattr(rs, "_HOOKS_OK", None)
    from vllm_contour.integration import vllm_hooks

    monkeypatch.setattr(vllm_hooks, "feature_refusal",
                        lambda feature: "reconstruction needs vLLM hooks that differ on vLLM 9: Request.__init__")
    events = SchedulerEvents()
    recon = rs.Reconstructions(32, lambda: RP, max_model_len=4096)
    comp = rs.ContextRounds(recon, SimpleNamespace(block_size=32), events)
    t = SimpleNamespace(request=_request("k", list(range(2000))), epoch=1, compacted=False, region_blocks=0,
                        params=object())
    comp.round_due(t, 1500, [], lambda *a: pytest.fail("no round without scores"))
    assert t.params is None and not recon.waiting and not recon.take_new()
    assert events.totals.failures == {"reconstruction": 1}
