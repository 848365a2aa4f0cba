"""KVzap in pure torch (a scorer component, no preset: docs/results.md#kvzap-a-learned-kvzip-surrogate-not-a-preset): RoPE undone, the surrogate's per-(layer, head) models over the rows of several layers and
of a decode-time round, the fingerprint and the refusal of a surrogate for another model, and the training
command on a tiny slice of recorded data (no engine)."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from vllm_contour.policies import LayerInputs, ModelIdentity, Policy
from vllm_contour.policies.allocators import ContourAllocator
from vllm_contour.policies.selectors import TopKSelector
from vllm_contour.policies.policy import fold_heads
from vllm_contour.policies.scorers.kvzap import KVzapScorer, SurrogateNet, unrope
from vllm_contour.surrogate import fit as fitting
from vllm_contour.surrogate import store
from vllm_contour.surrogate.fingerprint import identify
from vllm_contour.surrogate.train import main as train_main

THETA = 10000.0


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = THETA) -> torch.Tensor:
    """Llama's neox RoPE, written out pair by pair (the reference the scorer undoes)."""
    d = x.shape[-1]
    out = torch.empty_like(x, dtype=torch.float64)
    for i in range(d // 2):
        a = pos.to(torch.float64) * theta ** (-2 * i / d)
        x1, x2 = x[..., i].double(), x[..., i + d // 2].double()
        out[..., i] = x1 * torch.cos(a) - x2 * torch.sin(a)
        out[..., i + d // 2] = x2 * torch.cos(a) + x1 * torch.sin(a)
    return out.to(torch.float32)


def make_net(layers=3, heads=2, d=8, hidden=4, seed=0, fingerprint="f00d") -> SurrogateNet:
    g = torch.Generator().manual_seed(seed)
    f, m = 2 * d, max(hidden, 1)  # hidden 0: linear
    return SurrogateNet("tiny", fingerprint, THETA, mean=torch.randn(layers, heads, f, generator=g),
                        std=torch.rand(layers, heads, f, generator=g) + 0.5,
                        w1=torch.randn(layers, heads, f, m, generator=g), b1=torch.randn(layers, heads, m, generator=g),
                        w2=torch.randn(layers, heads, hidden, generator=g), b2=torch.randn(layers, heads, generator=g))


def direct(net: SurrogateNet, layer: int, head: int, k_pre: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One (layer, head)'s MLP on one token, written out."""
    x = (torch.cat([k_pre, v]) - net.mean[layer, head]) / net.std[layer, head]
    hid = torch.nn.functional.gelu(x @ net.w1[layer, head] + net.b1[layer, head])
    return hid @ net.w2[layer, head] + net.b2[layer, head]


def test_unrope_undoes_llamas_rope():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 50, 16, generator=g)
    pos = torch.randint(0, 4000, (3, 50), generator=g)
    assert torch.allclose(unrope(rope(x, pos), pos, THETA), x, atol=1e-4)
    assert not torch.allclose(unrope(rope(x, pos), pos, 2 * THETA), x, atol=1e-2)


def test_the_scorer_runs_each_rows_layer_and_head_model_and_ignores_where_a_token_sits():
    """Rows ``l * H + h`` of a two-layer input starting at layer 1 are scored by models (1 + l, h); the same
    pre-RoPE key at another position scores the same."""
    net = make_net()
    g = torch.Generator().manual_seed(2)
    h, t, d = 2, 40, 8
    k_pre, v = torch.randn(2 * h, t, d, generator=g), torch.randn(2 * h, t, d, generator=g)
    pos = torch.arange(t)
    inp = LayerInputs(keys=rope(k_pre, pos.expand(2 * h, -1)), values=v, region_len=32, page_size=8, layer_idx=1,
                      num_layers=3, scale=1.0)
    got = KVzapScorer(net=net).score(inp)
    assert got.shape == (2 * h, 32)
    for r in range(2 * h):
        for j in (0, 7, 31):
            want = math.exp(float(direct(net, 1 + r // h, r % h, k_pre[r, j], v[r, j])))
            assert got[r, j].item() == pytest.approx(want, rel=1e-4)
    shifted = LayerInputs(keys=rope(k_pre, (pos + 977).expand(2 * h, -1)), values=v, region_len=32, page_size=8,
                          layer_idx=1, num_layers=3, scale=1.0, positions=pos + 977)
    assert torch.allclose(KVzapScorer(net=net).score(shifted), got, rtol=1e-4)


def test_a_decode_time_round_scores_each_heads_own_tokens_as_a_prompt_round_does():
    """A ragged round (each head its own kept tokens, padded) gives every kept token the score it gets in the
    full prompt: the score is the token's own, whoever else is kept."""
    net = make_net(layers=1)
    g = torch.Generator().manual_seed(3)
    t, d = 64, 8
    k_pre, v = torch.randn(2, t, d, generator=g), torch.randn(2, t, d, generator=g)
    keys = rope(k_pre, torch.arange(t).expand(2, -1))
    full = KVzapScorer(net=net).score(LayerInputs(keys=keys, values=v, region_len=t, page_size=8, layer_idx=0,
                                                  num_layers=1, scale=1.0))
    kept = [torch.tensor(sorted(torch.randperm(t, generator=g)[:n].tolist())) for n in (16, 40)]
    heads = [LayerInputs(keys=keys[i:i + 1, k], values=v[i:i + 1, k], region_len=len(k), page_size=8, layer_idx=0,
                         num_layers=1, scale=1.0, positions=k) for i, k in enumerate(kept)]
    ragged = KVzapScorer(net=net).score(fold_heads(heads))
    for i, k in enumerate(kept):
        assert torch.allclose(ragged[i, :len(k)], full[i, k], rtol=1e-4)


def test_the_scorer_refuses_rows_it_has_no_model_for_and_scoring_unbound():
    net = make_net(layers=2, heads=2)
    inp = LayerInputs(keys=torch.randn(3, 16, 8), values=torch.randn(3, 16, 8), region_len=16, page_size=8,
                      layer_idx=0, num_layers=2, scale=1.0)
    with pytest.raises(ValueError, match="2 KV heads per layer; the round has 3 rows"):
        KVzapScorer(net=net).score(inp)
    late = LayerInputs(keys=torch.randn(2, 16, 8), values=torch.randn(2, 16, 8), region_len=16, page_size=8,
                       layer_idx=2, num_layers=3, scale=1.0)
    with pytest.raises(ValueError, match="covers 2 layers"):
        KVzapScorer(net=net).score(late)
    with pytest.raises(ValueError, match="none is bound"):
        KVzapScorer().score(late)


def tiny_model(folder, seed=0, dtype=torch.float32, layers=3):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": layers, "num_attention_heads": 2,
           "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 100, "rope_theta": THETA}
    (folder / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    tensors = {f"model.layers.{i}.self_attn.{p}_proj.weight": torch.randn(16, 16, generator=g).to(dtype)
               for i in range(layers) for p in ("k", "v", "q")}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_the_fingerprint_follows_the_weights_not_their_dtype(tmp_path):
    a = identify(str(tiny_model(tmp_path / "a")))
    assert a.name == "a" and len(a.fingerprint) == 16
    assert identify(str(tiny_model(tmp_path / "a16", dtype=torch.bfloat16))).fingerprint == a.fingerprint
    assert identify(str(tiny_model(tmp_path / "b", seed=1))).fingerprint != a.fingerprint


def test_a_surrogate_for_another_model_is_refused_naming_both(tmp_path):
    served = identify(str(tiny_model(tmp_path / "served")))
    other = identify(str(tiny_model(tmp_path / "other", seed=5)))
    net = make_net(fingerprint=other.fingerprint)
    net.model = other.name
    path = store.save(net, tmp_path / "s.pt")
    with pytest.raises(ValueError) as e:
        store.for_model(served, str(path))
    msg = str(e.value)
    assert "other" in msg and other.fingerprint in msg and "served" in msg and served.fingerprint in msg
    with pytest.raises(ValueError, match=f"no surrogate is shipped for model served \\(fingerprint {served.fingerprint}\\)"):
        store.for_model(served)
    assert store.for_model(other, str(path)).fingerprint == other.fingerprint
    pol = Policy("kvzap_contour", KVzapScorer(surrogate=str(path)), ContourAllocator(), TopKSelector())
    assert pol.binds_model
    with pytest.raises(ValueError, match="not on the served model served"):
        pol.bind_model(served)
    pol.bind_model(other)
    assert pol.scorer.net is not None


def test_every_shipped_surrogate_loads_and_names_its_model():
    assert store.shipped(), "the package ships no surrogate"
    for p in store.shipped():
        net = store.load(p)
        assert p.name == store.shipped_name(ModelIdentity(net.model, net.fingerprint))
        assert net.meta["spearman_mean"] > net.meta["knorm_spearman_mean"]


def record(folder, n_ctx, seed, net: SurrogateNet, tokens=48):
    """Recorded contexts whose scores are a known function (``net``) of each token's pre-RoPE key and value."""
    g = torch.Generator().manual_seed(seed)
    layers, heads, d = net.num_layers, net.num_kv_heads, net.head_dim
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(n_ctx):
        vocab = torch.randn(20, layers, heads, d, generator=g)  # layer 0's key: a function of the token
        toks = torch.randint(0, 20, (tokens,), generator=g)
        k_pre = vocab[toks].permute(1, 2, 0, 3) + torch.cat([torch.zeros(1, heads, tokens, d),
                                                              torch.randn(layers - 1, heads, tokens, d, generator=g)])
        v = torch.randn(layers, heads, tokens, d, generator=g)
        pos = torch.arange(tokens).expand(layers * heads, -1)
        keys = rope(k_pre.reshape(layers * heads, tokens, d), pos).view(layers, heads, tokens, d)
        feats = net.features(keys.reshape(layers * heads, tokens, d), v.reshape(layers * heads, tokens, d), pos)
        logs = net.predict(feats, torch.arange(layers).repeat_interleave(heads), torch.arange(heads).repeat(layers))
        scores = torch.sigmoid(logs.view(layers, heads, tokens) / 4)
        torch.save({"keys": keys.half(), "values": v.half(), "scores": scores, "tokens": toks}, folder / f"ctx{i}.pt")
        entries.append({"speech": f"s{i}", "holdout": i >= n_ctx - 2})
    (folder / "index.json").write_text(json.dumps(entries))


def test_the_training_command_fits_a_tiny_slice_and_ships_a_surrogate_tied_to_the_model(tmp_path, capsys):
    model = tiny_model(tmp_path / "tiny")
    truth = make_net(layers=3, heads=2, d=8, hidden=0, seed=7)  # scores: a sigmoid of a linear map
    record(tmp_path / "data", 8, 0, truth, tokens=128)
    out, rep = tmp_path / "s.pt", tmp_path / "rep.json"
    argv = ["train", "--model", str(model), "--data", str(tmp_path / "data"), "--out", str(out), "--report", str(rep),
            "--hidden", "16", "--epochs", "100", "--seed", "0", "--lr", "1e-2"]
    train_main(argv)
    r = json.loads(rep.read_text())
    assert r["holdout_contexts"] == 2 and r["train_contexts"] == 6
    assert r["rope_check"] < 1e-3
    assert len(r["spearman_per_layer"]) == 3
    assert r["spearman_mean"] > 0.8 and r["spearman_mean"] > r["knorm_spearman_mean"] + 0.3, r
    assert "held-out Spearman" in capsys.readouterr().out
    net = store.for_model(identify(str(model)), str(out))
    assert net.hidden == 16 and net.rope_theta == THETA
    again = tmp_path / "s2.pt"
    train_main(argv[:6] + [str(again)] + argv[7:])  # seeded: the same file's tensors
    a, b = store.load(out), store.load(again)
    assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("w1", "b1", "w2", "b2"))


def test_spearman_and_top_overlap():
    a = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    b = torch.tensor([[10.0, 20.0, 30.0, 40.0], [10.0, 20.0, 30.0, 40.0]])
    assert fitting.spearman(a, b).tolist() == pytest.approx([1.0, -1.0])
    assert fitting.top_overlap(a, b, 0.5).tolist() == pytest.approx([1.0, 0.0])
