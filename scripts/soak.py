#!/usr/bin/env python
"""Soak: several clients train on one resource for M minutes while faults are injected; nothing is lost.

``python scripts/soak.py --minutes M --seed S [--out report.json]``: seeded, bounded, loopback only;
everything (a tiny random model, the storage, the server processes) lives in a temporary
directory removed at the end. What runs at once:

- 3 training sessions through the gRPC SDK (`together_train`) and 1 through the tinker SDK
  (HTTP), each: forward_backward + optim_step per step on batches fixed by (seed, session, step),
  a weights_sync and a sample every 5 steps, a save_state every 10;
- OpenAI chat completions against the base model (a thread, the `openai` client);
- faults, in a seeded order, spread over the run: a replica killed with SIGKILL, a replica
  stopped (SIGSTOP) for 4 s then resumed, a client's gRPC channel dropped (the session is
  re-attached from a new client), one oversized request (refused, nothing changes), a failing
  save_state (``TOGETHER_TRAIN_TEST_FAULTS=save_state:K``: the save fails cleanly, nothing
  partial is listed, training goes on), and the server killed with SIGKILL and restarted on the
  same storage and ports, every session resumed from its last checkpoint (with its optimizer).

Report (printed as ``key=value`` lines and written to --out as JSON): ops acknowledged, lost
(acknowledged steps missing from a session's final history: must be 0), duplicated (a step applied
twice, seen as a step counter that skips: must be 0), checkpoints verified (downloaded, every
file's sha256 checked), the longest pause between two acknowledged optim_steps of each session
outside the server restart (and the restart's own cost), and the replay: on a fresh server every
gRPC session's stretch between two checkpoints is trained again from the first and must end
bit-identical to the second. Exit status 0 only when lost = duplicated = 0 and the replay is exact.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "server", ROOT / "tests"):
    sys.path.insert(0, str(p))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "server"), os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import together_train as tt  # noqa: E402

ADAM = tt.AdamParams(learning_rate=1e-2, eps=1e-4)
LORA_RANK = 4
SYNC_EVERY, SAVE_EVERY = 5, 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(seed: int, who: int, step: int, vocab: int) -> list[tuple[list[int], list[int], list[float]]]:
    """The (input, targets, weights) rows of one step: fixed by (seed, session, step)."""
    rng = np.random.default_rng([seed, who, step])
    rows = []
    for n in (12, 7):
        t = rng.integers(1, vocab, size=n + 1)
        rows.append((t[:-1].tolist(), t[1:].tolist(), [1.0] * n))
    return rows


def sdk_batch(rows) -> list[tt.Sample]:
    return [tt.Sample(model_input=np.asarray(i), loss_fn_inputs={"target_tokens": np.asarray(t),
                                                                 "weights": np.asarray(w, np.float32)})
            for i, t, w in rows]


class Server:
    """`together-train serve` on fixed ports over one storage directory (restartable after SIGKILL)."""

    def __init__(self, model: Path, storage: Path, log: Path, faults: str = "") -> None:
        self.model, self.storage, self.log = model, storage, log
        self.port, self.http_port = free_port(), free_port()
        self.faults = faults
        self.local = None
        self.client = None

    def start(self) -> tt.ResourceClient:
        env = {"TOGETHER_TRAIN_TEST_FAULTS": self.faults} if self.faults else {}
        self.local = tt.LocalResource(
            model=str(self.model), generators=2, port=self.port, storage_dir=self.storage, http_port=self.http_port,
            log_file=self.log, env=env, startup_timeout=300,
            extra_args=["--max-sessions", "32", "--trainer-threads", "1", "--generator-threads", "1",
                        "--replica-probe-period-s", "1", "--replica-probe-timeout-s", "2"])
        self.client = self.local.__enter__()
        return self.client

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def replicas(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.local.process.pid)], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    def kill9(self) -> None:
        """SIGKILL the server (its replicas exit when their parent is gone)."""
        kids = self.replicas()
        self.local.process.kill()
        self.local.process.wait()
        for k in kids:
            try:
                os.kill(k, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.local._tmp and shutil.rmtree(self.local._tmp, ignore_errors=True)

    def stop(self) -> None:
        if self.local is not None and self.local.process.poll() is None:
            self.local.__exit__(None, None, None)


class Trainer(threading.Thread):
    """One training session; survives faults; records every acknowledged step and checkpoint."""

    def __init__(self, who: int, kind: str, soak: "Soak") -> None:
        super().__init__(daemon=True, name=f"trainer-{who}")
        self.who, self.kind, self.soak = who, kind, soak
        self.step = 0
        self.acks: list[tuple[float, int, int]] = []  # (time, expected step, step the server reported)
        self.ckpts: list[tuple[int, str]] = []  # (step, uri / tinker path)
        self.errors: list[str] = []
        self.session = None
        self.tc = None
        self.failed_saves = 0

    # ----- one backend per kind -----
    def _open(self, resume: str | None) -> None:
        s = self.soak
        if self.kind == "grpc":
            c = s.server.client
            if resume:
                self.session = c.create_session(checkpoint_uri=resume, with_optimizer=True)
            else:
                self.session = c.create_session(lora=tt.LoraConfig(rank=LORA_RANK, alpha=8.0, seed=s.seed + self.who))
        else:
            import tinker

            sc = tinker.ServiceClient(base_url=s.server.url, api_key="tml-soak")
            if resume:
                self.tc = sc.create_training_client_from_state_with_optimizer(resume)
            else:
                self.tc = sc.create_lora_training_client(base_model=str(s.model), rank=LORA_RANK, seed=s.seed + self.who)

    def _train_step(self, k: int) -> int:
        rows = batch(self.soak.seed, self.who, k, self.soak.vocab)
        if self.kind == "grpc":
            self.session.forward_backward(sdk_batch(rows), "cross_entropy")
            return int(self.session.optim_step(ADAM).result(timeout=300).step)
        from tinker import types as T

        data = [T.Datum(model_input=T.ModelInput.from_ints(i), loss_fn_inputs={"target_tokens": t, "weights": w})
                for i, t, w in rows]
        self.tc.forward_backward(data, "cross_entropy").result()
        self.tc.optim_step(T.AdamParams(learning_rate=ADAM.learning_rate, eps=ADAM.eps)).result()
        return k + 1  # the tinker SDK reports no step counter: checked through checkpoints

    def _sync_and_sample(self) -> None:
        if self.kind == "grpc":
            self.session.weights_sync().result(timeout=300)
            r = self.session.sample([5, 6, 7], tt.SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=300)
            assert r.policy_version == self.step, (r.policy_version, self.step)

    def _save(self, k: int) -> None:
        name = f"soak-{self.who}-{k}-{self.soak.epoch}"
        if self.kind == "grpc":
            try:
                ck = self.session.save_state(name).result(timeout=300)
            except tt.errors.TogetherTrainError as e:
                if "InjectedFault" not in str(e):
                    # e.g. ClientClosedError from a dropped channel: the save may still land, so it is
                    # neither a failed save nor a checkpoint to resume from; the run loop retries.
                    raise
                self.failed_saves += 1
                self.soak.failed_save_names.append((self.session.session_id, name, str(e)[:120]))
                return
            assert ck.step == k, (ck.step, k)
            self.ckpts.append((k, ck.uri))
        else:
            self.ckpts.append((k, self.tc.save_state(name).result().path))

    def run(self) -> None:
        soak = self.soak
        resume = None
        while not soak.done.is_set():
            epoch = soak.epoch
            try:
                soak.up.wait()
                self._open(resume)
                while not soak.done.is_set() and soak.epoch == epoch:
                    got = self._train_step(self.step)
                    self.acks.append((time.monotonic(), self.step + 1, got))
                    self.step += 1
                    if self.step % SYNC_EVERY == 0:
                        self._sync_and_sample()
                    if self.step % SAVE_EVERY == 0:
                        self._save(self.step)
            except Exception as e:
                if soak.done.is_set():
                    return
                self.errors.append(f"epoch {epoch} step {self.step}: {type(e).__name__}: {str(e)[:160]}")
                soak.up.wait()
                if soak.epoch == epoch:  # not the restart: give the fault a moment, keep the lineage exact
                    time.sleep(1.0)
            # Resume from the last checkpoint (server restart or a failed call).
            if self.ckpts:
                self.step, resume = self.ckpts[-1]
            else:
                self.step, resume = 0, None
            self.acks.append((time.monotonic(), -1, -1))  # a lineage break marker


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.seed = args, args.seed
        self.rng = random.Random(args.seed)
        self.tmp = Path(tempfile.mkdtemp(prefix="together-train-soak-"))
        self.done, self.up = threading.Event(), threading.Event()
        self.epoch = 0
        self.failed_save_names: list = []
        self.faults: list[tuple[float, str, float]] = []  # (time, fault, its cost in s)
        self.chat_ok = self.chat_failed = 0

    def chat(self) -> None:
        import openai

        while not self.done.is_set():
            self.up.wait()
            try:
                oai = openai.OpenAI(base_url=self.server.url + "/v1", api_key="soak", max_retries=0, timeout=60)
                oai.chat.completions.create(model=self.base_id, max_tokens=4,
                                            messages=[{"role": "user", "content": "hi"}])
                self.chat_ok += 1
            except Exception:
                self.chat_failed += 1
            time.sleep(0.5)

    def run(self) -> dict:
        from _models import build_tiny_model

        a = self.args
        self.model = build_tiny_model(self.tmp / "model", arch="llama", seed=self.seed)
        (self.tmp / "keys").write_text("soak\n")
        storage = self.tmp / "storage"
        self.server = Server(self.model, storage, self.tmp / "server.log", faults="save_state:3")
        client = self.server.start()
        self.vocab = client.get_capabilities().vocab_size
        self.base_id = None
        import openai

        self.base_id = openai.OpenAI(base_url=self.server.url + "/v1", api_key="soak").models.list().data[0].id
        self.up.set()
        trainers = [Trainer(i, "grpc", self) for i in range(3)] + [Trainer(3, "tinker", self)]
        for t in trainers:
            t.start()
        threading.Thread(target=self.chat, daemon=True).start()
        t_end = time.monotonic() + 60 * a.minutes
        plan = ["replica_kill9", "replica_stop", "drop_channel", "oversized", "server_kill9"]
        self.rng.shuffle(plan)
        plan.remove("server_kill9")
        plan.insert(len(plan) // 2, "server_kill9")  # the restart mid-run, the others around it
        gap = 60 * a.minutes / (len(plan) + 1)
        restart_windows = []
        for fault in plan:
            time.sleep(max(0.0, min(gap * self.rng.uniform(0.7, 1.0), t_end - time.monotonic() - 5)))
            t0 = time.monotonic()
            try:
                self.inject(fault, trainers, restart_windows)
            except Exception as e:
                print(f"fault {fault} could not be injected: {e}", flush=True)
            self.faults.append((t0 - self.t_start if hasattr(self, "t_start") else 0.0, fault, time.monotonic() - t0))
        time.sleep(max(0.0, t_end - time.monotonic()))
        self.done.set()
        for t in trainers:
            t.join(timeout=120)
        report = self.report(trainers, restart_windows)
        self.server.stop()
        report.update(self.replay(trainers, storage))
        return report

    def inject(self, fault: str, trainers: list[Trainer], windows: list) -> None:
        srv = self.server
        if fault == "replica_kill9":
            os.kill(srv.replicas()[0], signal.SIGKILL)
        elif fault == "replica_stop":
            pid = srv.replicas()[-1]
            os.kill(pid, signal.SIGSTOP)
            time.sleep(4.0)
            os.kill(pid, signal.SIGCONT)
        elif fault == "drop_channel":
            t = trainers[0]
            old = srv.client
            fresh = tt.ResourceClient(srv.local.address, storage_dir=srv.storage)
            srv.client = fresh
            t.session = fresh.session(t.session.session_id)  # re-attached: same session, next seq_id
            old.close()
        elif fault == "oversized":
            big = [tt.Sample(model_input=np.ones(200_000, np.int64),
                             loss_fn_inputs={"target_tokens": np.ones(200_000, np.int64),
                                             "weights": np.ones(200_000, np.float32)})]
            s = srv.client.create_session(lora=tt.LoraConfig(rank=2))
            try:
                s.forward_backward(big, "cross_entropy").result(timeout=120)
                raise AssertionError("an oversized request was accepted")
            except tt.errors.TogetherTrainError:
                pass
            assert s.info().step == 0
            s.stop()
        elif fault == "server_kill9":
            self.up.clear()
            t0 = time.monotonic()
            self.epoch += 1
            srv.kill9()
            srv.faults = ""
            srv.start()
            windows.append((t0, time.monotonic() + 30.0))  # resume: sessions recreated from checkpoints
            self.up.set()

    def report(self, trainers: list[Trainer], windows: list) -> dict:
        out: dict = {"acked": 0, "lost": 0, "duplicated": 0, "errors": {}, "pause_s": {}, "failed_saves": 0}
        for t in trainers:
            history: dict[int, int] = {}
            prev = None
            longest = 0.0
            for when, expected, got in t.acks:
                if expected < 0:
                    prev = None
                    continue
                out["acked"] += 1
                if got != expected:
                    out["duplicated"] += 1
                history[expected] = got
                if prev is not None and not any(a <= when <= b for a, b in windows):
                    longest = max(longest, when - prev)
                prev = when
            final = t.step
            out["lost"] += sum(1 for k in range(1, final + 1) if k not in history)
            out["pause_s"][f"{t.kind}-{t.who}"] = round(longest, 2)
            out["errors"][f"{t.kind}-{t.who}"] = t.errors
            out["failed_saves"] += t.failed_saves
            out[f"steps_{t.kind}-{t.who}"] = final
        # Checkpoints: every one downloads and matches its manifest; the failed save is not listed.
        c = self.server.client
        listed = {ck.uri: ck for ck in c.list_checkpoints()}
        verified = 0
        for t in trainers:
            for _, uri in t.ckpts:
                if t.kind != "grpc":
                    uri = "together-train://" + uri[len("tinker://"):].replace("/weights/", "/state/")
                dest = self.tmp / "dl" / uri.split("://")[1]
                c.download_checkpoint(uri, dest)
                verified += 1
                shutil.rmtree(dest)  # one at a time: an hour's checkpoints need not fit on disk twice
        partial = [n for sid, n, _ in self.failed_save_names if f"together-train://{sid}/state/{n}" in listed]
        out.update(checkpoints_verified=verified, failed_save_listed=len(partial), faults=self.faults,
                   chat_ok=self.chat_ok, chat_failed=self.chat_failed)
        return out

    def replay(self, trainers: list[Trainer], storage: Path) -> dict:
        """On a fresh server over the same storage: each gRPC session's stretch between its first and
        last checkpoints, trained again, ends bit-identical to the last checkpoint."""
        from safetensors.numpy import load_file

        fresh = Server(self.model, storage, self.tmp / "replay.log")
        client = fresh.start()
        exact, checked = True, 0
        try:
            for t in trainers:
                if t.kind != "grpc" or len(t.ckpts) < 2:
                    continue
                (a, ua), (b, ub) = t.ckpts[-2], t.ckpts[-1]
                s = client.create_session(checkpoint_uri=ua, with_optimizer=True)
                for k in range(a, b):
                    s.forward_backward(sdk_batch(batch(self.seed, t.who, k, self.vocab)), "cross_entropy")
                    s.optim_step(ADAM)
                again = s.save_state(f"replay-{t.who}").result(timeout=300)
                want = client.download_checkpoint(ub, self.tmp / "want" / str(t.who))
                got = client.download_checkpoint(again.uri, self.tmp / "got" / str(t.who))
                for f in sorted(want.glob("*.safetensors")):
                    w, g = load_file(f), load_file(got / f.name)
                    same = w.keys() == g.keys() and all(np.array_equal(w[k], g[k]) for k in w)
                    exact &= same
                checked += 1
                s.stop()
        finally:
            fresh.stop()
        return {"replay_exact": bool(exact and checked), "replay_sessions": checked}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the report here as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, storage)")
    args = ap.parse_args()
    soak = Soak(args)
    soak.t_start = time.monotonic()
    try:
        rep = soak.run()
    finally:
        soak.done.set()
        try:
            soak.server.stop()
        except Exception:
            pass
        if not args.keep:
            shutil.rmtree(soak.tmp, ignore_errors=True)
        else:
            print(f"kept {soak.tmp}")
    rep["load_avg"] = os.getloadavg()
    for k, v in rep.items():
        print(f"{k}={json.dumps(v)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rep, indent=1))
    ok = rep["lost"] == 0 and rep["duplicated"] == 0 and rep["replay_exact"] and rep["failed_save_listed"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
