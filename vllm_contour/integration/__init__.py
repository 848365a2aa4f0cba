"""The boundary with vLLM: the only package that imports it. By process: ``frontend/`` (every process at
start-up, the API server), ``scheduler/`` (the engine core), ``worker/`` and ``backends/`` (the workers),
``reconstruction/`` (KVzip's engine work, both sides); between them ``connector.py`` (the KV connector vLLM
loads) and ``messages.py`` (what the sides send each other); ``metrics.py``, ``vllm_hooks.py`` (every reach
into vLLM) and ``faults.py`` (the test-only fault switch)."""
