"""The HTTP port answers 503 "starting" while `serve` loads, not "connection refused" (issue 23, the soak's restarts).

A refused connection makes the HTTP SDKs back off exponentially (the tinker SDK's retrieve loop:
1, 2, 4, 8, 16, 30 s), so after a server restart a client slept on for up to 30 s past the moment
the resource was ready (the soak's 16 s pause after a 16 s restart). `serve` now binds the HTTP
port before it loads anything (wire/http/starting.py) and answers every request 503 with
Retry-After, which both SDKs retry at once.

A real `together-train serve` process on a tiny model; the test polls the HTTP port from the moment
the process starts:

- the first answer is a 503 whose JSON names UNAVAILABLE, retryable, with ``Retry-After``; a POST
  with a 1 MB body gets the same answer (the body is read, the connection is not reset);
- then, with no connection refused in between, the real app answers (``/v1/models`` 200), and the
  HTTP port file is written only then.

On the code before this change the port refused connections until the app served, so the first
answer was the app's 200.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_http_port_answers_503_while_starting(tiny_model_dir, tmp_path):
    port = free_port()
    port_file = tmp_path / "http.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "together_train_server.cli", "serve", "--model", str(tiny_model_dir), "--port", "0",
         "--http-port", str(port), "--http-port-file", str(port_file), "--generators", "1",
         "--storage", str(tmp_path / "storage"), "--trainer-threads", "1", "--generator-threads", "1"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    answers: list[tuple[int, bool]] = []  # (status, port file written at that answer)
    first = None
    refused_after_bound = 0
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"serve exited with {proc.returncode}"
            try:
                r = httpx.get(url + "/v1/models", timeout=10)
            except httpx.ConnectError:
                refused_after_bound += bool(answers)
                time.sleep(0.02)
                continue
            if first is None:
                first = r
                post = httpx.post(url + "/api/v1/forward_backward", content=b"x" * (1 << 20), timeout=10,
                                  headers={"Content-Type": "application/json"})
            answers.append((r.status_code, port_file.exists()))
            if r.status_code == 200:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"answers: {len(answers)} ({sum(s == 503 for s, _ in answers)} x 503), first {first.status_code if first else None}")
    assert first is not None, "the HTTP port never answered"
    assert first.status_code == 503, (first.status_code, first.text[:300])
    body = first.json()
    assert body["code"] == "UNAVAILABLE" and body["retryable"] is True and "starting" in body["detail"], body
    assert first.headers.get("retry-after") == "1", dict(first.headers)
    assert post.status_code == 503 and post.json()["code"] == "UNAVAILABLE", (post.status_code, post.text[:300])
    assert answers[-1][0] == 200, answers[-5:]
    assert all(s == 503 and not written for s, written in answers[:-1]), answers
    assert refused_after_bound == 0, f"{refused_after_bound} connections refused after the port first answered"
