"""flashllm: run LLMs larger than memory by streaming FFN neurons from flash."""

from .errors import FlashLLMError
from .model import Model
from .options import LoadOptions

__version__ = "0.1.0"


def load(model_dir, options: LoadOptions | None = None, **changes) -> Model:
    """Load a converted model directory with `options` (see LoadOptions), e.g.
    `load(path, mode="sparse", dram_budget="50%")`; keyword changes override fields of `options`."""
    return Model(model_dir, options, **changes)


__all__ = ["FlashLLMError", "LoadOptions", "Model", "load", "__version__"]
