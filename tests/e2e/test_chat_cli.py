"""``python -m tiny_mindie chat`` in a real terminal (pexpect: a pseudo-terminal, readline and
SIGINT from the terminal's Ctrl-C), and scripted (``--prompt``, piped standard input), with the
model in the process and through a running server (``--url``, mutual TLS)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

UP = "\x1b[A"
#: A prompt the default model answers at length when greedy (hundreds of tokens).
LONG = "Count from 1 to 200, one number per line."
#: A question the default model answers with "Paris" when greedy.
FRANCE = "What is the capital of France? Answer in one word."


def _env(home: str) -> dict:
    return {**os.environ, "TINY_MINDIE_HOME": home, "TERM": "xterm", "PYTHONUNBUFFERED": "1"}


def _ctrl_c_as_in_a_terminal() -> None:
    """In the chat's process: SIGINT's default action, whatever this one inherited (a shell
    without job control starts a background job with SIGINT ignored, and the ignoring would
    pass to the chat, where Ctrl-C then does nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _chat(model_path: str, home: str) -> pexpect.spawn:
    """A ``chat`` session on the default model in a pseudo-terminal, at its first prompt."""
    child = pexpect.spawn(sys.executable, ["-m", "tiny_mindie", "chat", "--model", model_path,
                                           "--max-seq-len", "1024", "--verbose"],
                          env=_env(home), encoding="utf-8", timeout=180, dimensions=(40, 200),
                          preexec_fn=_ctrl_c_as_in_a_terminal)
    child.expect("chatting with")
    child.expect_exact(">>> ")
    return child


def _interrupt(child: pexpect.spawn, prompt: str, tries: int = 3) -> None:
    """Ask ``prompt`` (a long answer) and press Ctrl-C once its second line is on the screen:
    the answer stops there, ``(stopped)``. Where the whole answer had already been written
    before the key arrived (pexpect reading late on a loaded host), Ctrl-C lands at the prompt
    instead; the conversation is then cleared and the question asked again, up to ``tries``
    times."""
    for _ in range(tries):
        child.sendline(prompt)
        child.expect(r"2\. 2")
        child.sendintr()
        stopped = child.expect_exact(["(stopped)", "(Ctrl-D or /bye quits)"]) == 0
        child.expect_exact(">>> ")
        if stopped:
            return
        _command(child, "/reset", "conversation cleared")
    raise AssertionError(f"every answer ended before Ctrl-C reached it ({tries} tries)")


def _command(child: pexpect.spawn, line: str, answer: str) -> None:
    child.sendline(line)
    child.expect(answer)
    child.expect_exact(">>> ")


def test_a_terminal_chat_streams_stops_on_ctrl_c_saves_and_loads(model_path, tmp_path):
    home, saved, again = str(tmp_path), str(tmp_path / "chat.json"), str(tmp_path / "again.json")
    child = _chat(model_path, home)
    _command(child, "/set temperature 0", "temperature 0.0")
    _command(child, "/set max_tokens 600", "max_tokens 600")
    _command(child, "/system You are terse.", "system prompt set")
    # streaming: the first numbers are on the screen while the answer goes on, and Ctrl-C
    # stops it there (an answer printed whole at its end could not be interrupted midway)
    _interrupt(child, LONG)
    # the chat goes on: a multi-line block, answered with its stats line (--verbose)
    child.sendline('"""')
    child.expect_exact("... ")
    child.sendline("Say the word")
    child.expect_exact("... ")
    child.sendline('banana."""')
    child.expect(r"prompt \d+ tokens \(\d+ cached\), \d+ tokens, TTFT \d+ ms, [\d.]+ tokens/s")
    child.expect_exact(">>> ")
    _command(child, f"/save {saved}", f"saved 5 messages to {saved}")
    conversation = json.load(open(saved))
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user",
                                                 "assistant"]
    assert conversation[0]["content"] == "You are terse."
    assert conversation[1]["content"] == LONG
    partial = conversation[2]["content"]
    assert partial.startswith("1. 1\n2. 2") and "200. 200" not in partial   # cut short
    assert conversation[3]["content"] == "Say the word\nbanana."
    _command(child, "/reset", "conversation cleared")
    _command(child, "/stats", r"prompt \d+ tokens")
    _command(child, f"/load {saved}", f"loaded 5 messages from {saved}")
    _command(child, f"/save {again}", f"saved 5 messages to {again}")
    assert json.load(open(again)) == conversation
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_the_input_history_outlives_the_session_and_ctrl_d_quits(model_path, tmp_path):
    home = str(tmp_path)
    child = _chat(model_path, home)
    _command(child, "/set top_k 7", "top_k 7")
    _command(child, "/set top_k -", "top_k unset")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert os.stat(os.path.join(home, "chat_history")).st_mode & 0o777 == 0o600
    history = open(os.path.join(home, "chat_history")).read().splitlines()
    assert history[-2:] == ["/set top_k 7", "/set top_k -"]
    child = _chat(model_path, home)
    child.send(UP + UP)          # the line before the last one, recalled and sent again
    child.sendline("")
    child.expect_exact("top_k 7")
    child.expect_exact(">>> ")
    _command(child, "/set", "top_k 7")
    child.sendline("/bye")
    child.expect(pexpect.EOF)


def test_a_piped_prompt_prints_one_answer_and_exits_0(model_path, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tiny_mindie", "chat", "--model", model_path,
                          "--max-seq-len", "512", "--temperature", "0"], input=FRANCE,
                         capture_output=True, text=True, env=_env(str(tmp_path)), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "loading" in out.stderr and "loading" not in out.stdout   # progress on stderr


def test_prompt_through_a_running_server_over_mutual_tls(server, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tiny_mindie", "chat", "--url", server.url,
                          "--config", server.config_path, "--prompt",
                          FRANCE, "--verbose", "--temperature", "0",
                          "--max-tokens", "40"],
                         capture_output=True, text=True, env=_env(str(tmp_path)), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "tokens/s" in out.stderr


def test_errors_go_to_stderr_with_a_non_zero_exit(server, tmp_path):
    # a server without our client certificate: the configuration's certificates are missing
    out = subprocess.run([sys.executable, "-m", "tiny_mindie", "chat", "--url", server.url,
                          "--prompt", "hi"], capture_output=True, text=True,
                         env=_env(str(tmp_path)), timeout=120)
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr.startswith("tiny_mindie: error: ") and "is missing" in out.stderr
    # the server refuses a turn: the prompt is longer than maxInputTokenLen
    out = subprocess.run([sys.executable, "-m", "tiny_mindie", "chat", "--url", server.url,
                          "--config", server.config_path], input="word " * 3000,
                         capture_output=True, text=True, env=_env(str(tmp_path)), timeout=120)
    assert out.returncode == 1
    assert "the server answered 400" in out.stderr and "context length" in out.stderr
    assert out.stderr.count("\n") == 1 and out.stdout == ""


def test_ctrl_c_stops_a_running_servers_answer_and_the_chat_goes_on(server, tmp_path):
    child = pexpect.spawn(sys.executable, ["-m", "tiny_mindie", "chat", "--url", server.url,
                                           "--config", server.config_path, "--temperature", "0",
                                           "--max-tokens", "200"],
                          env=_env(str(tmp_path)), encoding="utf-8", timeout=180,
                          preexec_fn=_ctrl_c_as_in_a_terminal)
    child.expect("chatting with smollm2-135m-instruct")
    child.expect_exact(">>> ")
    _interrupt(child, LONG)
    child.sendline(FRANCE)
    child.expect("Paris")
    child.expect_exact(">>> ")
    _command(child, "/stats", r"prompt \d+ tokens \(\d+ cached\), \d+ tokens")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_thinking_models_reasoning_is_shown_apart(vocab_dir, tmp_path):
    """A scripted tiny Qwen3 (tests/support/tiny_chat.py) that thinks, then answers: the reasoning
    goes to stderr in a script and between Thinking... and ...done thinking. in the terminal; only
    the answer is kept in the conversation."""
    import dataclasses

    from tiny_arch import CASES
    from tiny_chat import template_source, vocabulary, write_scripted

    path = str(tmp_path / "tiny-qwen3.gguf")
    vocab = vocabulary("qwen3", "ggml-vocab-qwen2.gguf", vocab_dir, tool_tokens=True)
    write_scripted(path, dataclasses.replace(CASES["qwen3"], ctx=512), vocab,
                   template_source(vocab_dir, "Qwen-Qwen3-0.6B"),
                   "<think>Checking the weather</think>Sure.", "<|im_end|>")
    run = [sys.executable, "-m", "tiny_mindie", "chat", "--model", path, "--backend", "numpy",
           "--temperature", "0"]
    out = subprocess.run([*run, "--prompt", "Weather?"], capture_output=True, text=True,
                         env=_env(str(tmp_path)), timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Sure."
    assert "Checking the weather" in out.stderr
    saved = str(tmp_path / "chat.json")
    child = pexpect.spawn(sys.executable, run[1:], env=_env(str(tmp_path)), encoding="utf-8",
                          timeout=180)
    child.expect_exact(">>> ")
    child.sendline("Weather?")
    child.expect(r"\x1b\[2mThinking\.\.\.\r?\nChecking the weather\s*"
                 r"\.\.\.done thinking\.\r?\n\x1b\[0m")
    child.expect_exact("Sure.")
    child.expect_exact(">>> ")
    _command(child, f"/save {saved}", "saved 2 messages")
    assert json.load(open(saved))[1] == {"role": "assistant", "content": "Sure."}
    child.sendline("/bye")
    child.expect(pexpect.EOF)
