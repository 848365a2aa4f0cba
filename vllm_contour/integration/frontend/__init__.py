"""What runs in every vLLM process at start-up and in the API server: ``plugin.py`` (``register()``,
request validation), ``engine_args.py`` (the ``--kv-*`` flags, wiring and refusals), ``platforms.py``
(where eviction runs) and ``cli.py`` (the ``vllm-contour`` command)."""
