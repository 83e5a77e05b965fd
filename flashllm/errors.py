"""The one error type users can cause: bad files, bad arguments, budgets that do not fit; and messages
that name load options the way the caller passes them (Python keywords or command-line flags)."""

from __future__ import annotations

import re

_OPTION = re.compile(r"\{([a-z_]+)(?:=([^{}]*))?\}")  # {dram_budget} or {dram_budget=6GiB} in a template


def api_option(name: str, value: str | None = None) -> str:
    """A load option as the Python API takes it: `dram_budget='6GiB'`, `kv_bits=8`, `context`."""
    if value is None:
        return name
    try:
        float(value)
        return f"{name}={value}"
    except ValueError:
        return f"{name}={value!r}"


def cli_option(name: str, value: str | None = None) -> str:
    """A load option as the CLI takes it: `--dram-budget 6GiB`, `--kv-bits 8`, `--context`."""
    flag = "--" + name.replace("_", "-")
    return flag if value is None else f"{flag} {value}"


def name_options(template: str, spell=api_option) -> str:
    """`template` with each `{option}` or `{option=value}` spelled by `spell` (api_option, cli_option)."""
    return _OPTION.sub(lambda m: spell(m.group(1), m.group(2)), template)


class NamesOptions:
    """A message that names load options (written as a `name_options` template): `str()` spells them as the
    Python API's keywords, `cli_message()` as the CLI's flags."""

    def __init__(self, template: str):
        self.template = template
        super().__init__(name_options(template, api_option))

    def cli_message(self) -> str:
        return name_options(self.template, cli_option)


class FlashLLMError(Exception):
    """An expected, user-facing error; the CLI prints its one-line message and exits non-zero."""

    def cli_message(self) -> str:
        """The message as the CLI prints it (a `NamesOptions` error names its options as flags there)."""
        return str(self)


class OptionsError(NamesOptions, FlashLLMError):
    """A user-facing error whose message names load options (a `name_options` template)."""


class OptionsWarning(NamesOptions, RuntimeWarning):
    """A runtime warning whose message names load options (a `name_options` template), e.g. caches too small
    for the predicted sets where nothing is dropped (a batch streams them exactly; `on_overflow='error'` refuses)."""


class DroppedNeuronsWarning(OptionsWarning):
    """Predicted FFN neurons that the neuron caches could not hold were dropped (lowest scores first)."""
