"""Progress bars on stderr that stay out of logs."""

from __future__ import annotations

import sys


def progress_bar(progress: bool | None = None, **kwargs):
    """A tqdm bar on stderr (`kwargs` go to tqdm). `progress`: True shows it, False hides it, None (the
    default of every command) shows it only where stderr is a terminal: redirected to a file (`2>log`) its
    carriage-return updates would fill the log, and the commands log their steps in lines anyway."""
    from tqdm import tqdm

    return tqdm(disable=None if progress is None else not progress, **kwargs)


def log_line(message: str) -> None:
    """One log line on stderr, written above a live progress bar (tqdm.write clears and redraws it) rather
    than onto the bar's line; the same plain line where no bar shows (`2>log`)."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()
