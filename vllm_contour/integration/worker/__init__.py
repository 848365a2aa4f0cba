"""The worker process's side of eviction: ``side.py`` (one per process, owned by the KV connector's worker
role), the requests it keeps (``requests.py``), a step's data carried in the attention metadata
(``step.py``), the step's rounds (``rounds.py``) and KVzip's context scores live with the rest of KVzip in ``integration/reconstruction/``."""
