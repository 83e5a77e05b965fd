"""Sampling and the plain generation loop (prefill once, then one token at a time)."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .errors import FlashLLMError


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0, else nucleus sampling from softmax(logits / temperature)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < top_p  # smallest prefix whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(len(p), p=p))


def generate_tokens(forward, prompt_ids: list[int], context: int, max_new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int | None = 0, eos_token_id: int | None = None) -> Iterator[int]:
    """Yield new token ids; `forward(ids, pos)` returns logits [len(ids), vocab] for positions pos.."""
    if not prompt_ids:
        raise FlashLLMError("the prompt is empty (no tokens to start from)")
    if len(prompt_ids) >= context:
        raise FlashLLMError(f"the prompt has {len(prompt_ids)} tokens but the context holds {context} "
                            f"(shorten the prompt or load with a larger context)")
    if not 0.0 < top_p <= 1.0:
        raise FlashLLMError(f"top_p {top_p}: expected a value in (0, 1]")
    rng = np.random.default_rng(seed)
    logits = forward(prompt_ids, 0)[-1]
    pos = len(prompt_ids)
    for i in range(max_new_tokens):
        token = sample(logits, temperature, top_p, rng)
        yield token
        if token == eos_token_id or i + 1 == max_new_tokens or pos >= context:
            return
        logits = forward([token], pos)[-1]
        pos += 1
