"""What a GPU user copies from the README installs offline, and the images leave local environments out."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_pip_install_of_the_clone_skips_build_isolation():
    """pip's build isolation would download torch (GBs, CUDA on Linux) only to build a pure-Python wheel, and
    fails offline: every ``pip install .`` the README and the Dockerfiles show turns it off."""
    for path in [REPO / "README.md", *sorted((REPO / "docker").glob("Dockerfile*"))]:
        for line in path.read_text().splitlines():
            if re.search(r"pip install\b.*\s\.(\s|$|\[)", line):
                assert "--no-build-isolation" in line, f"{path.name}: {line.strip()}"


def test_the_docker_context_leaves_local_environments_and_builds_out():
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    for path in (".venv/bin/python", ".cache/vllm/x", ".git/HEAD", "build/lib/x.py", "vllm_contour/_C.so",
                 "vllm_contour/__pycache__/x.pyc"):
        parts = path.split("/")
        assert any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(parts[0], p) or
                   any(fnmatch.fnmatch(part, p.replace("**/", "")) for part in parts) or
                   fnmatch.fnmatch(parts[-1], p) for p in patterns), path
    for kept in ("vllm_contour/config.py", "csrc/contour_ops.cpp", "pyproject.toml"):
        parts = kept.split("/")
        assert not any(fnmatch.fnmatch(kept, p) or fnmatch.fnmatch(parts[0], p) or fnmatch.fnmatch(parts[-1], p)
                       for p in patterns), kept
