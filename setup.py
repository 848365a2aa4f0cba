"""Builds the optional C++/OpenMP CPU kernels ``vllm_contour._C`` at install time.

Metadata lives in pyproject.toml; this file only adds the extension (setuptools.build_meta picks it up).
The extension is compiled against the torch of the build environment and must run with the same torch:
install with ``pip install --no-build-isolation .`` (or ``-e .``) into the environment that has the
runtime torch, or let build isolation install the same version (``[build-system] requires``).

Importing ``vllm_contour._C`` registers ``torch.ops.vllm_contour.*``; when it is missing the ops fall back
to the other implementations (``vllm_contour.ops.cpu_ext``).

Environment:
  VLLM_CONTOUR_NO_EXT=1            skip the extension
  VLLM_CONTOUR_EXT_REQUIRED=1      fail the install when the extension does not build (default: warn and
                                   install without it)
  VLLM_CONTOUR_CPU_ARCH="..."      baseline target flags, default ``-march=x86-64-v2``: the build runs on any
                                   x86-64-v2 machine whatever machine built it. The AVX2, AVX-512, AVX512_BF16
                                   and AMX kernels are compiled on every machine anyway (csrc/isa_*.cpp turn
                                   their instructions on per file) and picked at run time by CPU features
                                   (``torch.ops.vllm_contour.cpu_isa()``; VLLM_CONTOUR_CPU_ISA caps the level)
  MAX_JOBS=N                       parallel compile jobs (five source files; default: every core)
"""

import os
import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("VLLM_CONTOUR_NO_EXT", "0") != "1":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("vllm-contour: torch is not importable in the build environment; installing without the C++ "
              "kernels (vllm_contour._C)", file=sys.stderr)
    else:
        arch = os.environ.get("VLLM_CONTOUR_CPU_ARCH", "-march=x86-64-v2").split()
        ext_modules.append(
            CppExtension(
                name="vllm_contour._C",
                # the kernels (csrc/kernels.inc) once per ISA level (csrc/contour.h) and the op front end; the
                # longest compile first (parallel jobs end together)
                sources=["csrc/isa_avx512.cpp", "csrc/isa_avx2.cpp", "csrc/isa_generic.cpp", "csrc/contour_ops.cpp",
                         "csrc/isa_avx512_bf16.cpp"],
                depends=["csrc/contour.h", "csrc/kernels.inc"],  # (into an sdist too)
                # -g0: no debug info (Python's CFLAGS ask for -g: about a fifth of the compile time, most of the .so)
                extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", "-g0", *arch],
                extra_link_args=["-fopenmp"],
                optional=os.environ.get("VLLM_CONTOUR_EXT_REQUIRED", "0") != "1",
            )
        )

        class _BuildExt(BuildExtension):
            """An optional extension that fails to compile is skipped with a warning (torch's ninja build
            raises RuntimeError, which setuptools' own ``optional`` handling does not catch)."""

            def build_extension(self, ext):
                try:
                    super().build_extension(ext)
                except Exception as e:  # noqa: BLE001
                    if not getattr(ext, "optional", False):
                        raise
                    print(f"vllm-contour: WARNING: building {ext.name} failed ({e}); installing without the "
                          "C++ kernels (set VLLM_CONTOUR_EXT_REQUIRED=1 to make this an error)", file=sys.stderr)
                    self._failed.append(ext.name)

            def run(self):
                self._failed = []
                super().run()

            def copy_extensions_to_source(self):  # editable installs: skip what did not build
                keep = self.extensions
                self.extensions = [e for e in keep if e.name not in self._failed]
                try:
                    super().copy_extensions_to_source()
                finally:
                    self.extensions = keep

            def get_outputs(self):
                return [o for o, e in zip(super().get_outputs(), self.extensions) if e.name not in self._failed]

        cmdclass["build_ext"] = _BuildExt.with_options(use_ninja=True)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
