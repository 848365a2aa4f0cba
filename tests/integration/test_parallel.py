"""Eviction under vLLM's tensor parallelism (TP=2, multiprocess executor, CPU): each rank evicts its own KV
heads, at the prompt end and in decode-time rounds; the scheduler merges the ranks' reports (a block is
freed only when every rank freed it, a private block kept when any rank wrote into it) and decoding matches
one rank. The model is derived from SmolLM2's trained weights (conftest.py: 2 KV heads, one per rank), the
server's policy SnapKV: query-aware and content-dependent, so each rank scores its own head with its own
window queries and the heads keep different tokens."""


def test_tensor_parallel_eviction_matches_one_rank(tiny_tp1, tiny_tp2):
    one, two = tiny_tp1["parallel"], tiny_tp2["parallel"]
    assert "ContourKVConnector" == tiny_tp2["connector"]
    assert "ranks disagree" not in tiny_tp2["log"]
    # every request finished with its 120 tokens on both engines, after several decode-time rounds
    assert all(v is not None and len(v) == 120 for v in two["tokens"].values()), two["tokens"]
    assert two["rounds"] == one["rounds"] >= 2 * 3 * 3
    assert two["request_rounds"] == one["request_rounds"]
    # nothing evicted (budget above the prompt): TP=2 decodes exactly as one rank does
    keep = [k for k in one["tokens"] if k.endswith("keep")]
    assert [two["tokens"][k] for k in keep] == [one["tokens"][k] for k in keep]
    # evicted to 64 tokens per head every 32 tokens, SnapKV (the server's) and StreamingLLM: same tokens, same
    # blocks freed
    evict = [k for k in one["tokens"] if k.endswith(("evict", "stream"))]
    assert len(evict) == 6
    assert {k: two["tokens"][k] for k in evict} == {k: one["tokens"][k] for k in evict}
    assert two["reports"] == one["reports"]  # (K, E, freed) of each request's last round, merged over ranks
    assert all(one["reports"][k][2] > 0 for k in evict), one["reports"]
    assert two["freed_blocks"] == one["freed_blocks"] > 0
    # the policy looked at the content (one rank, where the worker is in-process): SnapKV's two heads keep
    # different tokens in some layer and not the recency window StreamingLLM keeps in every head
    snap = [k for k in evict if k.endswith("evict")]
    for k in snap:
        kept, stream = one["kept"][k], one["kept"][k.replace("evict", "stream")]
        assert any(heads[0] != heads[1] for heads in kept), k
        assert all(heads[0] == heads[1] for heads in stream), k
        assert kept != stream, k
    # prefix caching on: the rounds over hashed blocks packed into private blocks, merged over the ranks
    assert two["private_blocks"] == one["private_blocks"] > 0
    # everything returned to vLLM's pool at the end
    assert two["free_end"] == two["free_before"] and one["free_end"] == one["free_before"]


def test_tensor_parallel_on_model_runner_v2_equals_v1s(tiny_tp2, tiny_tp2_mrv2):
    """TP=2 with both workers on Model Runner V2 (each builds a step's metadata before its connector sees the
    step): the same tokens, rounds, merged reports, blocks freed and private blocks as TP=2 on V1, and
    everything back in vLLM's pool."""
    one, two = tiny_tp2["parallel"], tiny_tp2_mrv2["parallel"]
    assert "Using V2 Model Runner" in tiny_tp2_mrv2["log"] and "Using V2 Model Runner" not in tiny_tp2["log"]
    assert "ranks disagree" not in tiny_tp2_mrv2["log"] and tiny_tp2_mrv2["connector"] == "ContourKVConnector"
    for key in ("tokens", "rounds", "request_rounds", "reports", "freed_blocks", "private_blocks", "free_before",
                "free_end"):
        assert two[key] == one[key], key
    assert two["rounds"] >= 2 * 3 * 3 and two["free_end"] == two["free_before"]
