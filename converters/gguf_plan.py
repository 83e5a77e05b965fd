"""How a GGUF model's FFN is stored: its own Q4_0/Q4_1/Q8_0 blocks as flashllm groups, or what was asked for."""

from __future__ import annotations

import dataclasses

from flashllm.errors import FlashLLMError
from flashllm.format.quant import DEFAULT_GROUP, DEFAULT_SCHEME, QuantScheme
from flashllm.format.spec import ArchSpec

from flashllm.converters.families.common import Family
from flashllm.converters.gguf_checkpoint import GGUFCheckpoint
from flashllm.converters.gguf_quant import GROUP, native_scheme


def gguf_plan(ckpt: GGUFCheckpoint, family: Family, spec: ArchSpec, dtype: str, quantize: str | None,
              group_size: int | None, quant_scheme: str | None) -> tuple[Family, QuantScheme | None]:
    """(the family adapter as this file needs it, the FFN's quantization). `quantize` None keeps the file's own
    scheme where flashllm has it (its FFN mostly Q4_0, Q4_1 or Q8_0) and stores other types as `dtype`; a
    named scheme that matches the blocks (bits, and group size and scheme unless given otherwise) keeps them
    too; anything else is dequantized and rounded again (the cost goes to the manifest)."""
    ckpt.cost.store_dtype = dtype
    ckpt.streamed = {ckpt.resolve(n) for n in family.streamed_sources(ckpt, spec)} - {None}
    if ckpt.norm_offset_stored:  # llama.cpp stored the norms with the family's offset already added
        family = dataclasses.replace(family, norm_offset=family.norm_offset - ckpt.norm_offset_stored)
    types = ckpt.types(ckpt.streamed)
    native = native_scheme(max(types, key=types.get)) if types else None
    if quantize is None:
        if group_size or quant_scheme:
            raise FlashLLMError("--group-size applies with --quantize int8 or int4")
        return family, native
    if quantize == "none":
        return family, None
    main = max(types, key=types.get) if types else None
    for exact in (native, QuantScheme.named("int8", GROUP, "symmetric") if main == "Q4_0" else None):
        if exact and exact.name == quantize and group_size in (None, exact.group_size) \
                and quant_scheme in (None, exact.scheme):
            return family, exact
    return family, QuantScheme.named(quantize, group_size or DEFAULT_GROUP, quant_scheme or DEFAULT_SCHEME)
