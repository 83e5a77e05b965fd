"""Sampling, the plain generation loop (prefill once, then one token at a time), and stop conditions."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from flashllm.errors import FlashLLMError

STOP_REASONS = ("eos", "stop", "length", "context")  # end-of-sequence token, stop string, max_new_tokens, KV full


@dataclass
class Generation:
    """What the last `generate_ids`/`stream`/`generate` call produced and why it ended."""

    token_ids: list[int] = field(default_factory=list)
    stop_reason: str | None = None  # one of STOP_REASONS; None while running or if the caller stopped early
    text: str | None = None  # the returned text (stream/generate only)


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0, else nucleus sampling from softmax(logits / temperature)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    p = distribution(logits, temperature, top_p)
    return int(rng.choice(len(p), p=p))


def distribution(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """What `sample` draws from at temperature > 0: softmax(logits / temperature) cut to its top_p nucleus (float64)."""
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
    return p


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Clear errors for sampling options out of range (the CLI checks the same at parse time)."""
    if max_new_tokens < 0:
        raise FlashLLMError(f"max_new_tokens {max_new_tokens}: must be 0 or more")
    if not temperature >= 0:
        raise FlashLLMError(f"temperature {temperature}: must be 0 (greedy) or more")
    if not 0.0 < top_p <= 1.0:
        raise FlashLLMError(f"top_p {top_p}: expected a value in (0, 1]")


# what to do about a prompt longer than the context; a larger context helps only up to the model's own
# positions (at the model's limit it cannot help: `flashllm inspect` shows the limit as `context`)
TOO_LONG = ("shorten the prompt, or load with a larger context if the model has more positions: "
            "`flashllm inspect MODEL` shows them")


def starts(record: Generation, prompt_ids: list[int], context: int, max_new_tokens: int, temperature: float,
           top_p: float) -> bool:
    """Whether a generation has tokens to make: clear errors for bad options, an empty prompt or one that leaves
    no room in the context; False (stop reason "length") for max_new_tokens 0."""
    check_sampling(max_new_tokens, temperature, top_p)
    if not prompt_ids:
        raise FlashLLMError("the prompt is empty (no tokens to start from)")
    if len(prompt_ids) >= context:
        raise FlashLLMError(f"the prompt has {len(prompt_ids)} tokens but the context holds {context} ({TOO_LONG})")
    if max_new_tokens == 0:
        record.stop_reason = "length"
    return max_new_tokens > 0


def generate_tokens(forward, prompt_ids: list[int], context: int, max_new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int | None = 0, eos_token_ids: Iterable[int] = (),
                    record: Generation | None = None) -> Iterator[int]:
    """Yield new token ids; `forward(ids, pos)` returns logits [len(ids), vocab] for positions pos..

    `record` collects the ids and why generation ended (eos, length or context)."""
    record = record if record is not None else Generation()
    if not starts(record, prompt_ids, context, max_new_tokens, temperature, top_p):
        return
    eos = frozenset(eos_token_ids)
    rng = np.random.default_rng(seed)
    logits = forward(prompt_ids, 0)[-1]
    pos = len(prompt_ids)
    for i in range(max_new_tokens):
        token = sample(logits, temperature, top_p, rng)
        record.token_ids.append(token)
        yield token
        reason = "eos" if token in eos else "length" if i + 1 == max_new_tokens else "context" if pos >= context else None
        if reason:
            record.stop_reason = reason
            return
        logits = forward([token], pos)[-1]
        pos += 1


def generate_batch(forward, prompts: list[list[int]], context: int, max_new_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, seed: int | None = 0, eos_token_ids: Iterable[int] = (),
                   records: list[Generation] | None = None) -> Iterator[tuple[int, int]]:
    """Yield (sequence, new token id) for several prompts decoded together, each exactly as
    `generate_tokens` would alone (its own sampler seeded `seed`). Each prompt is prefilled alone in its
    own KV cache, `forward(ids, 0, i)`; every step after is one `forward(tokens, positions, sequences)`
    over the unfinished sequences. A caller that sets records[i].stop_reason stops sequence i."""
    records = records if records is not None else [Generation() for _ in prompts]
    check_sampling(max_new_tokens, temperature, top_p)
    for i, ids in enumerate(prompts):
        if not ids:
            raise FlashLLMError(f"prompt {i + 1} is empty (no tokens to start from)")
        if len(ids) >= context:
            raise FlashLLMError(f"prompt {i + 1} has {len(ids)} tokens but the context holds {context} ({TOO_LONG})")
    if max_new_tokens == 0:
        for r in records:
            r.stop_reason = "length"
        return
    eos = frozenset(eos_token_ids)
    rngs = [np.random.default_rng(seed) for _ in prompts]
    logits = [forward(ids, 0, i)[-1] for i, ids in enumerate(prompts)]
    pos = [len(ids) for ids in prompts]
    live = list(range(len(prompts)))
    while live:
        for i in live:
            token = sample(logits[i], temperature, top_p, rngs[i])
            records[i].token_ids.append(token)
            yield i, token
            n = len(records[i].token_ids)
            reason = "eos" if token in eos else "length" if n == max_new_tokens else "context" if pos[i] >= context \
                else None
            records[i].stop_reason = records[i].stop_reason or reason
        live = [i for i in live if records[i].stop_reason is None]
        if live:
            out = forward([records[i].token_ids[-1] for i in live], [pos[i] for i in live], live)
            for row, i in enumerate(live):
                logits[i] = out[row]
                pos[i] += 1


def eos_token_ids(spec, model_dir: str | Path) -> frozenset[int]:
    """Every end-of-sequence id: the spec's (all of config.json's list) and generation_config.json's."""
    ids = {spec.eos_token_id, *getattr(spec, "eos_token_ids", ())}
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
            raise FlashLLMError(f"{path}: unreadable ({exc})") from None
        ids.update(value if isinstance(value, list) else [value])
    return frozenset(i for i in ids if isinstance(i, int))


class TextStream:
    """Turns generated token ids into text pieces that are safe to show.

    The new text is decoded after the prompt's last tokens and diffed, so a first word keeps the
    leading space a Metaspace (sentencepiece) decoder drops at the start of a text; pieces never end
    inside a UTF-8 character; text that could still become a stop string is held back until
    resolved, and `text` ends just before the first stop string found (`stopped` is then True).
    Each token costs work bounded by WINDOW and the stop strings' length, not by the text so far: only
    the last tokens are decoded again, and stop strings are searched for only where new text can
    complete one."""

    PROMPT_TAIL = 8  # prompt tokens decoded before the new ones (enough to settle spacing)
    WINDOW = 32  # once this many tokens are decoded after the settled text, their text is settled too

    def __init__(self, tokenizer, prompt_ids: list[int], stop: Iterable[str] = ()):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.prefix = list(prompt_ids[-self.PROMPT_TAIL:])
        self.head = tokenizer.decode(self.prefix)
        self.ids: list[int] = []
        self.base, self.settled = 0, ""  # ids[:base] decode to `settled`; only ids[base:] are decoded again
        self.text, self.shown, self.stopped, self.searched = "", 0, False, 0

    def _decode(self) -> str:
        window = self.ids[self.base:]
        full = self.tok.decode(self.prefix + window)
        return self.settled + (full[len(self.head):] if full.startswith(self.head) else self.tok.decode(window))

    def _settle(self, text: str) -> None:
        """Past WINDOW tokens, the decoded text so far is final: later tokens decode after its last ids."""
        if len(self.ids) - self.base >= self.WINDOW:
            self.base, self.settled = len(self.ids), text
            self.prefix = self.ids[-self.PROMPT_TAIL:]
            self.head = self.tok.decode(self.prefix)

    def add(self, token: int) -> str:
        """Take one generated token; the text that can be shown now (may be empty)."""
        self.ids.append(token)
        text = self._decode()
        if text.endswith("\ufffd"):  # a UTF-8 character still incomplete
            return ""
        self.text = text
        self._settle(text)
        hits = [i for i in (text.find(s, max(0, self.searched - len(s) + 1)) for s in self.stop) if i >= 0]
        self.searched = len(text)
        if hits:
            self.text, self.stopped = text[:min(hits)], True
            return self.flush()
        return self._show(len(text) - max((held(text, s) for s in self.stop), default=0))

    def flush(self) -> str:
        """The rest of the text (at the end of generation nothing can become a stop string any more)."""
        if not self.stopped:
            self.text = self._decode()
        return self._show(len(self.text))

    def _show(self, end: int) -> str:
        piece = self.text[self.shown:end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return piece


def held(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` (and could still become it)."""
    tail = text[-(len(stop) - 1):] if len(stop) > 1 else ""
    i = tail.find(stop[0])
    while i >= 0:
        if stop.startswith(tail[i:]):
            return len(tail) - i
        i = tail.find(stop[0], i + 1)
    return 0
