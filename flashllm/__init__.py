"""flashllm: run LLMs larger than memory by streaming FFN neurons from flash."""

from .errors import FlashLLMError
from .model import Model

__version__ = "0.1.0"


def load(model_dir, backend: str = "torch", device: str | None = None, mode: str = "dense", **options) -> Model:
    """Load a converted model directory; see `Model` for the options."""
    return Model(model_dir, backend=backend, device=device, mode=mode, **options)


__all__ = ["FlashLLMError", "Model", "load", "__version__"]
