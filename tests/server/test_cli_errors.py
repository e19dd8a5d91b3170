"""`together-train serve` user errors at startup: one line naming the problem, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "together_train_server.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, expected", [
    (["serve", "--zero-stage", "3"], "--zero-stage applies to --trainer deepspeed only"),
    (["serve", "--deepspeed-config", "x.json"], "--deepspeed-config applies to --trainer deepspeed only"),
    (["serve", "--mode", "full"], "--mode full needs --trainer deepspeed"),
    (["serve", "--model", "/nonexistent/model-dir", "--port", "0"], "/nonexistent/model-dir"),
    # Size flags are refused while parsing, naming the flag: a NaN used to turn the prefix cache off silently,
    # inf / NaN budgets failed after the model loaded (OverflowError traceback / an unnamed 'float NaN').
    (["serve", "--prefix-cache-mb", "-5"], "--prefix-cache-mb: must be a finite number of MiB >= 0, got '-5'"),
    (["serve", "--prefix-cache-mb", "nan"], "--prefix-cache-mb: must be a finite number of MiB >= 0, got 'nan'"),
    (["serve", "--memory-budget-mb", "inf"], "--memory-budget-mb: must be a finite number of MiB >= 0, got 'inf'"),
    (["serve", "--memory-budget-mb", "-1"], "--memory-budget-mb: must be a finite number of MiB >= 0, got '-1'"),
    (["serve", "--memory-budget-mb", "lots"], "--memory-budget-mb: must be a number of MiB, got 'lots'"),
    (["serve", "--memory-budget-mb", "1"], "'1' MiB is below the 96 MiB every operation is estimated to need"),
    (["generator", "--prefix-cache-mb", "nan"], "--prefix-cache-mb: must be a finite number of MiB >= 0"),
    # 1e-7 MiB rounded to 0 bytes in the engine: the replica exited after loading its model, the resource with it.
    (["serve", "--prefix-cache-mb", "1e-7"], "--prefix-cache-mb: '1e-7' MiB holds no prefix block: give 0 (off) or at least 1"),
    (["generator", "--prefix-cache-mb", "0.5"], "--prefix-cache-mb: '0.5' MiB holds no prefix block"),
    # Paging flags too: an inf budget raised OverflowError in build_resource, after the model and replicas loaded.
    (["serve", "--session-memory-mb", "inf"], "--session-memory-mb: must be a finite number of MiB >= 0, got 'inf'"),
    (["serve", "--session-memory-mb", "-1"], "--session-memory-mb: must be a finite number of MiB >= 0, got '-1'"),
    (["serve", "--page-out-idle", "nan"], "--page-out-idle: must be a finite number of seconds >= 0, got 'nan'"),
    # Counts: --max-sessions 0 made every create_session RESOURCE_EXHAUSTED, a negative --max-adapters was taken.
    (["serve", "--max-sessions", "0"], "--max-sessions: must be an integer >= 1, got '0'"),
    (["serve", "--max-sessions", "-4"], "--max-sessions: must be an integer >= 1, got '-4'"),
    (["serve", "--max-sessions", "2.5"], "--max-sessions: must be an integer, got '2.5'"),
    (["serve", "--max-adapters", "-1"], "--max-adapters: must be an integer >= 0, got '-1'"),
    (["generator", "--max-adapters", "-1"], "--max-adapters: must be an integer >= 0, got '-1'"),
    # Sizes taken when negative or zero (or, --micro-batch-tokens, refused only once the model had loaded).
    (["serve", "--micro-batch-tokens", "-5"], "--micro-batch-tokens: must be an integer of tokens >= 1, got '-5'"),
    (["serve", "--max-tokens-per-batch", "0"], "--max-tokens-per-batch: must be an integer of tokens >= 1, got '0'"),
    (["serve", "--max-samples-per-batch", "-1"],
     "--max-samples-per-batch: must be an integer of samples >= 1, got '-1'"),
    (["serve", "--generators", "-2"], "--generators: must be an integer >= 0, got '-2'"),
])
def test_startup_errors_are_one_line(args, expected):
    proc = _serve(*args)
    assert proc.returncode != 0
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_deepspeed_launcher_local_rank_argument_is_accepted():
    # `deepspeed --module together_train_server.cli serve ...` runs `... cli --local_rank=0 serve ...`.
    proc = _serve("--local_rank=0", "serve", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--zero-stage" in proc.stdout


@pytest.mark.parametrize("recipe", ["sft", "rl", "dpo", "distill", "main"])
def test_every_recipe_help_renders(recipe):
    proc = subprocess.run([sys.executable, "-m", f"together_train_cookbook.recipes.{recipe}", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--out-dir" in proc.stdout


def test_busy_http_port_is_one_line_before_the_model_loads(tiny_model_dir):
    # serve binds --http-port before it loads anything (wire/http/starting.py): a port in use is refused
    # at once, naming the flag, with no replica started and no traceback.
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = _serve("serve", "--model", str(tiny_model_dir), "--port", "0", "--http-port", str(port),
                      "--generators", "1")
    assert proc.returncode != 0
    assert f"--http-port {port}: cannot bind 127.0.0.1:{port}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
