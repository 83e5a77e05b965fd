"""What the CLI writes besides the generated text: flashllm's own warnings as one `flashllm: warning:` line each
(other libraries' warnings keep Python's format), started on a line of their own while streamed text is open."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

text_line_open = False  # generate has streamed text whose line is not ended yet


def same_terminal() -> bool:
    """stdout and stderr are the one terminal (where a warning would be glued to the streamed text)."""
    try:
        return sys.stdout.isatty() and sys.stderr.isatty() and os.path.samestat(os.fstat(1), os.fstat(2))
    except (OSError, ValueError):
        return False


def one_line_warning(message, category, filename, lineno, file=None, line=None) -> str:
    """A runtime warning (dropped neurons, buffered I/O) as one `flashllm: warning:` line, no source line, on a
    line of its own in a terminal that shows streamed text too; the options a warning names are spelled as flags."""
    lead = "\n" if text_line_open and same_terminal() else ""
    return f"{lead}flashllm: warning: {message.cli_message() if hasattr(message, 'cli_message') else message}\n"


def _source_roots() -> tuple[str, ...]:
    """The directories flashllm's code runs from (the runtime, and the converters and predictors, which an
    editable install maps from folders of their own)."""
    import flashllm
    import flashllm.converters
    import flashllm.predictors

    return tuple(str(Path(m.__file__).resolve().parent) + os.sep
                 for m in (flashllm, flashllm.converters, flashllm.predictors))


def is_ours(category, filename: str) -> bool:
    """A warning flashllm raised: its own warning class, or raised from flashllm's code."""
    from flashllm.errors import OptionsWarning

    if issubclass(category, OptionsWarning):
        return True
    try:
        return str(Path(filename).resolve()).startswith(_source_roots())
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def flashllm_warnings():
    """While the command runs, flashllm's warnings are formatted as `one_line_warning` lines and any other warning
    as before; `warnings.formatwarning` is restored afterwards. (Formatting, not showing: where warnings are
    recorded instead of shown, as under `warnings.catch_warnings(record=True)`, they stay recorded.)"""
    format_before = warnings.formatwarning

    def format_(message, category, filename, lineno, line=None):
        if is_ours(category, filename):
            return one_line_warning(message, category, filename, lineno)
        return format_before(message, category, filename, lineno, line)

    warnings.formatwarning = format_
    try:
        yield
    finally:
        if warnings.formatwarning is format_:
            warnings.formatwarning = format_before


def discard_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout without a file descriptor (tests, embedding)
        pass
