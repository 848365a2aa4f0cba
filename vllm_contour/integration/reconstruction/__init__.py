"""KVzip's context reconstruction, the one policy component that needs work from the engine: its prompt
(``prompt.py``), the scheduler's hidden requests that repeat a context (``scheduler.py``) and the workers'
scores folded from their queries (``worker.py``)."""
