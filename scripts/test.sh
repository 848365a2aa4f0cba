#!/usr/bin/env bash
# Run the test suite (sets up the environment first). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}
export TMPDIR=${TMPDIR:-/tmp}
set +e
python -m pytest -q -rs --durations=25 "$@"   # the slowest 25: where the suite's time goes
rc=$?
set -e
# pytest exit 5 = no tests collected (e.g. a -k filter that matches nothing): not a failure of the suite.
if [ $rc -eq 5 ]; then echo "no tests collected" >&2; exit 0; fi
exit $rc
