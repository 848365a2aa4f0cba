#!/usr/bin/env bash
# Run the test suite (sets up the environment first). Extra args go to pytest (one process, as given).
# With no args on a machine with two or more CPUs the suite runs as two pytest processes side by side, each
# pinned to its own CPU: the engine tests that compare engines with each other (test_engine.py and the Model
# Runner V2 twins) in one, everything else in the other. An engine test is mostly one busy thread (vLLM's
# step loop, the Triton interpreter), so the two halves share the machine instead of queueing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}
export TMPDIR=${TMPDIR:-/tmp}
PYTEST=(python -m pytest -q -rs --durations=15)  # the slowest 15 of each process: where the time goes
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }  # 5 = no tests collected (a -k filter that matches nothing)
read -r -a CPUS <<< "$(python -c 'import os; print(*sorted(os.sched_getaffinity(0)))')"
if [ $# -gt 0 ] || [ ${#CPUS[@]} -lt 2 ]; then
  set +e; "${PYTEST[@]}" "$@"; rc=$?; set -e
  ok $rc && exit 0 || exit $rc
fi
ENGINES=(tests/integration/test_engine.py tests/integration/test_model_runner_v2.py)
log=$(mktemp -t contour-tests-XXXX.log)
set +e
taskset -c "${CPUS[0]}" "${PYTEST[@]}" "${ENGINES[@]}" > "$log" 2>&1 &
engines=$!
taskset -c "${CPUS[1]}" "${PYTEST[@]}" tests "${ENGINES[@]/#/--ignore=}"
rest=$?
wait $engines
rc_engines=$?
set -e
echo "=============== the engine tests (test_engine.py, test_model_runner_v2.py), CPU ${CPUS[0]} ==============="
cat "$log"
rm -f "$log"
ok $rest && ok $rc_engines && exit 0
exit 1
