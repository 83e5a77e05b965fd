"""HF checkpoint -> flashllm model directory (one adapter per architecture family + the writer)."""

from flashllm.converters.writer import convert

__all__ = ["convert"]
