"""The CUDA-graph mode vLLM 0.32 resolves from the plugin's Triton metadata builder (issue 46, item 2.4).

``ContourTritonMetadataBuilder`` declares ``AttentionCGSupport.NEVER`` (compacted rows change what a step
reads, so attention must run outside CUDA graphs). vLLM's default mode on CUDA is ``FULL_AND_PIECEWISE``
(its O2/O3 optimisation levels); with that builder in the model, vLLM's own resolution must downgrade the
mode to ``PIECEWISE`` (attention between piecewise graphs), while vLLM's own Triton builder keeps
``FULL_AND_PIECEWISE``. Both model runners are driven through vLLM's own functions, no GPU needed:

* V1: ``GPUModelRunner._check_and_update_cudagraph_mode`` (the minimum support over the attention groups'
  builder classes -> ``CompilationConfig.resolve_cudagraph_mode_and_sizes`` -> the dispatcher's keys);
* Model Runner V2: ``gpu.attn_utils.get_attn_cg_support`` over the attention groups' builders, then the
  same ``resolve_cudagraph_mode_and_sizes`` with ``use_v2_model_runner=True`` as ``gpu/model_runner.py``
  calls it.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.triton_attn")


def _compilation_config():
    """vLLM's compilation config as a CUDA engine gets it by default: VLLM_COMPILE, attention in the
    splitting ops, vLLM's default cudagraph mode."""
    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.config.compilation import CompilationMode
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG, OptimizationLevel

    default = OPTIMIZATION_LEVEL_TO_CONFIG[OptimizationLevel.O2]["compilation_config"]["cudagraph_mode"]
    assert default == CUDAGraphMode.FULL_AND_PIECEWISE  # what the test starts from is vLLM's default
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=default)
    cc.set_splitting_ops_for_v1("allgather_reducescatter")
    assert cc.splitting_ops_contain_attention()
    return cc


def _spec():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def _backends(policy: str):
    """(the plugin's Triton backend, vLLM's own) and the builder class the plugin's backend gives under a
    config with eviction ``policy``."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    from vllm_contour.integration.backends.triton import ContourTritonAttentionBackend

    with set_current_vllm_config(VllmConfig(additional_config={"kv_eviction": {"policy": policy}})):
        builder = ContourTritonAttentionBackend.get_builder_cls()
    return ContourTritonAttentionBackend, TritonAttentionBackend, builder


def _v1_resolve(backend, builder_policy: str):
    """``GPUModelRunner._check_and_update_cudagraph_mode`` on a runner holding only what it reads; returns
    the mode it hands the cudagraph dispatcher and the mode left in the compilation config."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cc = _compilation_config()
    keys = []
    runner = SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=cc), compilation_config=cc,
                             uniform_decode_query_len=1, kv_cache_config=None, max_num_reqs=8,
                             speculative_config=None,
                             cudagraph_dispatcher=SimpleNamespace(
                                 initialize_cudagraph_keys=lambda mode, q_len: keys.append(mode)))
    group = KVCacheGroupSpec(layer_names=["model.layers.0.self_attn.attn"], kv_cache_spec=_spec())
    with set_current_vllm_config(VllmConfig(additional_config={"kv_eviction": {"policy": builder_policy}})):
        GPUModelRunner._check_and_update_cudagraph_mode(runner, [{backend}], [group])
    assert len(keys) == 1
    return keys[0], cc.cudagraph_mode


def _v2_resolve(backend, builder):
    """Model Runner V2: ``get_attn_cg_support`` over one attention group whose metadata builder is
    ``builder``, then the mode as ``gpu/model_runner.py`` derives it."""
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.attn_utils import get_attn_cg_support
    from vllm.v1.worker.utils import AttentionGroup

    src = inspect.getsource(model_runner)
    assert "attn_cg_support.min_cg_support" in src and "use_v2_model_runner=True" in src  # the call below
    cc = _compilation_config()
    group = AttentionGroup(backend=backend, layer_names=["model.layers.0.self_attn.attn"], kv_cache_spec=_spec(),
                           kv_cache_group_id=0, metadata_builders=[builder])  # get_cudagraph_support: a classmethod
    info = get_attn_cg_support([[group]], SimpleNamespace(compilation_config=cc))
    mode = cc.resolve_cudagraph_mode_and_sizes(info.min_cg_support, info.min_cg_attn_backend, 1,
                                               use_v2_model_runner=True, kv_cache_config=None, max_num_reqs=8,
                                               piecewise_capture_available=True)
    return info, mode, cc.cudagraph_mode


def test_the_plugins_builder_declares_no_cuda_graph_support():
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    from vllm_contour.integration.backends.triton import ContourTritonMetadataBuilder

    ours, _, builder = _backends("snapkv")
    assert builder is ContourTritonMetadataBuilder
    assert builder.get_cudagraph_support(None, _spec()) == AttentionCGSupport.NEVER
    assert TritonAttentionMetadataBuilder.get_cudagraph_support(None, _spec()) == AttentionCGSupport.ALWAYS
    assert _backends("none")[2] is TritonAttentionMetadataBuilder  # eviction off: vLLM's own builder


def test_v1_runner_resolves_full_and_piecewise_to_piecewise_with_the_plugins_builder():
    from vllm.config import CUDAGraphMode

    ours, vllms, _ = _backends("snapkv")
    assert _v1_resolve(ours, "snapkv") == (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE)
    # the same resolution with vLLM's own Triton backend, and with the plugin's backend when eviction is off
    assert _v1_resolve(vllms, "snapkv") == (CUDAGraphMode.FULL_AND_PIECEWISE,) * 2
    assert _v1_resolve(ours, "none") == (CUDAGraphMode.FULL_AND_PIECEWISE,) * 2


def test_model_runner_v2_resolves_full_and_piecewise_to_piecewise_with_the_plugins_builder():
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    ours, vllms, builder = _backends("snapkv")
    info, mode, left = _v2_resolve(ours, builder)
    assert info.min_cg_support == AttentionCGSupport.NEVER and info.min_cg_attn_backend == ours.__name__
    assert mode == left == CUDAGraphMode.PIECEWISE
    info, mode, left = _v2_resolve(vllms, TritonAttentionMetadataBuilder)
    assert info.min_cg_support == AttentionCGSupport.ALWAYS
    assert mode == left == CUDAGraphMode.FULL_AND_PIECEWISE
