"""Eviction under vLLM's tensor parallelism (TP=2, multiprocess executor, CPU): each rank evicts its own KV
heads, at the prompt end and in decode-time rounds; the scheduler merges the ranks' reports (a block is
freed only when every rank freed it, a private block kept when any rank wrote into it) and decoding matches
one rank."""


def test_tensor_parallel_eviction_matches_one_rank(tiny_tp1, tiny_tp2):
    one, two = tiny_tp1["parallel"], tiny_tp2["parallel"]
    assert "ContourKVConnector" == tiny_tp2["connector"]
    assert "ranks disagree" not in tiny_tp2["log"]
    # every request finished with its 120 tokens on both engines, after several decode-time rounds
    assert all(v is not None and len(v) == 120 for v in two["tokens"].values()), two["tokens"]
    assert two["rounds"] == one["rounds"] >= 3 * 3
    # nothing evicted (budget above the prompt): TP=2 decodes exactly as one rank does
    keep = [k for k in one["tokens"] if k.endswith("keep")]
    assert [two["tokens"][k] for k in keep] == [one["tokens"][k] for k in keep]
    # evicted to 64 tokens per head every 32 tokens (streaming, one head per rank at TP=2): same tokens,
    # same blocks freed
    evict = [k for k in one["tokens"] if k.endswith("evict")]
    assert [two["tokens"][k] for k in evict] == [one["tokens"][k] for k in evict]
    assert two["reports"] == one["reports"]  # (K, E, freed) of each request's last round, merged over ranks
    assert all(one["reports"][k][2] > 0 for k in evict), one["reports"]
    assert two["freed_blocks"] == one["freed_blocks"] > 0
    # prefix caching on: the rounds over hashed blocks packed into private blocks, merged over the ranks
    assert two["private_blocks"] == one["private_blocks"] > 0
    # everything returned to vLLM's pool at the end
    assert two["free_end"] == two["free_before"] and one["free_end"] == one["free_before"]
