"""The one error type users can cause: bad files, bad arguments, budgets that do not fit."""


class FlashLLMError(Exception):
    """An expected, user-facing error; the CLI prints its one-line message and exits non-zero."""
