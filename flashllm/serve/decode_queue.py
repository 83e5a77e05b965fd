"""One decode at a time for a server: a worker thread runs admitted jobs in order.

Admission is bounded (the running job plus `max_waiting` queued ones); a full queue refuses at once
instead of letting clients pile up. A job can be cancelled at any time: a queued one is skipped, a
running one stops before its next token (the worker checks `cancelled` between tokens), and either
way its slot is free the moment `cancel` returns.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from typing import Callable


class Job:
    """One request's generation: `work(job)` runs in the worker thread and reports through `emit`;
    the event loop reads `(kind, value)` events from `events`."""

    def __init__(self, owner: "DecodeQueue", work: Callable[["Job"], None], loop: asyncio.AbstractEventLoop):
        self.owner, self.work, self.loop = owner, work, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.state = "queued"  # queued -> running -> done

    def emit(self, kind: str, value=None) -> None:
        """From the worker: hand an event to the waiting request (dropped if the server loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # event loop closed during shutdown
            pass

    def cancel(self) -> None:
        """Stop this job (before its next token if running) and free its slot now; idempotent."""
        self.cancelled.set()
        self.owner._release(self)


class DecodeQueue:
    """A single worker thread plus bounded admission; `submit` returns None when full."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._jobs: queue.Queue = queue.Queue()
        self._admitted: set[Job] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="flashllm-decode", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[Job], None]) -> Job | None:
        """Queue `work` (called in the worker with its Job); None if the running job and `max_waiting`
        queued ones already hold every slot."""
        job = Job(self, work, asyncio.get_running_loop())
        with self._lock:
            if len(self._admitted) >= 1 + self.max_waiting:
                return None
            self._admitted.add(job)
        self._jobs.put(job)
        return job

    def counts(self) -> dict:
        """Admitted jobs by state: {"running": 0 or 1, "queued": n, "max_queued": max_waiting}."""
        with self._lock:
            running = sum(j.state == "running" for j in self._admitted)
            return {"running": running, "queued": len(self._admitted) - running, "max_queued": self.max_waiting}

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every admitted job and wait for the worker to finish its current token."""
        with self._lock:
            jobs = list(self._admitted)
        for job in jobs:
            job.cancel()
        self._jobs.put(None)
        self._thread.join(timeout)

    def _release(self, job: Job) -> None:
        with self._lock:
            self._admitted.discard(job)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                continue
            job.state = "running"
            try:
                job.work(job)
            except Exception as exc:  # a bug, not a bad request: keep serving, log the traceback here
                traceback.print_exc(file=sys.stderr)
                job.emit("error", exc)
            finally:
                job.state = "done"
                self._release(job)
                job.emit("end")
