"""The `flashllm` command: help and defaults, prompt sources, option checks, stop reasons, no tracebacks."""

import argparse
import io
import json
import shutil
import subprocess
import sys

import pytest

import flashllm
from flashllm.cli.main import build_parser, main

PROMPT = "the quick brown"


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, *needles) -> None:
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.fixture
def flash(tiny_models, tmp_path):
    """A private copy of the converted tiny Llama (Metaspace tokenizer)."""
    dst = tmp_path / "flash"
    shutil.copytree(tiny_models("llama").model_dir, dst)
    return dst


def all_parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def test_help_states_every_default_and_describes_every_argument():
    """In every subcommand's --help: a line of help for each argument (MODEL_DIR included), the default of
    each option, and "(required)" rather than "default: none" for a required one."""
    for parser in all_parsers(build_parser()):
        assert "%%" not in parser.format_help(), parser.prog  # a description is not %-formatted: write 50%
        formatter = parser._get_formatter()
        for action in parser._actions:
            where = (parser.prog, action.option_strings or action.dest)
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and not action.help.startswith("("), where  # says what it does, not only its default
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue  # positionals, -h, --version
            shown = " ".join(formatter._format_action(action).split())
            one_of = any(g.required and action in g._group_actions for g in parser._mutually_exclusive_groups)
            assert ("required" in shown and "default" not in shown) if action.required or one_of \
                else "default" in shown, (where, shown)


def test_version(capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out.strip() == f"flashllm {flashllm.__version__}"


@pytest.mark.parametrize("option,value", [("--max-new-tokens", "-1"), ("--temperature", "-0.5"),
                                          ("--temperature", "nan"), ("--top-p", "0"), ("--top-p", "1.5"),
                                          ("--max-new-tokens", "ten"), ("--window", "0"), ("--threads", "0"),
                                          ("--context", "-5"), ("--aio-depth", "-1"), ("--hybrid-fraction", "2")])
def test_bad_sampling_and_load_options_are_one_line_errors(capsys, flash, option, value):
    """Each names the option as typed (not the Python field) and exits 2 before loading."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        main(["generate", str(flash), "--prompt", PROMPT, option, value])
    assert exit.value.code == 2
    one_line_error(capsys.readouterr().err, option, repr(value))


@pytest.mark.parametrize("argv,prog", [(["generate", "m", "--prompt", "x", "--bogus"], "flashllm generate"),
                                       (["predictors", "eval", "m", "--data", "d", "--bogus"], "flashllm predictors eval"),
                                       (["chat", "m", "stray"], "flashllm chat"),
                                       (["--bogus", "inspect", "m"], "flashllm")])
def test_an_unknown_argument_is_refused_by_the_subcommand_it_follows(capsys, argv, prog):
    """The error names the subcommand and points at its --help, not at the top-level parser's."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    one_line_error(err, f"{prog}: error: unrecognized arguments: {argv[-1] if prog != 'flashllm' else argv[0]}",
                   f"(see {prog} --help)")


def test_json_reports_stop_reason_and_stop_strings(capsys, flash):
    code, out, _ = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--max-new-tokens", 12, "--json")
    full = json.loads(out)
    assert code == 0 and full["stop_reason"] in ("eos", "length") and len(full["token_ids"]) <= 12
    stop = full["text"].strip()[1:3]
    code, out, _ = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--max-new-tokens", 12, "--json",
                           "--stop", "zzzz", "--stop", stop)
    cut = json.loads(out)
    assert cut["stop_reason"] == "stop" and cut["text"] == full["text"][:full["text"].index(stop)]
    # token_ids: every new token, the stop string's included (as --help says)
    assert cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])]
    assert stop in flashllm.load(flash).tokenizer.decode(cut["token_ids"])
    code, out, err = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--max-new-tokens", 12, "--stop", stop)
    assert out == full["text"][:full["text"].index(stop)] + "\n" and err == ""


def test_context_end_is_reported(capsys, flash):
    n_prompt = len(flashllm.load(flash).tokenizer.encode(PROMPT))
    context = n_prompt + 3
    code, out, _ = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--context", context, "--json",
                           "--max-new-tokens", 50)
    result = json.loads(out)  # the KV cache holds the prompt and 3 new tokens; the 4th is sampled from its logits
    assert result["stop_reason"] == "context" and len(result["token_ids"]) == 4
    code, out, err = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--context", context,
                             "--max-new-tokens", 50)
    assert code == 0 and "end of the context" in err and f"{context} tokens" in err and "--context" in err


def test_a_context_beyond_the_model_is_stated_and_the_end_note_does_not_ask_for_more(capsys, flash):
    """--context above the model's positions is capped with a warning; at the model's own end the note does not
    suggest a larger --context."""
    limit = flashllm.load(flash).spec.context_limit
    code, out, err = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--context", limit * 4,
                             "--max-new-tokens", limit * 2)
    lines = err.strip().splitlines()
    assert code == 0 and len(lines) == 2, err
    assert lines[0] == (f"flashllm: warning: --context {limit * 4}: the model has {limit} positions; the KV cache "
                        f"holds {limit}")
    assert f"end of the context ({limit} tokens)" in lines[1] and "--context" not in lines[1], err


def test_a_prompt_longer_than_the_context_says_the_model_caps_a_larger_one(capsys, flash):
    """A prompt past the model's own positions: the error does not just say 'load with a larger context'
    (at the model's limit that cannot help; a newcomer's `git diff | flashllm generate` tried it), it says
    a larger context helps only where the model has more positions and where to see them."""
    limit = flashllm.load(flash).spec.context_limit
    code, out, err = run_cli(capsys, "generate", flash, "--prompt", PROMPT * limit)
    assert code != 0 and f"but the context holds {limit}" in err, err
    assert out == ""  # no text was written: not even its line's end
    assert "if the model has more positions: `flashllm inspect MODEL` shows them" in err
    code, out, _ = run_cli(capsys, "inspect", flash)
    assert code == 0 and f"context {limit}" in out  # where the error sends the user, the limit is shown


def test_prompt_from_file_and_stdin(capsys, flash, tmp_path, monkeypatch):
    _, expected, _ = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--max-new-tokens", 6)
    (tmp_path / "p.txt").write_text(PROMPT)
    assert run_cli(capsys, "generate", flash, "--prompt-file", tmp_path / "p.txt", "--max-new-tokens", 6)[1] == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    assert run_cli(capsys, "generate", flash, "--prompt", "-", "--max-new-tokens", 6)[1] == expected
    code, _, err = run_cli(capsys, "generate", flash, "--prompt-file", tmp_path / "none.txt")
    assert code == 1
    one_line_error(err, "none.txt", "cannot read")
    with pytest.raises(SystemExit):
        capsys.readouterr()
        main(["generate", str(flash), "--prompt", "x", "--prompt-file", str(tmp_path / "p.txt")])
    one_line_error(capsys.readouterr().err, "not allowed with")
    # an empty prompt (an empty stdin, file or argument) is refused, not generated from nothing
    (tmp_path / "empty.txt").write_text("")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    for source, where in ((["--prompt", "-"], "stdin"), (["--prompt", ""], "the text given"),
                          (["--prompt-file", tmp_path / "empty.txt"], "empty.txt")):
        code, out, err = run_cli(capsys, "generate", flash, *source)
        assert code == 1 and out == ""
        one_line_error(err, "the prompt is empty", where)


def converted_after(edit, tiny_models, tmp_path):
    """The tiny Llama converted from a checkpoint that `edit(ckpt_dir)` changed first."""
    from flashllm.converters import convert

    ckpt = tmp_path / "hf"
    shutil.copytree(tiny_models("llama").ckpt, ckpt)
    edit(ckpt)
    return convert(ckpt, tmp_path / "flash", progress=False)


def test_missing_tokenizer_says_how_to_proceed(capsys, tiny_models, tmp_path):
    """convert says at its end that no tokenizer came along and what follows; generate then says what to do."""
    ckpt = tmp_path / "hf"
    shutil.copytree(tiny_models("llama").ckpt, ckpt)
    code, _, err = run_cli(capsys, "convert", ckpt, tmp_path / "with")
    assert code == 0 and err == ""  # a checkpoint with its tokenizer: no note
    (ckpt / "tokenizer.json").unlink()
    flash = tmp_path / "flash"
    code, out, err = run_cli(capsys, "convert", ckpt, flash)
    assert code == 0 and out == f"wrote {flash}\n"
    assert err == (f"flashllm: note: no tokenizer.json in {ckpt}, so none was copied: text prompts (generate, chat, "
                   f"serve) will fail until the model's tokenizer.json (and tokenizer_config.json) is copied into "
                   f"{flash}; without it, give token ids from Python (Model.generate_ids)\n"), err
    code, _, err = run_cli(capsys, "generate", flash, "--prompt", PROMPT)
    assert code == 1
    one_line_error(err, "tokenizer.json", "copy", "generate_ids")
    assert list(flashllm.load(flash).generate_ids([1, 5, 7], max_new_tokens=2))  # token ids work without it


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_malformed_tokenizer_config(capsys, tiny_models, tmp_path, content):
    flash = converted_after(lambda ckpt: (ckpt / "tokenizer_config.json").write_text(content), tiny_models, tmp_path)
    code, _, err = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--seed", 0)
    assert code == 1
    one_line_error(err, "tokenizer_config.json")


def test_missing_predictors_names_file_and_option(capsys, tiny_models, tmp_path):
    flash = tmp_path / "flash"
    shutil.copytree(tiny_models("opt").model_dir, flash)
    code, _, err = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--mode", "sparse", "--dram-budget", 1.0)
    assert code == 1
    one_line_error(err, "predictors.json", "flashllm predictors train", "--predictor oracle")
    assert "predictor='" not in err


def test_closed_pipe_is_quiet(flash):
    """`flashllm generate ... | head -c 1`: no traceback, no 'Exception ignored' at exit."""
    proc = subprocess.Popen([sys.executable, "-m", "flashllm.cli.main", "generate", str(flash), "--prompt", PROMPT,
                             "--max-new-tokens", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first byte
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and err == "", err


def test_an_error_after_streamed_text_starts_on_its_own_line(capsys, flash, monkeypatch):
    """Text streamed without a final newline is ended before the error is written (it was glued to it)."""
    from flashllm.model import Model

    def fail_midway(self, *a, **k):
        yield "partial"
        raise flashllm.FlashLLMError("layer 0: refused")

    monkeypatch.setattr(Model, "stream", fail_midway)
    code, out, err = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--max-new-tokens", 4)
    assert code == 1 and out == "partial\n" and err == "flashllm: error: layer 0: refused\n"


@pytest.mark.parametrize("same_terminal", [True, False])
def test_a_warning_while_text_streams_starts_on_its_own_line_in_a_terminal(capsys, flash, monkeypatch, same_terminal):
    """A runtime warning raised mid-stream (e.g. dropped neurons) gets a line of its own where stdout and stderr
    are one terminal (it was glued to the streamed text); redirected output is left as it is."""
    import warnings

    from flashllm.cli import console
    from flashllm.errors import OptionsWarning
    from flashllm.model import Model

    def warn_midway(self, *a, **k):
        yield "partial"
        warnings.warn(OptionsWarning("caches too small"))
        yield " more\n"
        warnings.warn(OptionsWarning("again at a line start"))
        yield "end"

    monkeypatch.setattr(Model, "stream", warn_midway)
    monkeypatch.setattr(console, "same_terminal", lambda: same_terminal)
    # shown as outside pytest (which records warnings instead of writing them)
    monkeypatch.setattr(warnings, "showwarning", lambda m, c, f, n, file=None, line=None:
                        sys.stderr.write(warnings.formatwarning(m, c, f, n, line)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code, out, err = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--max-new-tokens", 4)
    lead = "\n" if same_terminal else ""
    assert code == 0 and out == "partial more\nend\n"
    assert err == f"{lead}flashllm: warning: caches too small\nflashllm: warning: again at a line start\n"


def test_only_flashllm_warnings_take_the_cli_form_and_the_display_is_restored(capsys, flash, monkeypatch):
    """main() formats flashllm's own warnings (its warning classes, or raised from its code) as `flashllm:
    warning:` lines; another library's warning keeps Python's format; afterwards warnings.formatwarning is what
    it was, so a program that runs the CLI in-process keeps its own warning format."""
    import warnings
    from pathlib import Path

    from flashllm.model import Model
    from flashllm.modes import registry

    ours = Path(registry.__file__)  # a module of flashllm's runtime

    def warn(self, *a, **k):
        warnings.warn_explicit("from flashllm's code", RuntimeWarning, str(ours), 1)
        warnings.warn_explicit("from another library", DeprecationWarning, "/elsewhere/lib.py", 7)
        yield "text"

    def shown(m, c, f, n, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(m, c, f, n, line))

    monkeypatch.setattr(Model, "stream", warn)
    monkeypatch.setattr(warnings, "showwarning", shown)
    formatwarning = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code, out, err = run_cli(capsys, "generate", flash, "--prompt", PROMPT, "--max-new-tokens", 2)
    assert code == 0 and out == "text\n"
    lines = err.splitlines()
    assert lines[0] == "flashllm: warning: from flashllm's code"
    assert lines[1] == "/elsewhere/lib.py:7: DeprecationWarning: from another library"
    assert warnings.showwarning is shown and warnings.formatwarning is formatwarning


def test_a_missing_predictors_subcommand_is_named_by_its_choices(capsys):
    """`flashllm predictors` alone names the subcommands it needs (it said `predictors_command`, a dest)."""
    with pytest.raises(SystemExit) as exit_:
        main(["predictors"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "required: {train,order,eval}" in err and "predictors_command" not in err


@pytest.mark.parametrize("reads,shown", [(0.45, "0.45"), (2.5, "2.5"), (12.0, "12"), (1234.4, "1234")])
def test_stats_show_the_mean_reads_per_token_with_its_fraction(reads, shown):
    """Reads per decode token are a mean: 0.45 (most tokens found their neurons cached) was printed as 0."""
    from flashllm.cli.stats_text import format_stats

    stats = dict(mode="sparse", backend="torch", decode_tokens=20, dram_bytes=1 << 20, total_ms=1.0, io_ms=0.5,
                 mem_ms=0.1, compute_ms=0.3, predictor_ms=0.1, bytes_read=3 << 16, reads=reads)
    assert f"flash read per token: 0.188 MiB in {shown} reads" in format_stats(stats)
