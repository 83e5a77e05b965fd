"""Observation hooks: benchmarks and calibration watch the per-token path without patching it.

Events (arguments):
- "ffn_input" (layer, x): the FFN input of a layer, before the mode computes the FFN (every mode);
- "ffn_output" (layer, y): the FFN output of a layer, once the mode computed it (every mode);
- "predict" (layer, mask): a sparse predictor's decision, bool [tokens, d_ffn];
- "fit" (layer, ids): the neurons a sparse decode layer computes, its predicted set cut to what its cache holds
  (the highest-scored; on_overflow "drop"), ascending;
- "read" (io): one call of the flash I/O engine (an IOStats, with its wall time in `wall_s`).
Observers must not change what they are given.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

EVENTS = ("ffn_input", "ffn_output", "predict", "fit", "read")


class Hooks:
    def __init__(self):
        self._observers: dict[str, list[Callable]] = {event: [] for event in EVENTS}

    def _check(self, event: str) -> list[Callable]:
        if event not in self._observers:
            raise ValueError(f"hook event {event!r}: expected one of {', '.join(EVENTS)}")
        return self._observers[event]

    def add(self, event: str, fn: Callable) -> Callable[[], None]:
        """Call `fn` on every `event`; returns a function that removes it again."""
        observers = self._check(event)
        observers.append(fn)
        return lambda: observers.remove(fn)

    @contextmanager
    def observing(self, event: str, fn: Callable):
        """`add` for the duration of a with-block."""
        remove = self.add(event, fn)
        try:
            yield
        finally:
            remove()

    def active(self, event: str) -> bool:
        return bool(self._observers[event])

    def emit(self, event: str, *args) -> None:
        for fn in self._observers[event]:
            fn(*args)
