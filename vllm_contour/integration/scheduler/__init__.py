"""The engine-core (scheduler) process's side of eviction: ``side.py`` (the connector's scheduler role:
when a request's round runs, what it holds), ``scheduler.py`` (vLLM's scheduler + failing or recomputing
one request), ``dispatch.py`` / ``outcomes.py`` (a step's rounds out, their reports back), ``blocks.py`` and
``manager.py`` (a request's blocks in vLLM's pool, the evicting group's block tables), ``records.py`` /
``events.py`` (what is kept and counted), ``shared_contexts.py`` / ``contexts.py`` (compressed contexts
shared between requests)."""
