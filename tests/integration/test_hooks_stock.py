"""A hook that fails never breaks stock vLLM: an offline engine on a vLLM whose ``SamplingParams.
_verify_extra_args`` takes an argument (and is called with it) before the plugin loads runs a request carrying
``extra_args`` exactly as without the plugin — the plugin leaves that hook out, logs it, and keeps vLLM's
KV-cache spec registry untouched with no policy — and the same process refuses ``--kv-eviction-policy`` at
start-up naming the hook and the vLLM version. One small engine in a subprocess (vLLM hosts one engine per
process), on the tiny random Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SYMBOL = "vllm.sampling_params:SamplingParams._verify_extra_args"
LLM_KW = dict(dtype="float32", enforce_eager=True, block_size=32, max_model_len=256, num_gpu_blocks_override=16,
              max_num_seqs=2, seed=0, skip_tokenizer_init=True)
PROMPT = list(range(100, 140))
EXTRA = {"caller_tag": "x", "kv_budget": 64}  # kv_* keys mean nothing to stock vLLM


def drive(model_dir: str, out_path: str, change: bool) -> None:
    """In the subprocess: (optionally) give vLLM another ``_verify_extra_args`` before plugins load, run one
    greedy request with ``extra_args``, then ask for eviction."""
    from vllm.sampling_params import SamplingParams

    if change:
        stock_extra, stock_args = SamplingParams._verify_extra_args, SamplingParams._verify_args

        def _verify_extra_args(self, limit):
            assert limit == 2 ** 64
            stock_extra(self)

        def _verify_args(self):  # this vLLM passes its limit; the rest of its checks as before
            extra = self.extra_args
            if extra:
                self._verify_extra_args(2 ** 64)
            self.extra_args = None
            try:
                stock_args(self)
            finally:
                self.extra_args = extra

        SamplingParams._verify_extra_args, SamplingParams._verify_args = _verify_extra_args, _verify_args

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    llm = LLM(model=model_dir, **LLM_KW)
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args=EXTRA), use_tqdm=False)
    res = {"tokens": list(out[0].outputs[0].token_ids),
           "manager_imported": "vllm_contour.integration.scheduler.manager" in sys.modules}
    if "vllm_contour.integration.vllm_hooks" in sys.modules:
        from vllm_contour.integration import vllm_hooks
        from vllm_contour.integration.frontend.engine_args import prepare_engine_args

        res["not_installed"] = dict(vllm_hooks.NOT_INSTALLED)
        try:
            prepare_engine_args(EngineArgs(model=model_dir, additional_config={"kv_eviction": {"policy": "snapkv"}}))
            res["refused"] = None
        except Exception as e:
            res["refused"] = f"{type(e).__name__}: {e}"
    Path(out_path).write_text(json.dumps(res))


def _run(tmp_path, model_dir: str, name: str, change: bool, plugins: str | None) -> dict:
    out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    code = f"from tests.integration.test_hooks_stock import drive; drive({model_dir!r}, {str(out)!r}, {change})"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=600)
    text = log.read_text()
    assert proc.returncode == 0 and out.exists(), text[-4000:]
    return {**json.loads(out.read_text()), "log": text}


def test_a_changed_hook_leaves_stock_generation_with_extra_args_intact(tmp_path, tiny_model_dir):
    ours = _run(tmp_path, tiny_model_dir, "changed", change=True, plugins=None)
    assert len(ours["tokens"]) == 6
    assert list(ours["not_installed"]) == [SYMBOL]  # only that hook left out
    assert "without: " + SYMBOL in ours["log"] and "will be refused on this vLLM 0.32.0" in ours["log"]
    assert not ours["manager_imported"]  # no policy: vLLM's KV-cache spec registry as without the plugin
    assert ours["refused"].startswith("EvictionConfigError: --kv-eviction-policy: vllm-contour cannot evict on "
                                      "vLLM 0.32.0") and "SamplingParams._verify_extra_args" in ours["refused"]
    stock = _run(tmp_path, tiny_model_dir, "stock", change=True, plugins="none-allowed")  # the plugin not loaded
    assert ours["tokens"] == stock["tokens"]
