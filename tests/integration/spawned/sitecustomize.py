"""TEST ONLY: what the engine driver does in its own process for Model Runner V2 on CPU (Triton under the
interpreter, ``triton_on_cpu``), done at start-up in every process vLLM spawns (TP workers), which run none
of the driver's code. On ``PYTHONPATH`` only for such engines (``conftest.py``), and only acts when
``CONTOUR_TRITON_ON_CPU=mrv2``."""

import os

if os.environ.get("CONTOUR_TRITON_ON_CPU") == "mrv2":
    from tests.integration import triton_on_cpu

    triton_on_cpu.enable()
    triton_on_cpu.fast_greedy_sampler()
