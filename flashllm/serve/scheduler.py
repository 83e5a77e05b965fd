"""Continuous batching for the server: requests join and leave one running batch at token boundaries.

One worker thread owns the model. Each admitted request gets a KV cache slot of its own (up to
`max_batch` at once), its own sampler and text stream; the others wait in a bounded queue. Every
step the worker prefills one chunk of one new request (at most `prefill_chunk` tokens, so a long
prompt does not stall the running streams), then runs one decode step over every running sequence,
in which each layer's weights are obtained once for the whole batch (`Model.forward` with lists).
A job always ends with an "end" event, whether it finished, failed, was cancelled (queued or
running) or was cut by shutdown.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
import traceback
from collections import deque

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.generate import TextStream, sample

FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "shutdown": "length"}


class Job:
    """One request's generation. The worker reports `(kind, value)` events on `events` (text, done,
    error, then always end); the event loop reads them."""

    def __init__(self, owner: "Scheduler", req, loop: asyncio.AbstractEventLoop):
        self.owner, self.req, self.loop = owner, req, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.state = "queued"  # queued -> prefill -> running -> done
        self.ended = False

    def emit(self, kind: str, value=None) -> None:
        """From the worker: hand an event to the waiting request (dropped if the server loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # event loop closed during shutdown
            pass

    def cancel(self) -> None:
        """Stop this job (before its next token if running) and free its place now; idempotent."""
        self.cancelled.set()
        self.owner._wake()


class Sequence:
    """A job's decode state in the batch: its KV slot, position, sampler, text stream and costs."""

    def __init__(self, job: Job, slot: int, model, eos: frozenset):
        req = job.req
        self.job, self.slot, self.ids, self.eos = job, slot, req.prompt_ids, eos
        self.context_left = model.context - len(req.prompt_ids)
        self.budget = self.context_left if req.max_tokens is None else min(req.max_tokens, self.context_left)
        self.rng = np.random.default_rng(req.seed)
        self.text = TextStream(model.tokenizer, req.prompt_ids, req.stop)
        self.filled = 0  # prompt tokens in the KV cache
        self.tokens: list[int] = []
        self.costs, self.prompt_costs = [], 0
        self.pos = len(req.prompt_ids)
        self.reason: str | None = None

    def take(self, logits: np.ndarray) -> None:
        """Sample the next token from `logits` and emit the text it shows; decide whether it ends here."""
        req = self.job.req
        token = sample(logits, req.temperature, req.top_p, self.rng)
        self.tokens.append(token)
        piece = self.text.add(token)
        if piece:
            self.job.emit("text", piece)
        if self.text.stopped:
            self.reason = "stop"
        elif token in self.eos:
            self.reason = "eos"
        elif len(self.tokens) >= self.budget:
            capped = req.max_tokens is None or req.max_tokens > self.context_left
            self.reason = "context" if capped else "length"
        elif self.pos >= self.job.owner.model.context:
            self.reason = "context"


class Scheduler:
    """The worker thread, the batch of running sequences and the bounded queue behind it."""

    def __init__(self, model, max_batch: int, max_queue: int, prefill_chunk: int = 128):
        from flashllm.generate import eos_token_ids

        self.model, self.max_batch, self.max_queue, self.prefill_chunk = model, max_batch, max_queue, prefill_chunk
        self.eos = eos_token_ids(model.spec, model.manifest.root)
        self._queue: deque[Job] = deque()
        self._running: list[Sequence] = []  # prefilling ones first, in arrival order
        self._reserved = 0  # places promised to requests still being tokenized
        self._cond = threading.Condition()
        self._closing, self._deadline = False, None
        self.tokens_per_s = 0.0  # recent aggregate decode rate, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="flashllm-decode", daemon=True)
        self._thread.start()

    # -- the event loop's side -----------------------------------------------------------------
    def reserve(self) -> bool:
        """Hold a place for a request about to be tokenized; False when the batch and the queue are full
        (or the server is shutting down)."""
        with self._cond:
            if self._closing or self._held() >= self.max_batch + self.max_queue:
                return False
            self._reserved += 1
            return True

    def unreserve(self) -> None:
        with self._cond:
            self._reserved -= 1

    def submit(self, req) -> Job:
        """Turn a reserved place into a queued job for `req` (checked and tokenized)."""
        job = Job(self, req, asyncio.get_running_loop())
        with self._cond:
            self._reserved -= 1
            self._queue.append(job)
            self._cond.notify()
        return job

    def counts(self) -> dict:
        """{"running", "queued", "max_batch", "max_queued"}: sequences in the batch, requests waiting."""
        with self._cond:
            return {"running": len(self._running), "queued": len(self._queue) + self._reserved,
                    "max_batch": self.max_batch, "max_queued": self.max_queue}

    def retry_after(self) -> int:
        """Seconds until the backlog (every admitted request's remaining token budget) would drain at the
        recent aggregate rate; at least 1."""
        with self._cond:
            left = sum(s.budget - len(s.tokens) for s in self._running)
            left += sum(self._budget_of(j.req) for j in self._queue)
        rate = self.tokens_per_s or 1.0
        return max(1, min(600, math.ceil(left / rate)))

    def close(self, grace: float = 0.0, timeout: float = 10.0) -> None:
        """Stop admitting; let running sequences go on for `grace` seconds, then end each (a final chunk,
        finish_reason length, stop_reason shutdown) and fail the queued ones; wait for the worker."""
        with self._cond:
            self._closing, self._deadline = True, time.monotonic() + grace
            self._cond.notify()
        self._thread.join(grace + timeout)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _held(self) -> int:
        return len(self._running) + len(self._queue) + self._reserved

    def _budget_of(self, req) -> int:
        left = self.model.context - len(req.prompt_ids)
        return left if req.max_tokens is None else min(req.max_tokens, left)

    # -- the worker ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._drop_cancelled()
                if self._closing and (not self._running or time.monotonic() >= self._deadline):
                    break
                self._admit()
                if not self._running:
                    self._cond.wait()
                    continue
            try:
                self._step()
            except Exception as exc:  # a bug, not a bad request: end every sequence, log it, keep serving
                traceback.print_exc(file=sys.stderr)
                with self._cond:
                    failed, self._running = self._running, []
                for seq in failed:
                    self._end(seq.job, "error", exc)
        with self._cond:
            left, self._running = self._running, []
            queued, self._queue = list(self._queue), deque()
        for seq in left:
            seq.reason = "shutdown"
            self._finish(seq)
        from flashllm.serve.openai_api import APIError

        for job in queued:
            self._end(job, "error", APIError(503, "the server is shutting down", kind="server_error",
                                             code="shutting_down"))

    def _drop_cancelled(self) -> None:
        """End cancelled jobs, queued or running (their slots free at once)."""
        for job in [j for j in self._queue if j.cancelled.is_set()]:
            self._queue.remove(job)
            self._end(job)
        for seq in [s for s in self._running if s.job.cancelled.is_set()]:
            self._running.remove(seq)
            self._end(seq.job)

    def _admit(self) -> None:
        used = {s.slot for s in self._running}
        free = [i for i in range(self.max_batch) if i not in used]
        while self._queue and free and not self._closing:
            job = self._queue.popleft()
            job.state = "prefill"
            seq = Sequence(job, free.pop(0), self.model, self.eos)
            self._running.append(seq)
            if seq.budget == 0:  # max_tokens 0: nothing to generate
                seq.reason = "length"
                self._finish(seq)
                free.append(seq.slot)

    def _step(self) -> None:
        """One prefill chunk of the oldest prefilling sequence, then one decode step over the running ones."""
        model = self.model
        prefilling = next((s for s in self._running if s.job.state == "prefill"), None)
        if prefilling is not None:
            s = prefilling
            chunk = s.ids[s.filled:s.filled + self.prefill_chunk]
            try:
                logits, cost = model.step(chunk, s.filled, s.slot)
            except FlashLLMError as exc:
                return self._fail(s, exc)
            s.costs.append(cost)
            s.prompt_costs += 1
            s.filled += len(chunk)
            if s.filled == len(s.ids):  # its first token comes from the prompt; it decodes from this step on
                s.job.state = "running"
                s.take(logits[-1])
                if s.reason:
                    self._finish(s)
        ready = [s for s in self._running if s.job.state == "running"]
        if not ready:
            return
        t0 = time.perf_counter()
        try:
            if len(ready) == 1:  # one sequence: the single-sequence path (its native attention block)
                s = ready[0]
                logits, cost = model.step([s.tokens[-1]], s.pos, s.slot)
            else:
                logits, cost = model.step([s.tokens[-1] for s in ready], [s.pos for s in ready],
                                          [s.slot for s in ready])
        except FlashLLMError as exc:
            for s in ready:
                self._fail(s, exc)
            return
        elapsed = time.perf_counter() - t0
        self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * len(ready) / max(elapsed, 1e-6) if self.tokens_per_s \
            else len(ready) / max(elapsed, 1e-6)
        for row, s in enumerate(ready):
            s.costs.append(cost)
            s.pos += 1
            s.take(logits[row])
            if s.reason:
                self._finish(s)

    def _finish(self, s: Sequence) -> None:
        """Emit the rest of the text and the summary, and free the slot."""
        if s.reason != "stop":
            if piece := s.text.flush():
                s.job.emit("text", piece)
        stats = self.model.stats_of(s.costs, s.prompt_costs)
        stats["decode_tokens"] = max(len(s.tokens) - 1, 0)  # this sequence's own (the first comes from the prompt)
        stats["batch"] = np.mean([c.batch for c in s.costs[s.prompt_costs:]]).item() if s.tokens[1:] else 1.0
        n, p = len(s.tokens), len(s.ids)
        self._leave(s)
        self._end(s.job, "done", {"finish_reason": FINISH_REASON[s.reason],
                                  "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n},
                                  "flashllm": {"stop_reason": s.reason, "stats": stats}})

    def _leave(self, s: Sequence) -> None:
        """Take `s` out of the batch (its slot is free) before its client learns that it ended."""
        with self._cond:
            if s in self._running:
                self._running.remove(s)

    def _fail(self, s: Sequence, exc: Exception) -> None:
        from flashllm.serve.openai_api import APIError

        self._leave(s)
        self._end(s.job, "error", APIError(400, str(exc)))

    @staticmethod
    def _end(job: Job, kind: str | None = None, value=None) -> None:
        """The job's last events: `kind` (if any), then end; once."""
        if job.ended:
            return
        job.ended, job.state = True, "done"
        if kind is not None:
            job.emit(kind, value)
        job.emit("end")
