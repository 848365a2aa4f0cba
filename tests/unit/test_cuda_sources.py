"""The raw-pointer CUDA kernels (csrc/cuda/*.cu, no torch headers) compile for sm_90 with nvcc. They are
not executed here (no GPU); the Triton kernels are what the dispatch uses on CUDA."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).resolve().parents[2] / "csrc" / "cuda").glob("*.cu"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("src", SOURCES, ids=[s.name for s in SOURCES])
def test_cu_compiles_for_sm90(src, tmp_path):
    r = subprocess.run(["nvcc", "-c", "-arch=sm_90", "-O3", "-Xptxas", "-v", str(src), "-o",
                        str(tmp_path / (src.stem + ".o"))], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert spills and not any(spills), r.stderr[-3000:]  # ptxas reported every kernel, none spills
