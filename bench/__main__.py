"""`python -m bench SUITE [COMMAND] [ARGS]`: run one benchmark and append its result record to
bench/results/<suite>.jsonl; `python -m bench report [SUITE ...]` renders the records as markdown."""

from __future__ import annotations

import importlib
import sys

from bench import SUITES

USAGE = """usage: python -m bench [--no-record] SUITE [COMMAND] [ARGS ...]
       python -m bench report [SUITE ...]
       python -m bench SUITE [COMMAND] --help

  --no-record   do not append the result to bench/results/<suite>.jsonl (smoke runs, tiny sizes)

suites and commands:"""


def usage() -> str:
    lines = [USAGE]
    for suite, entry in SUITES.items():
        lines.append(f"  {suite:10s} " + (" | ".join(entry) if isinstance(entry, dict) else "(one command)"))
    lines.append("  report     render bench/results/<suite>.jsonl as markdown")
    return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[str, str | None, str, list[str]]:
    """(suite, command, module, the command's own arguments) from the command line."""
    if not argv or argv[0] not in SUITES:
        raise SystemExit(usage() if not argv or argv[0] in ("-h", "--help") else
                         f"python -m bench: unknown suite {argv[0]!r}\n\n{usage()}")
    suite, entry = argv[0], SUITES[argv[0]]
    if isinstance(entry, str):
        return suite, None, entry, argv[1:]
    if len(argv) < 2 or argv[1] not in entry:
        given = f"unknown command {argv[1]!r} of " if len(argv) > 1 and not argv[1].startswith("-") else ""
        raise SystemExit(f"python -m bench {suite}: {given}one of: {', '.join(entry)}")
    return suite, argv[1], entry[argv[1]], argv[2:]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    keep = "--no-record" not in argv[:1]
    argv = argv[1:] if not keep else argv
    if argv[:1] == ["report"]:
        from bench import report

        report.main(argv[1:])
        return
    suite, command, module, args = resolve(argv)
    from bench import harness

    load = harness.load()
    sys.argv[0] = " ".join(["python -m bench", suite, *([command] if command else [])])  # argparse's usage line
    result = importlib.import_module(module).main(args)
    if keep and isinstance(result, (dict, list)) and result:
        path = harness.append(harness.record(suite, command, args, result, load))
        print(f"bench: result appended to {path.relative_to(harness.ROOT)}", file=sys.stderr)
    if isinstance(result, int) and not isinstance(result, bool):
        raise SystemExit(result)


if __name__ == "__main__":
    main()
