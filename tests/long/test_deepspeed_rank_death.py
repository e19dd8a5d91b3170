"""A rank of `serve --trainer deepspeed` dies (2 CPU ranks, gloo, ZeRO-2, tiny model), driven over gRPC.

- Rank 1 SIGKILLed under torchrun: the next operation fails within
  ``FAIL_BOUND_S`` with UNAVAILABLE naming rank 1 and saying to restart and
  resume from the last training checkpoint; later operations and
  create_session fail the same way, stop_session succeeds, capabilities and
  list_sessions answer, the gRPC health check answers NOT_SERVING, all
  within ``CALL_BOUND_S``. torchrun stops rank 0, which keeps answering so (drain
  window) until a second SIGTERM ends it at once; no process of the launch
  is left. A fresh 2-rank launch on the same --storage resumes the
  checkpoint with its optimizer, and its next step equals
  TorchTrainerEngine's uninterrupted run (loss 1e-4 absolute, grad norm 1e-5
  relative, as test_deepspeed_server).
- Rank 0 SIGKILLed, under torchrun and with ranks started by hand (no
  launcher to clean up): the follower exits within ``EXIT_BOUND_S``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
psutil = pytest.importorskip("psutil")
import grpc  # noqa: E402
import together_train as tt  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from _models import tiny_model  # noqa: E402
from together_train_server.engines.types import AdamParams, LoraConfig, Sample  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _deepspeed_helpers as H  # noqa: E402

FAIL_BOUND_S = 15.0   # same host: /proc sees the death at once; remote ranks: heartbeat 10 s + 1 s period
CALL_BOUND_S = 5.0
EXIT_BOUND_S = 30.0
ADAM = dict(learning_rate=1e-2, weight_decay=0.01, lora_plus_ratio=4.0)
SERVE = ["-m", "together_train_server.cli", "serve", "--trainer", "deepspeed", "--zero-stage", "2",
         "--generators", "0", "--port", "0", "--trainer-threads", "1"]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)


def _wait_port(port_file: Path, procs: list[subprocess.Popen], log: Path) -> str:
    deadline = time.time() + 240
    while not (port_file.exists() and port_file.read_text().strip()):
        for p in procs:
            assert p.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "server did not start: " + log.read_text()[-3000:]
        time.sleep(0.5)
    return f"127.0.0.1:{port_file.read_text().strip()}"


def _launch_torchrun(tmp: Path, model: Path, storage: Path, tag: str, *extra: str):
    """torchrun --nproc-per-node 2 serve ...; returns (torchrun Popen, address, {rank: psutil.Process})."""
    port_file, log = tmp / f"port-{tag}", tmp / f"log-{tag}.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(H.free_port()), *SERVE, "--model", str(model), "--port-file", str(port_file),
           "--storage", str(storage), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = _wait_port(port_file, [proc], log)
    ranks = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            env = child.environ()
        except psutil.Error:
            continue
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            ranks[int(env["RANK"])] = child
    assert sorted(ranks) == [0, 1], ranks
    return proc, address, ranks


def _gone(procs, timeout: float) -> bool:
    """True when every process exited (zombies count as gone) within ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _stop(proc: subprocess.Popen, ranks) -> list[int]:
    """SIGTERM torchrun (it stops its workers); returns the pids of ranks it left running (then killed)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    finally:
        left = [] if _gone(ranks.values(), 5) else [p.pid for p in ranks.values() if p.is_running()]
        for p in ranks.values():  # never leave one behind for the next test
            try:
                p.kill()
            except psutil.Error:
                pass
    return left


def _batch(step: int):
    return [tt.Sample(model_input=s.model_input, loss_fn_inputs=dict(s.inputs)) for s in H.batches(step)[0]]


def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_follower_death_fails_fast_then_resumes_from_checkpoint(tmp_path):
    model = tiny_model(tmp_path / "tiny")
    storage = tmp_path / "storage"
    proc, address, ranks = _launch_torchrun(tmp_path, model, storage, "a", "--failure-drain-s", "25")
    try:
        client = tt.ResourceClient(address)
        session = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=3))
        session.forward_backward(_batch(0), "cross_entropy").result(timeout=180)
        session.optim_step(tt.AdamParams(**ADAM)).result(timeout=180)
        ckpt = session.save_state("step1").result(timeout=180)

        ranks[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(tt.TogetherTrainError) as info:
            session.forward_backward(_batch(1), "cross_entropy").result(timeout=FAIL_BOUND_S)
        elapsed = time.monotonic() - t0
        err = info.value
        assert err.code == "UNAVAILABLE", err
        assert elapsed < FAIL_BOUND_S, elapsed
        msg = str(err)
        assert "rank 1" in msg and "restart" in msg and "checkpoint" in msg, msg
        assert not err.retryable, err  # retrying cannot help: the SDK must not spin on it

        # Later operations fail the same way at once; read-only calls still answer.
        (caps, dt) = _timed(lambda: client.get_capabilities(refresh=True))
        assert dt < CALL_BOUND_S and caps.model_id
        (_, dt) = _timed(client.list_sessions)
        assert dt < CALL_BOUND_S
        with grpc.insecure_channel(address) as ch:  # NOT_SERVING (restart it) within the watcher's 0.5 s period
            stub, deadline = health_pb2_grpc.HealthStub(ch), time.monotonic() + CALL_BOUND_S
            while True:
                h = stub.Check(health_pb2.HealthCheckRequest(), timeout=CALL_BOUND_S)
                if h.status == health_pb2.HealthCheckResponse.NOT_SERVING or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert h.status == health_pb2.HealthCheckResponse.NOT_SERVING
        t1 = time.monotonic()
        with pytest.raises(tt.TogetherTrainError) as info2:
            session.optim_step(tt.AdamParams(**ADAM)).result(timeout=FAIL_BOUND_S)
        assert info2.value.code == "UNAVAILABLE" and "rank 1" in str(info2.value)
        with pytest.raises(tt.TogetherTrainError) as info3:
            client.create_session(lora=tt.LoraConfig(rank=4))
        assert info3.value.code == "UNAVAILABLE" and "rank 1" in str(info3.value)
        session.stop()  # nothing to free on the dead rank: succeeds
        assert time.monotonic() - t1 < CALL_BOUND_S
        # torchrun saw rank 1 die and SIGTERMed rank 0, which keeps answering (drain window) ...
        log = tmp_path / "log-a.txt"
        deadline = time.time() + 10
        while "answering UNAVAILABLE" not in log.read_text() and time.time() < deadline:
            time.sleep(0.2)
        assert "answering UNAVAILABLE" in log.read_text(), log.read_text()[-3000:]
        assert proc.poll() is None
        # ... until a second signal ends it early: rank 0 exits well before the 25 s window would end
        # (the bound covers a 2 s gRPC grace and interpreter teardown on a busy machine).
        t2 = time.monotonic()
        ranks[0].send_signal(signal.SIGTERM)
        ranks[0].wait(timeout=EXIT_BOUND_S)
        assert time.monotonic() - t2 < 15.0
        proc.wait(timeout=EXIT_BOUND_S)
    finally:
        left = _stop(proc, ranks)
    assert proc.returncode != 0
    assert not left, f"ranks {left} outlived torchrun"

    # Fresh launch on the same storage: resume from the checkpoint with its optimizer.
    proc, address, ranks = _launch_torchrun(tmp_path, model, storage, "b")
    try:
        client = tt.ResourceClient(address)
        resumed = client.create_session(checkpoint_uri=ckpt.uri, with_optimizer=True)
        fb = resumed.forward_backward(_batch(1), "cross_entropy").result(timeout=180)
        opt = resumed.optim_step(tt.AdamParams(**ADAM)).result(timeout=180)
    finally:
        left = _stop(proc, ranks)
    assert "answering UNAVAILABLE" not in (tmp_path / "log-b.txt").read_text()  # a plain stop: no drain
    assert not left, f"ranks {left} outlived torchrun"

    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    ref = TorchTrainerEngine(model)
    ref.create_adapter("x", LoraConfig(rank=4, alpha=8.0, seed=3))
    for step in (0, 1):
        out = ref.forward("x", [Sample(s.model_input, s.inputs) for s in H.batches(step)[0]], "cross_entropy",
                          backward=True)
        ro = ref.optim_step("x", AdamParams(**ADAM))
    assert opt.step == ro.step == 2
    assert fb.loss == pytest.approx(out.loss, abs=1e-4)
    assert opt.grad_norm == pytest.approx(ro.grad_norm, rel=1e-5)


def test_rank0_death_followers_exit(tmp_path):
    model = tiny_model(tmp_path / "tiny")
    # Under torchrun: the agent stops the follower.
    proc, address, ranks = _launch_torchrun(tmp_path, model, tmp_path / "storage", "t")
    try:
        ranks[0].send_signal(signal.SIGKILL)
        assert _gone([ranks[1]], EXIT_BOUND_S), "follower outlived rank 0 under torchrun"
        proc.wait(timeout=EXIT_BOUND_S)
    finally:
        _stop(proc, ranks)

    # Ranks started by hand (e.g. a launcher that does not clean up): the follower sees rank 0 go.
    port, port_file, log = H.free_port(), tmp_path / "port-raw", tmp_path / "log-raw.txt"
    procs = []
    with open(log, "wb") as out:
        for rank in (0, 1):
            env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                       LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen([sys.executable, *SERVE, "--model", str(model), "--port-file",
                                           str(port_file), "--storage", str(tmp_path / "storage")],
                                          env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        _wait_port(port_file, procs, log)
        procs[0].kill()
        procs[1].wait(timeout=EXIT_BOUND_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
