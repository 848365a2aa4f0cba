"""Everything that imports vLLM: plugin entry point, attention backend, KV connector, CLI flags."""
