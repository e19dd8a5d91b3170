#!/usr/bin/env python
"""Soak: several clients train on one resource for M minutes while faults are injected; nothing is lost.

``python scripts/soak.py --minutes M --seed S [--out report.json] [--keep]``: seeded, bounded,
loopback only; everything (a tiny random model, the storage, the server processes) lives in a
temporary directory removed at the end. What runs at once:

- 4 training sessions, one thread each (`soak_clients`): 2 through the gRPC SDK (`together_train`),
  1 through the tinker SDK and 1 through the together SDK (``together.post_training``), both on the
  HTTP port; each: forward_backward + optim_step per step on batches fixed by (seed, session,
  step), a weights_sync every 5 steps (the gRPC sessions also sample and check the sampled
  policy_version), a save_state every 10;
- OpenAI chat completions against the base model (a thread, the `openai` client);
- faults, each kind once per `CYCLE_MIN` minutes in a seeded order, spread over the run: a replica
  killed with SIGKILL, a replica stopped (SIGSTOP) for 4 s then resumed, the gRPC sessions' client
  closed under them (what is in flight fails; the sessions are re-attached from a new client), an
  oversized request (refused, nothing changes), the server killed with SIGKILL and restarted on
  the same storage and ports, every session resumed from its last checkpoint (with its optimizer)
  through its own SDK; and with each server start a failing save_state (the fault hook
  ``TOGETHER_TRAIN_TEST_FAULTS=save_state:3``: the save fails cleanly, the session lists nothing
  it did not list before, training goes on).

Report (printed as ``key=value`` lines and written to --out as JSON):

- ``acked``: optim_steps acknowledged; ``lost``: acknowledged steps missing from a session's final
  history (0); ``duplicated``: an acknowledged step whose counter is not the one expected, i.e. a
  step applied twice or skipped (0). A server kill -9 loses what is not checkpointed by design: the
  session resumes at its last checkpoint and redoes those steps on the same batches.
- ``checkpoints_verified``: every acknowledged checkpoint listed and downloaded through the gRPC SDK
  (each file's size and sha256 checked against its manifest), one at a time, each deleted after;
  ``checkpoints_missing``: acknowledged but not listed.
- ``failed_saves`` / ``failed_save_listed``: saves refused by the fault hook, and those after which
  the session listed a checkpoint it did not list before (0).
- ``pause_s``: per session, the longest time between two consecutive acknowledged optim_steps minus
  the part of it the server was down (kill until the restarted server answers: that fault's own
  cost, in ``server_restart_s``); what remains of a restart is the session's resume.
  ``pause_at_s`` says when it began, ``pause_outside_restart_s`` is the longest gap spanning no
  restart (what the other faults cost training), ``median_step_gap_s`` what a step takes here.
- ``faults``: each fault's time, its own cost (how long injecting it took: the 4 s stop, the
  restart) and outcome; ``restarts_at_s``: each server restart as [killed, answering again] (s since
  the start).
- ``recoveries_s``: per session, each time a call failed or a restart ended its lineage: [failed
  or restart seen, session re-opened from its checkpoint through its SDK, first step acknowledged
  after] (s since the start).
- ``replay``: on a fresh server over the same storage, every session's stretch between its last
  two checkpoints is trained again from the first through the gRPC SDK and must end bit-identical
  to the second (adapter, AdamW moments, RNG state).

Exit status 0 only when lost = duplicated = 0, a save failed and nothing of it is listed, every
checkpoint is listed, every fault was injected, and the replay is exact.
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
for p in (ROOT, ROOT / "server", ROOT / "tests", ROOT / "scripts"):
    sys.path.insert(0, str(p))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "server"), os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import together_train as tt  # noqa: E402
from soak_clients import ADAM, BACKENDS, SaveRefused, grpc_samples  # noqa: E402

SYNC_EVERY, SAVE_EVERY = 5, 10
KINDS = ("grpc", "grpc", "tinker", "together")  # one session each, all at once
FAULTS = ("replica_kill9", "replica_stop", "drop_channel", "oversized", "server_kill9")
CYCLE_MIN = 6  # minutes per cycle of faults (each kind once; the failing save comes with each server start)


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


class Server:
    """`together-train serve` on fixed ports over one storage directory (restartable after SIGKILL)."""

    def __init__(self, model: Path, storage: Path, log: Path, faults: str = "", generators: int = 2) -> None:
        self.model, self.storage, self.log, self.generators = model, storage, log, generators
        self.port, self.http_port = free_port(), free_port()
        self.faults = faults
        self.local = None
        self.client = None

    def start(self) -> tt.ResourceClient:
        env = {"TOGETHER_TRAIN_TEST_FAULTS": self.faults} if self.faults else {}
        self.local = tt.LocalResource(
            model=str(self.model), generators=self.generators, port=self.port, storage_dir=self.storage, http_port=self.http_port,
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
    """One training session through one SDK (`soak_clients`); survives faults; records every acknowledged
    step (time, expected counter, the resource's counter) and checkpoint (step, URI)."""

    def __init__(self, who: int, kind: str, soak: "Soak") -> None:
        super().__init__(daemon=True, name=f"{kind}-{who}")
        self.who, self.kind, self.soak = who, kind, soak
        self.step = 0
        self.acks: list[tuple[float, int, int]] = []  # (time, expected step, step the server reported)
        self.ckpts: list[tuple[int, str]] = []  # (step, together-train:// URI)
        self.errors: list[str] = []
        self.backend = None
        self.failed_saves = 0
        self.saves_tried = 0
        # each recovery: [failed at, session re-opened at, first step after] (monotonic s)
        self.recoveries: list[list[float]] = []

    def _save(self, k: int) -> None:
        s = self.soak
        self.saves_tried += 1
        name = f"soak-{self.who}-{k}-{s.epoch}-{self.saves_tried}"  # unique: a save may land unacknowledged
        sid = self.backend.session_id
        before = {c.uri for c in s.server.client.list_checkpoints(session_id=sid)}
        try:
            step, uri = self.backend.save(name)
        except SaveRefused as e:
            # nothing partial: the session lists what it listed before (its saves are sequential)
            after = {c.uri for c in s.server.client.list_checkpoints(session_id=sid)}
            self.failed_saves += 1
            s.failed_saves.append({"session": self.name, "step": k, "error": str(e)[:160],
                                   "listed_unacknowledged": sorted(after - before)})
            return
        assert step == k, f"checkpoint {uri} at step {step}, session at {k}"
        self.ckpts.append((k, uri))

    def run(self) -> None:
        soak = self.soak
        resume = None
        while not soak.done.is_set():
            epoch = soak.epoch
            try:
                soak.up.wait()
                if self.backend is not None:
                    self.backend.close()
                self.backend = BACKENDS[self.kind](soak.server, str(soak.model), soak.seed + self.who, resume)
                if self.recoveries and len(self.recoveries[-1]) == 1:
                    self.recoveries[-1].append(time.monotonic())
                while not soak.done.is_set() and soak.epoch == epoch:
                    got = self.backend.train_step(batch(soak.seed, self.who, self.step, soak.vocab))
                    self.acks.append((time.monotonic(), self.step + 1, got))
                    if self.recoveries and len(self.recoveries[-1]) == 2:
                        self.recoveries[-1].append(self.acks[-1][0])
                    self.step += 1
                    if self.step % SYNC_EVERY == 0:
                        self.backend.sync_and_sample(self.step)
                    if self.step % SAVE_EVERY == 0:
                        self._save(self.step)
                if not soak.done.is_set():
                    self.recoveries.append([time.monotonic()])  # the restart, seen without a failed call
            except Exception as e:
                if soak.done.is_set():
                    return
                self.errors.append(f"epoch {epoch} step {self.step}: {type(e).__name__}: {str(e)[:160]}")
                self.recoveries.append([time.monotonic()])
                soak.up.wait()
                if soak.epoch == epoch:  # not the restart: give the fault a moment, keep the lineage exact
                    time.sleep(1.0)
            # Resume from the last checkpoint (server restart or a failed call).
            if self.ckpts:
                self.step, resume = self.ckpts[-1]
            else:
                self.step, resume = 0, None
            self.acks.append((time.monotonic(), -1, -1))  # a lineage break marker


def pauses(acks: list[tuple[float, int, int]], restarts: list[tuple[float, float]]) -> dict:
    """A session's pauses in s: the gaps between its consecutive acknowledged optim_steps (across a resume too).

    ``longest``: the longest gap minus the part of it the server was down (kill -9 until the restarted
    server answers: that fault's own cost), so after a restart what counts is the session's resume
    (recreated from its checkpoint through its SDK) and its first step; ``at``: when that gap began
    (monotonic); ``outside_restart``: the longest gap that spans no restart (what the other faults
    cost training); ``median``: the median gap (one step on this machine).
    """
    times = [when for when, expected, _ in acks if expected >= 0]
    gaps = []
    for a, b in zip(times, times[1:]):
        down = [max(0.0, min(b, up) - max(a, k)) for k, up in restarts]
        gaps.append((b - a - sum(down), a, any(d > 0 for d in down)))
    if not gaps:
        return {"longest": 0.0, "at": 0.0, "outside_restart": 0.0, "median": 0.0}
    longest = max(gaps)
    return {"longest": longest[0], "at": longest[1], "median": float(np.median([g for g, _, _ in gaps])),
            "outside_restart": max((g for g, _, spans in gaps if not spans), default=0.0)}


class Soak:
    """The run: the server, the sessions, the chat thread, the fault schedule, the report and the replay."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.seed = args, args.seed
        self.rng = random.Random(args.seed)
        self.tmp = Path(tempfile.mkdtemp(prefix="together-train-soak-"))
        self.done, self.up = threading.Event(), threading.Event()
        self.epoch = 0
        self.t_start = time.monotonic()
        self.failed_saves: list[dict] = []
        self.faults: list[dict] = []  # {"t_s", "fault", "cost_s", "note"}
        self.restarts: list[tuple[float, float]] = []  # (kill, restarted server answering), monotonic
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
        storage = self.tmp / "storage"
        self.server = Server(self.model, storage, self.tmp / "server.log", faults="save_state:3")
        client = self.server.start()
        self.vocab = client.get_capabilities().vocab_size
        import openai

        self.base_id = openai.OpenAI(base_url=self.server.url + "/v1", api_key="soak").models.list().data[0].id
        self.up.set()
        trainers = [Trainer(i, kind, self) for i, kind in enumerate(KINDS)]
        for t in trainers:
            t.start()
        threading.Thread(target=self.chat, daemon=True).start()
        t_end = time.monotonic() + 60 * a.minutes
        plan = []
        for _ in range(max(1, round(a.minutes / CYCLE_MIN))):  # every kind once per cycle, seeded order
            kinds = [k for k in FAULTS if k != "server_kill9"]
            self.rng.shuffle(kinds)
            kinds.insert(len(kinds) // 2, "server_kill9")  # the restart mid-cycle, the others around it
            plan += kinds
        gap = 60 * a.minutes / (len(plan) + 1)
        for fault in plan:
            time.sleep(max(0.0, min(gap * self.rng.uniform(0.7, 1.0), t_end - time.monotonic() - 5)))
            t0 = time.monotonic()
            try:
                note = self.inject(fault, trainers) or "ok"
            except Exception as e:
                note = f"not injected: {type(e).__name__}: {str(e)[:200]}"
                print(f"fault {fault} {note}", flush=True)
            self.faults.append({"t_s": round(t0 - self.t_start, 1), "fault": fault,
                                "cost_s": round(time.monotonic() - t0, 2), "note": note})
        time.sleep(max(0.0, t_end - time.monotonic()))
        self.done.set()
        for t in trainers:
            t.join(timeout=120)
        report = self.report(trainers)
        self.server.stop()
        report.update(self.replay(trainers, storage))
        return report

    def inject(self, fault: str, trainers: list[Trainer]) -> str | None:
        srv = self.server
        if fault == "replica_kill9":
            os.kill(srv.replicas()[0], signal.SIGKILL)
        elif fault == "replica_stop":
            pid = srv.replicas()[-1]
            os.kill(pid, signal.SIGSTOP)
            time.sleep(4.0)
            os.kill(pid, signal.SIGCONT)
        elif fault == "drop_channel":
            # the gRPC sessions' shared client closed under them: what is in flight fails (ClientClosedError;
            # the session resumes from its checkpoint), the sessions go on from a new client
            old = srv.client
            fresh = tt.ResourceClient(srv.local.address, storage_dir=srv.storage)
            srv.client = fresh
            for t in trainers:
                if t.kind == "grpc" and t.backend is not None:
                    t.backend.reattach(fresh)  # the same session, its next seq_id
            old.close()
        elif fault == "oversized":
            big = [tt.Sample(model_input=np.ones(200_000, np.int64),
                             loss_fn_inputs={"target_tokens": np.ones(200_000, np.int64),
                                             "weights": np.ones(200_000, np.float32)})]
            s = srv.client.create_session(lora=tt.LoraConfig(rank=2))
            try:
                s.forward_backward(big, "cross_entropy").result(timeout=120)
                raise AssertionError("an oversized request was accepted")
            except tt.errors.TogetherTrainError as e:
                refusal = f"refused {e.code}"
            assert s.info().step == 0
            s.stop()
            return refusal
        elif fault == "server_kill9":
            self.up.clear()
            t0 = time.monotonic()
            self.epoch += 1
            srv.kill9()
            srv.start()  # the same fault hook: the 3rd save_state on the restarted server fails too
            self.restarts.append((t0, time.monotonic()))
            self.up.set()
        return None

    def report(self, trainers: list[Trainer]) -> dict:
        out: dict = {"acked": 0, "lost": 0, "duplicated": 0, "errors": {}, "pause_s": {}, "pause_at_s": {},
                     "pause_outside_restart_s": {}, "median_step_gap_s": {}, "steps": {}}
        for t in trainers:
            history: dict[int, int] = {}
            for _, expected, got in t.acks:
                if expected < 0:
                    continue
                out["acked"] += 1
                if got != expected:
                    out["duplicated"] += 1
                history[expected] = got
            out["lost"] += sum(1 for k in range(1, t.step + 1) if k not in history)
            p = pauses(t.acks, self.restarts)
            out["pause_s"][t.name] = round(p["longest"], 2)
            out["pause_at_s"][t.name] = round(p["at"] - self.t_start, 1)
            out["pause_outside_restart_s"][t.name] = round(p["outside_restart"], 2)
            out["median_step_gap_s"][t.name] = round(p["median"], 2)
            out["errors"][t.name] = t.errors
            # [failed, re-opened, first step] in s since the start: what each recovery cost this session
            out.setdefault("recoveries_s", {})[t.name] = [[round(x - self.t_start, 2) for x in r] for r in t.recoveries]
            out["steps"][t.name] = t.step
        # Checkpoints: every acknowledged one is listed and downloads (the SDK checks each file's size and
        # sha256 against the manifest), one at a time: an hour's checkpoints need not fit on disk twice.
        c = self.server.client
        listed = {ck.uri for ck in c.list_checkpoints()}
        verified, missing = 0, []
        for t in trainers:
            for _, uri in t.ckpts:
                if uri not in listed:
                    missing.append(uri)
                    continue
                dest = self.tmp / "dl" / uri.split("://")[1]
                c.download_checkpoint(uri, dest)
                verified += 1
                shutil.rmtree(dest)
        out.update(checkpoints_verified=verified, checkpoints_missing=missing,
                   failed_saves=len(self.failed_saves),
                   failed_save_listed=sum(1 for f in self.failed_saves if f["listed_unacknowledged"]),
                   failed_save_detail=self.failed_saves, faults=self.faults,
                   server_restart_s=[round(b - a, 1) for a, b in self.restarts],
                   restarts_at_s=[[round(a - self.t_start, 2), round(b - self.t_start, 2)] for a, b in self.restarts],
                   chat_ok=self.chat_ok, chat_failed=self.chat_failed)
        return out

    def replay(self, trainers: list[Trainer], storage: Path) -> dict:
        """On a fresh server over the same storage: each session's stretch between its last two checkpoints,
        trained again through the gRPC SDK from the first (with its optimizer), ends bit-identical to the
        second (every tensor of the adapter, the AdamW moments and the RNG state)."""
        from safetensors.numpy import load_file

        fresh = Server(self.model, storage, self.tmp / "replay.log", generators=0)
        client = fresh.start()
        detail = {}
        try:
            for t in trainers:
                if len(t.ckpts) < 2:
                    detail[t.name] = "fewer than 2 checkpoints"
                    continue
                (a, ua), (b, ub) = t.ckpts[-2], t.ckpts[-1]
                s = client.create_session(checkpoint_uri=ua, with_optimizer=True)
                for k in range(a, b):
                    s.forward_backward(grpc_samples(batch(self.seed, t.who, k, self.vocab)), "cross_entropy")
                    s.optim_step(tt.AdamParams(**ADAM))
                again = s.save_state(f"replay-{t.who}").result(timeout=300)
                s.stop()
                want = client.download_checkpoint(ub, self.tmp / "want")
                got = client.download_checkpoint(again.uri, self.tmp / "got")
                differ = []
                for f in sorted(want.glob("*.safetensors")):
                    w, g = load_file(f), load_file(got / f.name)
                    differ += [f"{f.name}:{k}" for k in sorted(set(w) | set(g))
                               if k not in w or k not in g or not np.array_equal(w[k], g[k])]
                shutil.rmtree(want)
                shutil.rmtree(got)
                detail[t.name] = f"steps {a}..{b}: " + (f"DIFFER {differ[:4]}" if differ else "bit-exact")
        finally:
            fresh.stop()
        exact = all(v.endswith("bit-exact") for v in detail.values())
        return {"replay_exact": exact, "replay_sessions": sum(v.endswith("bit-exact") for v in detail.values()),
                "replay": detail}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the report here as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, storage)")
    args = ap.parse_args()
    soak = Soak(args)
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
    ok = (rep["lost"] == 0 and rep["duplicated"] == 0 and rep["replay_exact"] and rep["failed_saves"] >= 1
          and rep["failed_save_listed"] == 0 and not rep["checkpoints_missing"]
          and all(f["note"] == "ok" or f["note"].startswith("refused") for f in rep["faults"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
