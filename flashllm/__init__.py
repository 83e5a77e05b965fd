"""flashllm: run LLMs larger than memory by streaming FFN neurons from flash."""

import os
from pathlib import Path

# Run from a source checkout (`python -m pytest` in the clone, whose own flashllm/ comes first on sys.path), the
# folders installed as flashllm.converters and flashllm.predictors sit beside this package: look there too.
_checkout = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "converters").exists() and (_checkout / "converters" / "__init__.py").is_file():
    __path__.append(str(_checkout))

# OpenMP workers sleep at barriers instead of spinning (unless the user chose: OMP_WAIT_POLICY or
# GOMP_SPINCOUNT set). On shared cores a spinning worker loses its core and every parallel region
# waits for it, several times slower than with sleeping workers (docs/platforms.md). The OpenMP runtime
# reads this when torch is first imported.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from flashllm.errors import DroppedNeuronsWarning, FlashLLMError, OptionsWarning
from flashllm.model import Model
from flashllm.options import LoadOptions

__version__ = "0.1.0"


def load(model_dir, options: LoadOptions | None = None, **changes) -> Model:
    """Load a converted model directory with `options` (see LoadOptions), e.g.
    `load(path, mode="sparse", dram_budget="50%")`; keyword changes override fields of `options`."""
    return Model(model_dir, options, **changes)


__all__ = ["DroppedNeuronsWarning", "FlashLLMError", "LoadOptions", "Model", "OptionsWarning", "load", "__version__"]
