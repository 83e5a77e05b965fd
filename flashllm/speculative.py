"""Speculative decoding (the paper's section 5.2): draft K tokens cheaply, verify them in one forward pass of the
model, which obtains each layer's weights once for all K+1 positions (sparse: the union of their predicted
neurons; MoE: of their experts), and keep the drafts the model agrees with. Exact: greedy output is plain
decoding's, and sampling accepts by the standard rule, so the output distribution is the model's own."""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.generate import Generation, distribution, sample, starts


class PromptLookup:
    """Drafts by n-gram lookup in the text so far (prompt and output): the tokens that followed the latest earlier
    occurrence of its last `max_ngram` tokens (else of fewer, down to `min_ngram`). A deterministic draft."""

    def __init__(self, max_ngram: int, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def draft(self, ids: list[int], k: int, temperature: float, top_p: float, rng) -> tuple[list[int], list]:
        """Up to `k` drafted ids and their draft distributions (None: all mass on the drafted id)."""
        a = np.asarray(ids, dtype=np.int64)
        for n in range(min(self.max_ngram, len(a) - 1), self.min_ngram - 1, -1):
            tail = a[-n:]
            starts = np.flatnonzero(a[:len(a) - n] == tail[0])  # candidate starts, all before the tail itself
            for i in starts[::-1]:
                if np.array_equal(a[i:i + n], tail):
                    follow = [int(t) for t in a[i + n:i + n + k]]
                    return follow, [None] * len(follow)
        return [], []


class ModelDrafter:
    """Drafts with a small resident model of the same tokenizer: greedily, or at temperature > 0 by sampling its
    own distribution (kept for the acceptance rule). Its KV cache keeps the longest prefix it shares with the text."""

    def __init__(self, model):
        self.model = model
        self.held: list[int] = []  # the tokens in the draft model's KV cache, positions 0..

    def draft(self, ids: list[int], k: int, temperature: float, top_p: float, rng) -> tuple[list[int], list]:
        k = min(k, self.model.context - len(ids))
        if k <= 0:
            return [], []
        same = 0
        for a, b in zip(self.held, ids[:-1]):  # at least the last token is fed again: its logits are needed
            if a != b:
                break
            same += 1
        self.model.clear_stats()
        logits = self.model.forward(ids[same:], same)[-1]
        self.held = list(ids)
        drafts, dists = [], []
        for i in range(k):
            if temperature <= 0:
                token, q = int(np.argmax(logits)), None
            else:
                q = distribution(logits, temperature, top_p)
                token = int(rng.choice(len(q), p=q))
            drafts.append(token)
            dists.append(q)
            if i + 1 < k:
                logits = self.model.forward([token], len(self.held))[-1]
                self.held.append(token)
        return drafts, dists


def accept(rows: np.ndarray, drafts: list[int], dists: list, temperature: float, top_p: float, rng) -> list[int]:
    """The tokens one verification yields from the model's logits `rows` [len(drafts) + 1, vocab] (row i: the
    distribution after drafts[:i]): the drafts accepted, then one token of the model's own (the correction at the
    first rejected draft, else one more). Greedy: a draft is accepted when it is the argmax. Sampling: draft x
    with draft distribution q (None: all mass on x) is accepted with probability min(1, p(x) / q(x)); on rejection
    the token is drawn from max(p - q, 0), normalized, so every token is distributed as p."""
    out = []
    for i, d in enumerate(drafts):
        if temperature <= 0:
            best = int(np.argmax(rows[i]))
            out.append(best)
            if best != d:
                return out
            continue
        p, q = distribution(rows[i], temperature, top_p), dists[i]
        if rng.random() * (1.0 if q is None else q[d]) < p[d]:
            out.append(d)
            continue
        residual = p.copy()
        if q is None:
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else p  # (total is 0 only where rejection has probability 0)
        out.append(int(rng.choice(len(p), p=residual)))
        return out
    out.append(sample(rows[len(drafts)], temperature, top_p, rng))
    return out


def next_draft_length(k: int, drafted: int, accepted: int, most: int) -> int:
    """Adaptive draft length: one more after a verification that accepted every draft, else one more than it
    accepted (drafts past the first rejection cost reads for nothing); between 1 and `most`."""
    return min(most, k + 1 if drafted and accepted == drafted else accepted + 1)


def generate_speculative(forward, drafter, num_draft_tokens: int, prompt_ids: list[int], context: int,
                         max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = 0,
                         eos_token_ids: Iterable[int] = (), record: Generation | None = None,
                         on_verified: Callable[[int, int, int, float], None] | None = None,
                         adaptive: bool = True) -> Iterator[int]:
    """Yield new token ids as `generate.generate_tokens` does, each decode step one verification:
    `forward(ids, pos, verify=True)` of the last token and up to `num_draft_tokens` drafts at positions pos..;
    the KV cache past the last kept position is overwritten by the next step (attention reads positions
    < pos + len(ids) only). `on_verified(drafted, accepted, produced, draft_ms)` follows each verification.
    `adaptive`: up to `num_draft_tokens` drafts, as many as `next_draft_length` says after each verification."""
    record = record if record is not None else Generation()
    if not starts(record, prompt_ids, context, max_new_tokens, temperature, top_p):
        return
    eos, rng = frozenset(eos_token_ids), np.random.default_rng(seed)
    ids = list(prompt_ids)

    def stop_reason(token: int) -> str | None:  # as generate_tokens: the token just taken is at len(ids) - 1
        return "eos" if token in eos else "length" if len(record.token_ids) == max_new_tokens else \
            "context" if len(ids) - 1 >= context else None

    tokens = [sample(forward(ids, 0)[-1], temperature, top_p, rng)]
    want = num_draft_tokens
    while True:
        for token in tokens:
            ids.append(token)
            record.token_ids.append(token)
            reason = stop_reason(token)
            yield token
            if reason:
                record.stop_reason = reason
                return
        pos = len(ids) - 1  # the last token, not yet in the KV cache
        k = min(want, max_new_tokens - len(record.token_ids) - 1, context - pos - 1)
        t0 = time.perf_counter()
        drafts, dists = drafter.draft(ids, k, temperature, top_p, rng) if k > 0 else ([], [])
        draft_ms = (time.perf_counter() - t0) * 1e3
        tokens = accept(forward([ids[-1]] + drafts, pos, verify=True), drafts, dists, temperature, top_p, rng)
        if adaptive and drafts:
            want = next_draft_length(want, len(drafts), len(tokens) - 1, num_draft_tokens)
        if on_verified is not None:
            taken = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))  # none after an eos
            on_verified(len(drafts), len(tokens) - 1, taken, draft_ms)


def draft_source(speculation, draft_model=None):
    """The drafter of a Speculation: prompt lookup, the loaded draft model, or its own drafter object."""
    if not isinstance(speculation.draft, str):
        return speculation.draft
    if speculation.lookup:
        return PromptLookup(speculation.max_ngram, speculation.min_ngram)
    if draft_model is None:
        raise FlashLLMError(f"speculative draft model {speculation.draft}: load the model with it "
                            f"(speculative={speculation.draft!r} on load), so that its memory counts against the budget")
    return ModelDrafter(draft_model)
