"""Shared fixtures: one converted tiny model per family, built once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import FAMILIES, MOE_FAMILIES, make_hf_model, save_checkpoint  # noqa: E402


class TinyModel:
    """An HF reference model, its checkpoint directory and the converted flashllm directory."""

    def __init__(self, family: str, root: Path):
        from flashllm.converters import convert

        self.family = family
        self.hf = make_hf_model(family)
        self.ckpt = save_checkpoint(self.hf, family, root / "hf")
        self.model_dir = convert(self.ckpt, root / "flash", dtype="float32", progress=False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    cache = {}

    def get(family: str) -> TinyModel:
        if family not in cache:
            cache[family] = TinyModel(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get


@pytest.fixture(params=sorted(FAMILIES))
def tiny(request, tiny_models) -> TinyModel:
    return tiny_models(request.param)


@pytest.fixture(params=sorted(MOE_FAMILIES))
def tiny_moe(request, tiny_models) -> TinyModel:
    return tiny_models(request.param)
