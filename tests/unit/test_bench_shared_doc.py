from benchmarks.shared_doc import build_document, grade, server_flags


def test_document_keeps_every_fact_in_order_and_every_passage_token():
    passage = list(range(100, 200))
    facts = [[1, 2], [3], [4, 5, 6]]
    doc = build_document(passage, facts)
    assert len(doc) == 100 + 6
    assert [t for t in doc if t >= 100] == passage
    pos = [doc.index(f[0]) for f in facts]
    assert pos == sorted(pos) and pos[0] > 0 and pos[-1] < len(doc) - 3


def test_grade_takes_the_first_four_digit_number_exactly():
    assert grade(" 4821.", "4821") and grade(" 4821 and 1234", "4821")
    assert not grade(" 1234, not 4821", "4821")
    assert not grade(" 48210", "4821") and not grade(" 482", "4821") and not grade(" none", "4821")


def test_configs_differ_only_in_eviction_and_prefix_caching():
    class O:
        block_size, pool, policy, budget = 32, 128, "snapkv", 128

    a = server_flags({"evict": False, "prefix": True}, O, 2400)
    b = server_flags({"evict": True, "prefix": True}, O, 2400)
    c = server_flags({"evict": True, "prefix": False}, O, 2400)
    d = server_flags({"evict": True, "prefix": True, "share": False}, O, 2400)
    assert "--enable-prefix-caching" in a and "--kv-eviction-policy" not in a
    assert b[: len(a)] == a and b[len(a):] == ["--kv-eviction-policy", "snapkv", "--kv-budget", "128"]
    assert "--no-enable-prefix-caching" in c
    assert d == b + ["--no-kv-share-contexts"]


def test_a_configuration_may_name_its_own_policy():
    from benchmarks.shared_doc import config_of

    class O:
        block_size, pool, policy, budget = 32, 128, "snapkv", 128

    assert config_of("stock_pc", O) == {"evict": False, "prefix": True}
    kz = config_of("evict_pc:kvzip", O)
    assert kz["policy"] == "kvzip" and config_of("evict_pc", O)["policy"] == "snapkv"
    flags = server_flags(kz, O, 2400)
    assert flags[flags.index("--kv-eviction-policy") + 1] == "kvzip"


def test_the_passkey_filler_keeps_every_fact_and_asks_for_each():
    from transformers import AutoTokenizer

    from benchmarks.shared_doc import workload
    from vllm_contour.models import fetch_model

    tok = AutoTokenizer.from_pretrained(str(fetch_model("smollm2", quiet=True)))
    doc, questions, rooms, codes = workload(tok, 4, 600, 0, filler="passkey")
    text = tok.decode(doc)
    assert abs(len(doc) - 600) <= 4 and "The grass is green." in text
    for r, c, q in zip(rooms, codes, questions):
        assert f"The pass key of the {r} room is {c}." in text and r in tok.decode(q)


def test_the_table_counts_each_configurations_reconstructions():
    from benchmarks.shared_doc import table

    run = {"ttft_first_s": 8.0, "ttft_rest_mean_s": 0.1, "ttft_rest_over_first": 0.01, "cached_tokens_rest_mean": 2000,
           "right": 7, "output_tok_s": 100.0, "peak_running": 16, "mean_running": 10.0, "preemptions": 6,
           "mean_kv_tokens": 228.0}
    record = {"codes": [1] * 16, "args": {"pool": 128},
              "runs": [dict(run, name="stock_pc", output_tok_s=50.0),
                       dict(run, name="evict_pc:kvzip", reconstructions=1.0, reconstruction_tokens=2288.0)]}
    md = table(record)
    assert "| reconstructions | reconstructed tokens |" in md
    assert "| evict_pc:kvzip | 128 | 8.00 | 0.10 | 0.01 | 2000 | 7/16 | 100.00 | 2.00 | 16 | 10.00 | 6 | 228.00 | 1.00 | 2288.00 |" in md
