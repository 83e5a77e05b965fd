"""Where flashllm keeps what it makes outside model directories (the demo's converted models, the machine and
disk profiles, the built native kernels): under one root, so that a user or an app can move all of it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """$FLASHLLM_CACHE, else $XDG_CACHE_HOME/flashllm, else ~/.cache/flashllm."""
    if os.environ.get("FLASHLLM_CACHE"):
        return Path(os.environ["FLASHLLM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashllm"
