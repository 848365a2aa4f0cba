"""vllm-contour: per-head KV-cache eviction for vLLM with real memory savings."""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point (see ``vllm_contour.integration.frontend.plugin``)."""
    from vllm_contour.integration.frontend.plugin import register as _register

    _register()
