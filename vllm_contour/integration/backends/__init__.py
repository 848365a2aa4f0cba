"""The attention backends with eviction (worker process): vLLM's own kernel for every ordinary row, the
plugin's for compacted ones. ``common.py`` holds the row logic, mixed into a platform's vLLM builder and impl
classes by ``cpu.py`` (``CPU_ATTN``) and ``triton.py`` (``TRITON_ATTN``, CUDA)."""
