#!/usr/bin/env python
"""A seeded soak of one real resource: 4 training sessions through 3 SDKs and OpenAI chat, under faults.

Not run in CI: tests/long/test_soak.py runs scripts/soak.py, which drives the same three SDKs (gRPC x2, tinker,
together) and OpenAI chat under the same faults, with the failing save from a fault hook. This one stays for
what soak.py does not do: a *real* full storage (a size-limited tmpfs filled during save_state, root only:
the ENOSPC path, refused RESOURCE_EXHAUSTED through each SDK), a dropped channel whose optim_step is resent
with the same seq_id / idempotency key (same operation, counter moved once), redone steps' losses checked
after a restart, and checkpoints pruned during the run. Passes --minutes 1 --seed 0; a 3-minute run was seen
hanging once after the full-storage fault followed by the server kill (the restarted server on a still-full
tmpfs: its registry fails on the full disk): run it by hand.

    python scripts/soak_sdks.py --minutes M --seed S [--keep] [--out report.json]

What runs (loopback only, everything under one temporary directory that is removed at exit):

- a tiny random Llama (``tests/_models.py`` ``build_tiny_model``) served by ``together-train serve``
  (`together_train.launch_local`: ``--generators 2 --http-port 0 --api-key-file``), its storage a
  size-limited tmpfs when this process may mount one (root), else a plain directory (then the
  full-storage fault is skipped and says so);
- 4 training sessions at once, each a thread doing ``forward_backward`` + ``optim_step`` on seeded
  batches (batch i of a session is a function of the seed, the session and i only), a ``save_state``
  every `SAVE_EVERY` steps: two through the gRPC SDK (``together_train``, one also ``weights_sync``
  every 4 steps), one through the Tinker SDK (``tinker``, key ``tml-<key>``), one through the
  Together SDK (``together.post_training``); plus a thread of OpenAI chat completions (``openai``
  on ``/v1``);
- faults on a seeded schedule (one every `fault_every_s`, kinds cycled in a seeded order so each
  kind happens once per cycle): replica ``kill -9``, replica ``SIGSTOP`` for `STOP_S` then
  ``SIGCONT``, server ``kill -9`` then a restart on the same storage with every session resumed
  from its last checkpoint (``load_state_with_optimizer`` or its SDK's equivalent), a dropped
  client channel (the optim_step request resent with the same idempotency key on a new channel),
  a full storage during ``save_state`` (the tmpfs filled with one file), and once an oversized
  ``forward_backward`` (more tokens than ``max_tokens_per_batch``).

Definitions (the printed figures):

- an op is a ``forward_backward``, ``optim_step`` or ``save_state`` the soak submitted; it is
  *acknowledged* when the resource returned its result; an acknowledged op is *durable* once an
  acknowledged ``save_state`` of its session covers it (checkpoint step >= its step). A server
  ``kill -9`` loses what is not durable by design: the session resumes at its last checkpoint and
  re-runs the same batches (``ops_redone_after_server_kill``).
- ``ops_lost``: acknowledged optim_steps missing from the session's step counter (read back with
  ``GetSession`` at every checkpoint and at the end, and from each optim_step's own step), durable
  ones missing after a resume, and acknowledged checkpoints missing or failing verification.
- ``ops_duplicated``: step counter increments beyond the optim_steps submitted (a resent request
  that ran twice), and a resent request answered with another operation id.
- ``checkpoints_verified``: acknowledged checkpoints listed, downloaded through the SDK (each file's
  size and sha256 checked against the server's manifest) and re-hashed here against the manifest.
- ``max_pause_s_<session>``: the longest time between two consecutive acknowledged optim_steps of
  the session, minus the server restart's own cost (kill until the session was resumed) where the
  gap spans one.
- ``replay_exact``: for every session, the stretch between two of its consecutive checkpoints (the
  one holding most faults) is re-run on a fresh server from the first checkpoint with the same
  batches; the saved adapter, AdamW moments and RNG tensors must equal the second checkpoint's bit
  for bit, and the losses the ones recorded during the soak. After each server restart the redone
  steps' losses must also equal the ones recorded before the kill (``redo_loss_mismatch``).

Exit status: 0 when nothing was lost, duplicated, partially listed or mismatched and no training op
failed unexpectedly; 1 otherwise; 2 when the run itself could not be set up.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "tests", ROOT / "cookbook", ROOT / "server", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "server"), str(ROOT / "cookbook")]
                                           + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

import together_train as tt  # noqa: E402
from together_train.retry import RetryPolicy  # noqa: E402

SAVE_EVERY = 3  # steps between save_state
SYNC_EVERY = 4  # steps between weights_sync (gRPC session "grpc_a")
STOP_S = 8.0  # how long a SIGSTOPped replica stays stopped
STORAGE_MB = 1024  # tmpfs size (only what is used takes memory)
KEEP_CKPTS = 6  # per session: older checkpoints are verified and deleted (those a fault touched are kept)
OP_TIMEOUT_S = 120.0
ADAM = dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
LORA = dict(rank=4, alpha=8.0)
SERVE_ARGS = ["--max-sessions", "32", "--trainer-threads", "1", "--generator-threads", "1"]
FAULT_KINDS = ["replica_kill", "replica_stop", "channel_drop", "storage_full", "server_kill", "oversized"]
SESSIONS = [("grpc_a", "grpc"), ("grpc_b", "grpc"), ("tinker", "tinker"), ("together", "together")]


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_batch(seed: int, session_index: int, step: int, vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batch `step` of a session: 2 (full token sequence int64, weights float32 of len-1) pairs, 12..27 tokens.

    A function of (seed, session, step) only, so a resumed or replayed step trains on the same data.
    """
    rng = np.random.default_rng([seed, session_index, step])
    out = []
    for _ in range(2):
        n = int(rng.integers(12, 28))
        full = rng.integers(1, min(vocab, 2000), size=n).astype(np.int64)
        w = np.ones(n - 1, np.float32)
        w[:2] = 0.0
        out.append((full, w))
    return out


def grpc_samples(batch) -> list[tt.Sample]:
    return [tt.Sample(model_input=f[:-1], loss_fn_inputs={"target_tokens": f[1:], "weights": w}) for f, w in batch]


class Abandoned(Exception):
    """An operation given up because the server was killed under it (its effect is lost unless durable)."""


@dataclass
class Ckpt:
    """An acknowledged training checkpoint of one session's lineage."""

    uri: str
    step: int
    session: str  # the soak's session name
    parent: "Ckpt | None"  # the previous checkpoint of the lineage (None: the fresh adapter)
    events: list[str] = field(default_factory=list)  # faults that hit the stretch parent -> this
    deleted: bool = False  # verified and deleted during the run (storage bound)


@dataclass
class Endpoint:
    address: str
    http_url: str
    key: str


# ----------------------------------------------------------------------------------------------- drivers
class GrpcDriver:
    """A session through the gRPC SDK (together_train)."""

    def __init__(self, ep: Endpoint, seed: int, resume: Ckpt | None, via_create: bool, wait) -> None:
        self.ep, self.wait = ep, wait
        self.client = new_client(ep)
        if resume is None:
            self.s = self.client.create_session(lora=tt.LoraConfig(**LORA, seed=seed))
        elif via_create:
            self.s = self.client.create_session(checkpoint_uri=resume.uri, with_optimizer=True)
        else:
            self.s = self.client.create_session(lora=tt.LoraConfig(**LORA, seed=seed))
            self.wait(self.s.load_state_with_optimizer(resume.uri))
        self.session_id = self.s.session_id

    def train_step(self, batch) -> tuple[float, int | None]:
        fb = self.s.forward_backward(grpc_samples(batch), "cross_entropy")
        opt = self.s.optim_step(tt.AdamParams(**ADAM))
        return float(self.wait(fb).loss), int(self.wait(opt).step)

    def save(self, name: str) -> tuple[str, int]:
        info = self.wait(self.s.save_state(name))
        return info.uri, int(info.step)

    def sync(self) -> None:
        self.wait(self.s.weights_sync())

    def oversized(self, n_tokens: int, vocab: int) -> str:
        """A forward_backward over more tokens than the resource takes in one batch; returns the refusal."""
        full = (np.arange(250) % (vocab - 1) + 1).astype(np.int64)
        batch = [(full, np.ones(249, np.float32))] * (n_tokens // 249 + 1)
        try:
            self.wait(self.s.forward_backward(grpc_samples(batch), "cross_entropy", validate=False))
        except tt.errors.TogetherTrainError as e:
            return f"{e.code}: {e}"
        raise AssertionError("the oversized forward_backward was accepted")

    def dropped_channel_step(self, batch) -> tuple[float, int, str]:
        """forward_backward, then optim_step sent; the channel is closed before its result, and the same
        request (same seq_id and idempotency key) is resent on a new channel. Returns (loss, step, note)."""
        from together_train._proto import session_pb2

        loss = float(self.wait(self.s.forward_backward(grpc_samples(batch), "cross_entropy")).loss)
        req = session_pb2.OptimStepRequest(adam_params=tt.AdamParams(**ADAM).to_proto())
        s, c = self.s, self.client
        with s._lock:  # as Session._submit sends it (seq order, one header)
            seq = s._next_seq
            req.header.CopyFrom(s._header(seq))
            first = c._call(c._sessions.OptimStep, req, what="optim_step")
            s._next_seq = seq + 1
        c.close()  # dropped: the result of `first` never reaches this client
        self.client = new_client(self.ep)
        again = self.client._call(self.client._sessions.OptimStep, req, what="optim_step")
        note = "same operation" if again.operation_id == first.operation_id else (
            f"DUPLICATE: resend got operation {again.operation_id}, first {first.operation_id}")
        self.s = self.client.session(self.session_id)
        step = int(self.wait(self.s.operation(first.operation_id)).step)
        return loss, step, note

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


class TinkerDriver:
    """A session through the official tinker SDK on the HTTP port (key ``tml-<key>``)."""

    def __init__(self, ep: Endpoint, seed: int, resume: Ckpt | None, base_model: str, wait) -> None:
        import tinker

        self.T, self.wait = tinker.types, wait
        self.sc = tinker.ServiceClient(base_url=ep.http_url, api_key="tml-" + ep.key)
        if resume is None:
            self.tc = self.wait(self.sc.create_lora_training_client(
                base_model=base_model, rank=LORA["rank"], seed=seed, train_unembed=False))  # 50 MB checkpoints otherwise
        else:
            path = "tinker://" + resume.uri.split("://", 1)[1].replace("/state/", "/weights/", 1)
            self.tc = self.wait(self.sc.create_training_client_from_state_with_optimizer(path))
        # a training run id is our session id
        rest = tinker.RestClient(base_url=ep.http_url, api_key="tml-" + ep.key)
        run = rest.get_training_run(self.tc.get_info().model_id)
        self.session_id = (self.wait(run) if hasattr(run, "result") else run).training_run_id

    def train_step(self, batch) -> tuple[float, int | None]:
        T = self.T
        data = [T.Datum(model_input=T.ModelInput.from_ints(f[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": f[1:], "weights": w}) for f, w in batch]
        fb = self.tc.forward_backward(data, "cross_entropy")
        opt = self.tc.optim_step(T.AdamParams(**ADAM))
        loss = float(self.wait(fb).metrics["loss:sum"])
        self.wait(opt)
        return loss, None

    def save(self, name: str) -> tuple[str, int]:
        path = self.wait(self.tc.save_state(name)).path  # tinker://<session>/weights/<name>
        run, _, ckpt_name = path[len("tinker://"):].split("/", 2)
        return f"together-train://{run}/state/{ckpt_name}", -1

    def close(self) -> None:
        def close():
            with contextlib.suppress(Exception):
                self.sc.close("success").result(timeout=10)

        threading.Thread(target=close, daemon=True).start()


class TogetherDriver:
    """A session through the official together SDK (``together.post_training``) on the HTTP port."""

    def __init__(self, ep: Endpoint, seed: int, resume: Ckpt | None, base_model: str) -> None:
        from together import post_training as pt

        self.ep = ep
        self.mr = pt.ModelResourcesClient.create(api_key=ep.key, base_url=ep.http_url, base_model=base_model,
                                                 interval=0.1)
        if resume is None:
            self.sess = self.mr.create_session(lora_config={"rank": LORA["rank"], "alpha": LORA["alpha"], "seed": seed},
                                               interval=0.1)
        else:
            cid = resume.uri.split("://", 1)[1].replace("/", ".")  # <session>.<kind>.<name>
            self.sess = self.mr.create_session(resume_from_checkpoint_id=cid, load_optimizer=True, interval=0.1)
        self.session_id = self.sess.session_id

    @staticmethod
    def samples(batch) -> list[dict]:
        return [{"model_input": {"chunks": [{"encoded_text": {"tokens": f[:-1].tolist()}}]},
                 "loss_fn_inputs": {"target_tokens": {"data": f[1:].tolist(), "dtype": "int64"},
                                    "weights": {"data": w.tolist(), "dtype": "float32"}}} for f, w in batch]

    def train_step(self, batch) -> tuple[float, int | None]:
        out = self.sess.trainer.forward_backward(samples=self.samples(batch), loss={"type": "LOSS_TYPE_CROSS_ENTROPY"})
        step = self.sess.trainer.optim_step(adam_params=ADAM)
        return float(out.loss), int(step.step)

    def save(self, name: str) -> tuple[str, int]:
        ck = self.sess.create_training_checkpoint()
        sid, kind, cname = ck.id.split(".", 2)
        return f"together-train://{sid}/{kind}/{cname}", int(ck.step)

    def dropped_channel_step(self, batch) -> tuple[float, int, str]:
        """forward_backward, then an optim_step POSTed with an idempotency key on a client that is closed at
        once; the same POST (same key) again on a new client; its operation polled there."""
        from together import Together

        out = self.sess.trainer.forward_backward(samples=self.samples(batch), loss={"type": "LOSS_TYPE_CROSS_ENTROPY"})
        key = f"soak-drop-{time.monotonic_ns()}"
        c1 = Together(api_key=self.ep.key, base_url=self.ep.http_url, max_retries=0)
        first = c1.post_training.operations.optim_step(self.session_id, idempotency_key=key, adam_params=ADAM)
        c1.close()
        c2 = Together(api_key=self.ep.key, base_url=self.ep.http_url, max_retries=0)
        again = c2.post_training.operations.optim_step(self.session_id, idempotency_key=key, adam_params=ADAM)
        note = "same operation" if again.id == first.id else f"DUPLICATE: resend got {again.id}, first {first.id}"
        deadline = time.monotonic() + OP_TIMEOUT_S
        op = again
        while op.status != "TRAINING_OPERATION_STATUS_COMPLETED":
            if op.status == "TRAINING_OPERATION_STATUS_FAILED" or time.monotonic() > deadline:
                raise RuntimeError(f"optim_step {first.id}: {op.status} {getattr(op, 'error', '')}")
            time.sleep(0.05)
            op = c2.post_training.operations.retrieve_optim_step(first.id, session_id=self.session_id)
        c2.close()
        return float(out.loss), int(op.output.step), note

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.mr.detach()


def new_client(ep: Endpoint) -> tt.ResourceClient:
    # Short retries: a killed server must surface within seconds, not after the default 120 s.
    return tt.ResourceClient(ep.address, api_key=ep.key, retry=RetryPolicy(max_attempts=4, max_elapsed_s=10.0))


# ----------------------------------------------------------------------------------------------- harness
class Harness:
    """The resource process, its storage, the fault schedule, and every figure the soak prints."""

    def __init__(self, args) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = Path(tempfile.mkdtemp(prefix=f"soak-{args.seed}-"))
        self.storage = self.root / "storage"
        self.storage.mkdir()
        self.mounted = False
        self.key = f"soak-key-{args.seed}-{random.Random(args.seed).getrandbits(64):016x}"
        self.local: Any = None  # the current tt.LocalResource
        self.all_resources: list[Any] = []
        self.ep: Endpoint | None = None
        self.admin: tt.ResourceClient | None = None
        self.generation = 0
        self.kills = 0  # server kill -9 so far (incremented before the kill)
        self.server_up = threading.Event()
        self.stop_training = threading.Event()
        self.storage_full = threading.Event()
        self.full_ended = -1e9  # monotonic time the storage stopped being full
        self.create_lock = threading.Lock()
        self.restarts: list[tuple[float, float]] = []  # (kill time, restarted time), monotonic
        self.faults: dict[str, int] = {k: 0 for k in FAULT_KINDS}
        self.fault_log: list[str] = []
        self.stopped_pids: set[int] = set()
        self.figures: dict[str, Any] = {}
        self.chat_ok = self.chat_failed = 0
        self.partial_listed = 0
        self.verified = self.verify_failed = 0

    # -- storage
    def mount_storage(self) -> None:
        if os.geteuid() != 0 or not shutil.which("mount"):
            log("not root: plain storage directory, the full-storage fault is skipped")
            return
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STORAGE_MB}m", "tmpfs", str(self.storage)],
                           capture_output=True, text=True)
        self.mounted = r.returncode == 0
        if not self.mounted:
            log(f"tmpfs mount refused ({r.stderr.strip()}): the full-storage fault is skipped")

    def fill_storage(self) -> Path:
        """One file taking every free byte of the tmpfs."""
        filler = self.storage / "soak-filler"
        st = os.statvfs(self.storage)
        with open(filler, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
            except OSError:
                pass
            chunk = b"\0" * (1 << 16)
            with contextlib.suppress(OSError):
                while True:
                    f.write(chunk)
                    f.flush()
        return filler

    # -- the server
    def start_server(self, model_dir: Path, generators: int = 2) -> None:
        local = tt.launch_local(model=str(model_dir), generators=generators, storage_dir=self.storage, api_key=self.key,
                                http_port=0, extra_args=SERVE_ARGS, log_file=self.root / "server.log",
                                startup_timeout=300, shutdown_timeout=15,
                                client_kwargs={"retry": RetryPolicy(max_attempts=4, max_elapsed_s=10.0)})
        self.all_resources.append(local)
        client = local.__enter__()
        self.local, self.admin = local, client
        self.ep = Endpoint(client.address, client.http_url, self.key)

    def server_pid(self) -> int:
        return self.local.process.pid

    def replica_pids(self) -> list[int]:
        """The resource's spawned generator replicas (its children with --replica-id on their command line)."""
        out = subprocess.run(["pgrep", "-P", str(self.server_pid())], capture_output=True, text=True).stdout.split()
        pids = []
        for p in map(int, out):
            with contextlib.suppress(OSError):
                if b"--replica-id" in Path(f"/proc/{p}/cmdline").read_bytes():
                    pids.append(p)
        return sorted(pids)

    def stop_server(self) -> float:
        """SIGTERM the resource (SIGKILL after the launcher's timeout); returns the seconds it took."""
        t0 = time.monotonic()
        with contextlib.suppress(Exception):
            self.local.stop()
        return time.monotonic() - t0

    def kill_server(self, model_dir: Path) -> None:
        self.server_up.clear()
        self.kills += 1
        t_kill = time.monotonic()
        os.kill(self.server_pid(), signal.SIGKILL)
        self.local.process.wait(timeout=30)
        self.local.stop()  # the launcher kills what is left of the process group (replicas) and cleans up
        self.start_server(model_dir)
        self.generation += 1
        self.restarts.append((t_kill, time.monotonic()))
        self.server_up.set()

    def cleanup(self) -> None:
        self.stop_training.set()
        for p in self.stopped_pids:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGCONT)
        for local in self.all_resources:
            with contextlib.suppress(Exception):
                local.stop()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.storage)], capture_output=True)
        if not self.args.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            log(f"kept {self.root}")


# ----------------------------------------------------------------------------------------------- sessions
class Worker(threading.Thread):
    """One training session's loop; survives server restarts by resuming from its last checkpoint."""

    def __init__(self, h: Harness, index: int, name: str, kind: str, model_dir: Path, vocab: int) -> None:
        super().__init__(daemon=True, name=name)
        self.h, self.index, self.sname, self.kind = h, index, name, kind
        self.model_dir, self.vocab = model_dir, vocab
        self.driver: Any = None
        self.gen = -1
        self.step = 0  # optim_steps acknowledged in the current lineage (= the server's step counter)
        self.durable: Ckpt | None = None
        self.ckpts: list[Ckpt] = []
        self.events: list[str] = []  # faults since the last checkpoint
        self.losses: dict[int, float] = {}  # step index -> loss of its forward_backward (current lineage)
        self.acked = self.lost = self.dup = self.redone = self.redo_mismatch = 0
        self.saves_refused_full = self.save_failed = 0
        self.errors: list[str] = []
        self.ok_times: list[float] = []
        self.pending: str | None = None  # a fault the scheduler asked this session to run itself
        self.op_kills = 0  # Harness.kills when the current op started
        self.done = threading.Event()

    # -- helpers
    def wait(self, fut) -> Any:
        """``fut.result()``, given up (`Abandoned`) as soon as the server is killed under it."""
        deadline = time.monotonic() + OP_TIMEOUT_S
        while True:
            try:
                return fut.result(timeout=0.5)
            except TimeoutError:
                if self.h.kills != self.op_kills:
                    raise Abandoned("the server was killed under this operation") from None
                if time.monotonic() > deadline:
                    raise

    def server_step(self) -> int:
        return int(self.h.admin.get_session(self.driver.session_id).step)

    def check_counter(self, where: str) -> None:
        got = self.server_step()
        if got < self.step:
            self.lost += self.step - got
            self.errors.append(f"{where}: server step {got} < acknowledged {self.step}")
        elif got > self.step:
            self.dup += got - self.step
            self.errors.append(f"{where}: server step {got} > submitted {self.step}")

    def open(self) -> None:
        h = self.h
        if self.driver is not None:
            self.driver.close()
        resume = self.durable
        base = resume.step if resume else 0
        self.redone += self.step - base
        seed = 1000 + self.index
        with h.create_lock:
            if self.kind == "grpc":
                self.driver = GrpcDriver(h.ep, seed, resume, self.sname == "grpc_b", self.wait)
            elif self.kind == "tinker":
                self.driver = TinkerDriver(h.ep, seed, resume, str(self.model_dir), self.wait)
            else:
                self.driver = TogetherDriver(h.ep, seed, resume, str(self.model_dir))
        self.step = base
        got = self.server_step()
        if got != base:
            (self.errors.append(f"resume from {resume and resume.uri}: step {got}, checkpoint {base}"))
            if got < base:
                self.lost += base - got
            else:
                self.dup += got - base
        if resume is not None:
            self.events.append("resumed")
        self.gen = h.generation

    def record_step(self, loss: float, step: int | None, t: float) -> None:
        i = self.step  # the batch index just trained
        if i in self.losses and self.losses[i] != loss:
            self.redo_mismatch += 1
            self.errors.append(f"step {i} redone after a restart: loss {loss!r}, before {self.losses[i]!r}")
        self.losses[i] = loss
        self.step += 1
        self.acked += 2
        if step is not None and step != self.step:
            if step > self.step:
                self.dup += step - self.step
            else:
                self.lost += self.step - step
            self.errors.append(f"optim_step answered step {step}, expected {self.step}")
        self.ok_times.append(t)

    def save(self, tag: str) -> None:
        name = f"{self.sname}-{self.step}-{tag}-{len(self.ckpts)}"
        full, t0 = self.h.storage_full.is_set(), time.monotonic()
        try:
            uri, step = self.driver.save(name)
        except Exception as e:
            # refused for the full storage: the storage was full at some time while this save was in flight
            recent = full or self.h.storage_full.is_set() or self.h.full_ended >= t0
            if recent and any(m in str(e) for m in ("storage is full", "No space left", "RESOURCE_EXHAUSTED")):
                self.h.figures["storage_full_refusal"] = "RESOURCE_EXHAUSTED" if "RESOURCE_EXHAUSTED" in str(e) else (
                    type(e).__name__)
                self.saves_refused_full += 1
                self.h.fault_log.append(f"{self.sname}: save_state on a full storage refused: {str(e)[:300]}")
                listed = [c.name for c in self.h.admin.list_checkpoints(session_id=self.driver.session_id)]
                if name in listed:
                    self.h.partial_listed += 1
                    self.errors.append(f"failed save {name} is listed")
                self.events.append("storage_full")
                return
            raise
        if step < 0:  # tinker: read the step from the registry
            step = next(c.step for c in self.h.admin.list_checkpoints(session_id=self.driver.session_id) if c.uri == uri)
        if full:
            self.errors.append(f"save {name} succeeded on a full storage")
        self.acked += 1
        if step != self.step:
            self.errors.append(f"checkpoint {uri} at step {step}, acknowledged {self.step}")
            self.lost += max(0, self.step - step)
            self.dup += max(0, step - self.step)
        ck = Ckpt(uri, step, self.sname, self.durable, self.events)
        self.events = []
        self.ckpts.append(ck)
        self.durable = ck
        self.check_counter(f"after save {name}")
        self.prune()

    def prune(self) -> None:
        """Bound the storage on long runs: verify, then delete, checkpoints older than the last KEEP_CKPTS that no
        fault touched and that start no stretch a fault touched (the replay's candidates stay)."""
        live = [c for c in self.ckpts if not c.deleted]
        keep = {id(c) for c in live[-KEEP_CKPTS:]}
        for c in live:
            if [e for e in c.events if e != "resumed"] and c.parent is not None:
                keep |= {id(c), id(c.parent)}
        for c in live:
            if id(c) not in keep:
                if self.h.kills != self.op_kills or not self.h.server_up.is_set():
                    return  # the server is being replaced: prune next time
                if verify_checkpoint(self.h, c, self, self.op_kills):
                    self.h.admin.delete_checkpoint(c.uri)
                    c.deleted = True

    def run_pending(self) -> None:
        what, self.pending = self.pending, None
        if what == "channel_drop":
            batch = make_batch(self.h.args.seed, self.index, self.step, self.vocab)
            loss, step, note = self.driver.dropped_channel_step(batch)
            self.h.fault_log.append(f"{self.sname}: channel dropped mid optim_step, resent: {note}")
            if note != "same operation":
                self.dup += 1
                self.errors.append(note)
            self.record_step(loss, step, time.monotonic())
            self.check_counter("after the dropped channel")
            self.events.append("channel_drop")
        elif what == "oversized":
            before = self.server_step()
            msg = self.driver.oversized(self.h.caps.max_tokens_per_batch + 1, self.vocab)
            self.h.fault_log.append(f"{self.sname}: oversized forward_backward refused: {msg[:300]}")
            self.h.figures["oversized_refusal"] = msg.split(":", 1)[0]
            if self.server_step() != before:
                self.errors.append("the oversized request changed the step counter")
            self.events.append("oversized")

    def run(self) -> None:
        h = self.h
        while not h.stop_training.is_set():
            h.server_up.wait()
            gen, self.op_kills = h.generation, h.kills
            try:
                if self.gen != gen:
                    self.open()
                    if self.durable is None or self.durable.step != self.step or not self.ckpts:
                        self.save("start")
                if self.pending:
                    self.run_pending()
                    continue
                batch = make_batch(h.args.seed, self.index, self.step, self.vocab)
                loss, step = self.driver.train_step(batch)
                self.record_step(loss, step, time.monotonic())
                if self.step % SAVE_EVERY == 0:
                    self.save("periodic")
                if self.sname == "grpc_a" and self.step % SYNC_EVERY == 0:
                    self.driver.sync()
            except Exception as e:
                if isinstance(e, Abandoned) or self.op_kills != h.kills:
                    continue  # the server was killed under this op: resume on the new one
                self.errors.append(f"unexpected {type(e).__name__}: {str(e)[:400]}")
                log(f"{self.sname}: unexpected error: {traceback.format_exc()[-1500:]}")
                time.sleep(1.0)
                with contextlib.suppress(Exception):
                    self.gen = -1  # resume from the last checkpoint: the failed op's effect is unknown
        # final: resumed on the last server if it was killed under the last op, a checkpoint of everything
        # acknowledged, and the counter
        try:
            h.server_up.wait(timeout=600)
            self.op_kills = h.kills
            if self.gen != h.generation:
                self.open()
            if self.durable and self.durable.step != self.step:
                self.save("final")
            self.check_counter("at the end")
        except Exception as e:
            self.errors.append(f"final save: {type(e).__name__}: {str(e)[:300]}")
        self.done.set()


def chat_loop(h: Harness, model_name: str, seed: int) -> None:
    """OpenAI chat completions on /v1 until the soak ends; counts answers and failures."""
    import openai

    rng = random.Random(seed)
    while not h.stop_training.is_set():
        h.server_up.wait()
        try:
            c = openai.OpenAI(base_url=h.ep.http_url + "/v1", api_key=h.key, max_retries=0, timeout=60)
            r = c.chat.completions.create(model=model_name, max_tokens=rng.randint(4, 16), seed=rng.randint(0, 99),
                                          messages=[{"role": "user", "content": f"count to {rng.randint(2, 9)}"}])
            assert r.choices and r.choices[0].message is not None
            h.chat_ok += 1
        except Exception:
            h.chat_failed += 1
            time.sleep(0.5)
        time.sleep(0.2)


# ----------------------------------------------------------------------------------------------- faults
def run_fault(h: Harness, kind: str, workers: list[Worker], model_dir: Path) -> None:
    rng = h.rng
    if kind in ("replica_kill", "replica_stop"):
        pids = h.replica_pids()
        if not pids:
            h.fault_log.append(f"{kind}: no replica running, skipped")
            return
        pid = rng.choice(pids)
        if kind == "replica_kill":
            os.kill(pid, signal.SIGKILL)
            h.fault_log.append(f"replica {pid} killed")
        else:
            os.kill(pid, signal.SIGSTOP)
            h.stopped_pids.add(pid)
            time.sleep(STOP_S)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
            h.stopped_pids.discard(pid)
            h.fault_log.append(f"replica {pid} stopped for {STOP_S} s")
    elif kind == "server_kill":
        h.fault_log.append(f"server {h.server_pid()} killed")
        h.kill_server(model_dir)
        h.fault_log.append(f"server restarted in {h.restarts[-1][1] - h.restarts[-1][0]:.1f} s")
    elif kind == "channel_drop":
        w = next(w for w in workers if w.sname == rng.choice(["grpc_b", "together"]))
        w.pending = "channel_drop"
        _wait_taken(w)
    elif kind == "oversized":
        w = next(w for w in workers if w.sname == "grpc_a")
        w.pending = "oversized"
        _wait_taken(w)
    elif kind == "storage_full":
        if not h.mounted:
            h.fault_log.append("storage_full: no tmpfs, skipped")
            return
        before = sum(w.saves_refused_full for w in workers)
        filler = h.fill_storage()
        h.storage_full.set()
        deadline = time.monotonic() + 60
        while sum(w.saves_refused_full for w in workers) == before and time.monotonic() < deadline:
            time.sleep(0.1)
        filler.unlink()
        h.full_ended = time.monotonic()
        h.storage_full.clear()
        if sum(w.saves_refused_full for w in workers) == before:
            h.fault_log.append("storage_full: no save_state happened while full")
            return
    h.faults[kind] += 1


def _wait_taken(w: Worker, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while w.pending and time.monotonic() < deadline:
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------- checks
def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_checkpoint(h: Harness, ck: Ckpt, w: "Worker", kills: int | None = None) -> bool:
    """Downloaded through the SDK (which checks each file's size and sha256 as sent) and re-hashed here
    against the manifest; counted in ``checkpoints_verified`` / ``checkpoints_failed``."""
    dest = h.root / "verify" / ck.uri.split("://", 1)[1].replace("/", "_")
    try:
        h.admin.download_checkpoint(ck.uri, dest)
        manifest = json.loads((dest / "manifest.json").read_text())
        for name, entry in manifest["files"].items():
            if sha256_of(dest / name) != entry["sha256"]:
                raise AssertionError(f"{name}: sha256 differs from the manifest")
        h.verified += 1
        return True
    except Exception as e:
        if kills is not None and h.kills != kills:
            return False  # the server was killed under the download: verified later
        h.verify_failed += 1
        w.errors.append(f"checkpoint {ck.uri}: {type(e).__name__}: {e}")
        return False
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def verify_checkpoints(h: Harness, workers: list[Worker]) -> tuple[int, int]:
    """(verified, failed) over the run: every acknowledged checkpoint not deleted yet is listed and verified."""
    listed = {c.uri for c in h.admin.list_checkpoints()}
    for w in workers:
        for ck in w.ckpts:
            if ck.deleted:
                continue
            if ck.uri not in listed:
                h.verify_failed += 1
                w.errors.append(f"checkpoint {ck.uri}: acknowledged but not listed")
                continue
            verify_checkpoint(h, ck, w)
    return h.verified, h.verify_failed


def state_tensors(h: Harness, uri: str, dest: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    h.admin.download_checkpoint(uri, dest)
    out = {}
    for f in sorted(dest.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return out


def replay(h: Harness, workers: list[Worker]) -> tuple[bool, list[str]]:
    """Each session's richest stretch (most faults; latest on a tie) re-run from its first checkpoint on this
    (fresh) server with the same batches; tensors and losses compared bit for bit."""
    notes, exact = [], True
    for w in workers:
        stretches = [c for c in w.ckpts if c.parent is not None and c.step > c.parent.step
                     and not c.deleted and not c.parent.deleted]
        if not stretches:
            notes.append(f"{w.sname}: no stretch between two checkpoints")
            exact = False
            continue
        ck = max(stretches, key=lambda c: (len([e for e in c.events if e != "resumed"]), c.step, w.ckpts.index(c)))
        s = h.admin.create_session(checkpoint_uri=ck.parent.uri, with_optimizer=True)
        losses = []
        for i in range(ck.parent.step, ck.step):
            batch = make_batch(h.args.seed, w.index, i, w.vocab)
            fb = s.forward_backward(grpc_samples(batch), "cross_entropy")
            s.optim_step(tt.AdamParams(**ADAM)).result(timeout=OP_TIMEOUT_S)
            losses.append(float(fb.result(timeout=OP_TIMEOUT_S).loss))
        again = s.save_state(f"replay-{w.sname}").result(timeout=OP_TIMEOUT_S)
        s.stop()
        a = state_tensors(h, ck.uri, h.root / "replay" / "orig")
        b = state_tensors(h, again.uri, h.root / "replay" / "again")
        shutil.rmtree(h.root / "replay", ignore_errors=True)
        keys_ok = set(a) == set(b)
        diff = [k for k in a if k in b and not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                               and a[k].tobytes() == b[k].tobytes())]
        recorded = [w.losses.get(i) for i in range(ck.parent.step, ck.step)]
        loss_ok = recorded == losses
        same = keys_ok and not diff and loss_ok
        exact &= same
        notes.append(f"{w.sname}: steps {ck.parent.step}..{ck.step} ({','.join(ck.events) or 'no faults'}) "
                     f"{len(a)} tensors {'bit-exact' if keys_ok and not diff else f'DIFFER {diff[:3]} keys_ok={keys_ok}'}, "
                     f"losses {'exact' if loss_ok else f'DIFFER {recorded} vs {losses}'}")
    return exact, notes


def max_pause(w: Worker, restarts: list[tuple[float, float]], t_start: float) -> float:
    """Longest gap between consecutive acknowledged optim_steps, minus the restart cost inside it."""
    times = [t_start] + w.ok_times
    best = 0.0
    for a, b in zip(times, times[1:]):
        gap = b - a
        for k, up in restarts:
            if a <= k < b:
                gap -= min(up, b) - k
        best = max(best, gap)
    return best


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="how long the sessions train under faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-every-s", type=float, default=None,
                    help="seconds between faults (default: every kind about twice in 3 minutes, at most 30)")
    ap.add_argument("--out", type=Path, default=None, help="also write the figures here as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (server log, storage)")
    args = ap.parse_args(argv)
    duration = args.minutes * 60.0
    fault_every = args.fault_every_s or min(30.0, max(5.0, duration / (2 * len(FAULT_KINDS) + 1)))

    h = Harness(args)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: every thread's stack
    t_wall = time.monotonic()
    try:
        from _models import build_tiny_model

        model_dir = build_tiny_model(h.root / "model", arch="llama", seed=args.seed)
        h.mount_storage()
        h.start_server(model_dir)
        h.generation = 1
        h.server_up.set()
        h.caps = h.admin.get_capabilities()
        vocab = h.caps.vocab_size
        workers = [Worker(h, i, name, kind, model_dir, vocab) for i, (name, kind) in enumerate(SESSIONS)]
        t_start = time.monotonic()
        for w in workers:
            w.start()
        import openai  # noqa: F401  (fail early when missing)

        model_name = [m.id for m in __import__("openai").OpenAI(base_url=h.ep.http_url + "/v1", api_key=h.key)
                      .models.list().data][0]
        threading.Thread(target=chat_loop, args=(h, model_name, args.seed), daemon=True).start()

        # The schedule: kinds in a seeded order per cycle ("oversized" only in the first cycle, whose last
        # fault is the server kill, the slow one); the run lasts at least until that cycle is through.
        kinds_left: list[str] = []
        cycles = 0
        next_fault = t_start + fault_every
        end = t_start + duration
        while time.monotonic() < end or cycles == 0 or (cycles == 1 and kinds_left):
            if time.monotonic() >= next_fault:
                if not kinds_left:
                    kinds_left = [k for k in FAULT_KINDS if (k != "oversized" or cycles == 0) and k != "server_kill"]
                    h.rng.shuffle(kinds_left)
                    kinds_left.insert(len(kinds_left) if cycles == 0 else h.rng.randrange(len(kinds_left) + 1),
                                      "server_kill")
                    cycles += 1
                kind = kinds_left.pop(0)
                log(f"fault: {kind}")
                try:
                    run_fault(h, kind, workers, model_dir)
                except Exception:
                    h.fault_log.append(f"{kind} failed: {traceback.format_exc()[-800:]}")
                    log(h.fault_log[-1])
                next_fault = time.monotonic() + fault_every
                if cycles == 1 and not kinds_left and time.monotonic() >= end:
                    break
            time.sleep(0.1)
            if any(not w.is_alive() for w in workers):
                raise RuntimeError("a session thread died")

        h.stop_training.set()
        for w in workers:
            w.done.wait(timeout=300)
        train_s = time.monotonic() - t_start

        verified, bad = verify_checkpoints(h, workers)
        shutdown_s = h.stop_server()
        h.server_up.clear()
        h.start_server(model_dir, generators=0)  # fresh server on the same storage for the replay (trains only)
        exact, notes = replay(h, workers)

        lost = sum(w.lost for w in workers) + bad
        dup = sum(w.dup for w in workers)
        errors = [f"{w.sname}: {e}" for w in workers for e in w.errors]
        unexpected = sum(1 for w in workers for e in w.errors if e.startswith("unexpected"))
        for line in h.fault_log:
            log(line)
        for line in notes:
            log(f"replay {line}")
        for e in errors:
            log(f"ERROR {e}")
        fig = {
            "minutes": args.minutes, "seed": args.seed, "train_s": f"{train_s:.1f}",
            "sessions": len(workers),
            "ops_acknowledged": sum(w.acked for w in workers),
            "ops_lost": lost,
            "ops_duplicated": dup,
            "ops_redone_after_server_kill": sum(w.redone for w in workers),
            "optim_steps": sum(len(w.ok_times) for w in workers),
            "checkpoints_verified": verified,
            "checkpoints_failed": bad,
            "saves_refused_full_storage": sum(w.saves_refused_full for w in workers),
            "partial_checkpoints_listed": h.partial_listed,
            "redo_loss_mismatch": sum(w.redo_mismatch for w in workers),
            "replay_exact": exact,
            "errors_unexpected": unexpected,
            "errors_total": len(errors),
            "chat_ok": h.chat_ok, "chat_failed": h.chat_failed,
            **{f"faults_{k}": v for k, v in h.faults.items()},
            "restart_cost_s_max": f"{max((b - a for a, b in h.restarts), default=0.0):.1f}",
            "shutdown_s": f"{shutdown_s:.1f}",
            **{f"max_pause_s_{w.sname}": f"{max_pause(w, h.restarts, t_start):.2f}" for w in workers},
            "wall_s": f"{time.monotonic() - t_wall:.0f}",
            **h.figures,
        }
        for k, v in fig.items():
            print(f"{k}={v}", flush=True)
        if args.out:
            args.out.write_text(json.dumps({**fig, "faults": h.fault_log, "replay": notes, "errors": errors}, indent=1))
        failed = lost or dup or not exact or h.partial_listed or unexpected or fig["redo_loss_mismatch"] or errors
        return 1 if failed else 0
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}): cleaning up")
        return 130
    finally:
        h.cleanup()


if __name__ == "__main__":
    sys.exit(main())
