"""Ctrl-C twice during `tiermoe serve`: the first drains, the second stops at once with status 130 and one line,
without the tracebacks of the requests it cut off (and without claiming success with status 0)."""

from __future__ import annotations

import signal
import socket
import time

from conftest import save_char_tokenizer, save_tiny

from tiermoe.testing.server_process import ServerProcess


def test_a_second_ctrl_c_while_draining_exits_130_with_one_line(tmp_path):
    model = save_tiny("qwen3_moe", tmp_path / "m")
    save_char_tokenizer(model)
    server = ServerProcess(model)
    try:
        # a request whose body never finishes arriving: the drain after the first Ctrl-C waits for it
        held = socket.create_connection(("127.0.0.1", server.port))
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        while "Waiting for connections to close" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.proc.poll() is None, server.log_tail()  # still draining
        server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(timeout=30)
        held.close()
    finally:
        server.stop()
    log = server.log_tail()
    assert code == 130, log
    assert "Traceback" not in log and "ERROR" not in log, log
    assert [line for line in log.splitlines() if line.startswith("interrupted")] == [
        "interrupted: a second Ctrl-C stopped the server at once; the requests still running were cut off"]
