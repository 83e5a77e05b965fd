"""Architecture adapters: one small spec per HF family (dense and mixture-of-experts), found by model_type."""

from __future__ import annotations

from flashllm.errors import FlashLLMError
from flashllm.format.spec import ArchSpec
from flashllm.converters.families.common import Family
from flashllm.converters.families.dense import FAMILIES
from flashllm.converters.families.moe import MOE_FAMILIES


def all_families() -> list[Family]:
    """The dense families above and the mixture-of-experts ones (which build on them)."""
    return FAMILIES + MOE_FAMILIES


def family_for(cfg: dict) -> tuple[Family, ArchSpec]:
    """The adapter for this config and the spec it gives; clear errors for unknown or broken configs."""
    model_type = cfg.get("model_type")
    families = all_families()
    for fam in families:
        if model_type in fam.model_types:
            try:
                return fam, fam.to_spec(cfg)
            except KeyError as exc:
                raise FlashLLMError(f"config.json: missing field {exc} for model_type {model_type!r}") from None
    known = sorted(t for f in families for t in f.model_types)
    raise FlashLLMError(f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(known)})")
