"""`flashllm chat` in a real pseudo-terminal: streamed multi-turn replies, --stats, clean exits."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

import flashllm

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")
PROMPT = b">>> "


def _own_terminal() -> None:
    """In the child: a new session whose controlling terminal is the pty, so Ctrl-C sends SIGINT (with
    SIGINT's default action: a disposition of ignore, set in the test process, would pass to the child)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """`flashllm chat ...` with its stdin/stdout on a pty (stderr captured apart)."""

    def __init__(self, *args: str):
        master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "flashllm.cli.main", "chat", *args], stdin=slave,
                                     stdout=slave, stderr=subprocess.PIPE, close_fds=True, preexec_fn=_own_terminal,
                                     env={**os.environ, "TERM": "dumb"})
        os.close(slave)
        self.fd, self.out = master, b""

    def read_until(self, marker: bytes, seconds: float = 120) -> bytes:
        """Terminal output up to and including the next `marker`."""
        deadline = time.monotonic() + seconds
        while marker not in self.out:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} in {self.out!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    self.out += os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    break
        assert marker in self.out, self.out
        head, _, self.out = self.out.partition(marker)
        return head + marker

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def finish(self, seconds: float = 120) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"chat did not exit within {seconds} s; terminal: {self.out!r}, stderr: "
                        f"{self.proc.communicate()[1]!r}")
        finally:
            os.close(self.fd)
        return self.proc.returncode, err.decode()


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory):
    import shutil

    out = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_models("opt").model_dir, out)
    return out


def test_multi_turn_chat_streams_and_exits_on_eof(chat_model):
    model = flashllm.load(chat_model)
    model.chat_template = "plain"
    first = [{"role": "system", "content": "hi"}, {"role": "user", "content": "fox"}]
    want1 = model.chat(first, max_new_tokens=5)
    second = first + [{"role": "assistant", "content": want1}, {"role": "user", "content": "dog"}]
    want2 = model.chat(second, max_new_tokens=5)

    term = Terminal(str(chat_model), "--chat-template", "plain", "--system", "hi", "--max-new-tokens", "5",
                    "--stats")
    term.read_until(PROMPT)
    term.send(b"fox\r")
    reply1 = term.read_until(PROMPT)
    term.send(b"dog\r")
    reply2 = term.read_until(PROMPT)
    term.send(b"/reset\r")
    term.read_until(PROMPT)
    term.send(b"fox\r")  # a new conversation: the first answer again (greedy)
    reply3 = term.read_until(PROMPT)
    term.send(b"\x04")  # Ctrl-D at the prompt
    code, err = term.finish()
    assert code == 0, err
    # the pty echoes the typed line, then the reply follows on the next line
    assert text(reply1).endswith(f"fox\n{want1}\n>>> ") and text(reply3).endswith(f"fox\n{want1}\n>>> ")
    assert text(reply2).endswith(f"dog\n{want2}\n>>> ")
    assert err.count("per decode token:") == 3 and "Traceback" not in err
    assert err.count("flashllm: conversation reset (the --system prompt stays)") == 1


def test_ctrl_c_at_the_prompt_exits_cleanly(chat_model):
    term = Terminal(str(chat_model), "--chat-template", "plain")
    term.read_until(PROMPT)
    for _ in range(12):  # a Ctrl-C that lands while readline sets up the line can be lost; a user presses again
        term.send(b"\x03")
        try:
            term.proc.wait(10)
            break
        except subprocess.TimeoutExpired:
            pass
    code, err = term.finish()
    assert code == 0 and "Traceback" not in err, err


def test_chat_without_a_template_is_one_clear_line_before_loading(chat_model, capsys, monkeypatch):
    from flashllm.cli.main import main

    def no_load(*args, **kwargs):
        raise AssertionError("loaded the model before checking its chat template")

    monkeypatch.setattr(flashllm, "load", no_load)
    assert main(["chat", str(chat_model)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no chat template" in err and "--chat-template" in err


def text(raw: bytes) -> str:
    return raw.replace(b"\r\n", b"\n").decode()


def test_chat_states_a_context_beyond_the_model(chat_model, capsys, monkeypatch):
    """As generate does: a --context above the model's positions is capped with a warning, not silently."""
    import io

    from flashllm.cli.main import main

    limit = flashllm.load(chat_model).spec.context_limit
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # end of input at the first prompt
    assert main(["chat", str(chat_model), "--chat-template", "plain", "--context", str(limit * 4)]) == 0
    err = capsys.readouterr().err
    assert (f"flashllm: warning: --context {limit * 4}: the model has {limit} positions; the KV cache holds {limit}"
            in err) and f"context {limit} tokens" in err, err
