"""Builds the optional C++/OpenMP CPU kernels ``vllm_contour._C`` at install time.

Metadata lives in pyproject.toml; this file only adds the extension. ``pip install .`` needs torch in the
build environment (``[build-system] requires`` lists it); for an editable install into an environment that
already has torch: ``pip install --no-build-isolation --no-deps -e .``.

Environment:
  VLLM_CONTOUR_NO_EXT=1            skip the extension (the ops fall back to the torch / vLLM implementations)
  VLLM_CONTOUR_CPU_ARCH="..."      target flags (default ``-march=native``: the extension is built on the
                                   machine that runs it; use e.g. ``-mavx2 -mfma -mf16c`` or ``""`` for a
                                   portable build)
"""

import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("VLLM_CONTOUR_NO_EXT", "0") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    arch = os.environ.get("VLLM_CONTOUR_CPU_ARCH", "-march=native").split()
    ext_modules.append(
        CppExtension(
            name="vllm_contour._C",
            sources=["csrc/contour_ops.cpp"],
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", *arch],
            extra_link_args=["-fopenmp"],
        )
    )
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
