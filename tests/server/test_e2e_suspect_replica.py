"""A replica that stops answering loses its samples to the other replica at once (issue 23, "A stuck replica").

Real processes: a resource with 2 spawned replicas on a tiny random Llama with a 4,096-token context
(one sample decodes for seconds). The probes are set so that they never mark the stopped replica
down while the test holds it (probe deadline 30 s, 1,000 misses): only the suspicion can help,
a probe unanswered for ``--replica-suspect-s`` (0.5 s, service/replicas/supervision.py).

Samples are in flight on both replicas (the resource's Health shows the stopped one's outstanding
requests), one replica gets SIGSTOP and stays stopped until every sample returned (or 120 s):

- every sample returns while the replica is still stopped, all of them served by the other replica,
  each with all of its tokens and the synced policy version;
- the resource's log says which requests were re-issued;
- after SIGCONT the replica answers a probe and serves again.

On the code before the suspicion, a sample on the stopped replica waited for SIGCONT (the probes
never took it out of routing), so the first assertion fails there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import together_train as tt
from together_train.status import resource_status

CONTEXT = 4096
FLAGS = ["--replica-probe-period-s", "0.5", "--replica-probe-timeout-s", "30", "--replica-probe-misses", "1000",
         "--replica-suspect-s", "0.5", "--trainer-threads", "1", "--generator-threads", "1"]
PARAMS = tt.SamplingParams(max_tokens=1500, temperature=1.0, seed=11, ignore_eos=True)
HOLD_S = 120.0  # the replica stays stopped at most this long


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    from _models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-4k"), arch="llama", seed=0, max_positions=CONTEXT)


def replica_pids(server_pid: int) -> dict[str, int]:
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True)
    pids = {}
    for pid in (int(x) for x in out.stdout.split()):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        pids[argv[argv.index(b"--replica-id") + 1].decode()] = pid
    return pids


@pytest.mark.timeout(600)
def test_samples_on_a_stopped_replica_are_reissued_on_the_other(long_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with tt.launch_local(model=str(long_model_dir), generators=2, storage_dir=tmp_path / "storage",
                         log_file=log, extra_args=FLAGS) as client:
        s = client.create_session(lora=tt.LoraConfig(rank=4, seed=0))
        toks = np.arange(1, 30)
        s.forward_backward([tt.Sample(model_input=toks[:-1], loss_fn_inputs={
            "target_tokens": toks[1:], "weights": np.ones(28, np.float32)})], "cross_entropy")
        s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=60)
        assert s.weights_sync().result(timeout=120).num_replicas == 2
        pids = replica_pids(client.local_resource.process.pid)
        assert len(pids) == 2, pids

        futures = [s.sample([5, 6, 7], PARAMS) for _ in range(4)]  # least-outstanding routing: 2 on each
        deadline = time.monotonic() + 60
        while True:
            busy = {r["replica_id"]: r["outstanding"] for r in resource_status(client)["replicas"]}
            if all(busy.get(rid, 0) > 0 for rid in pids) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert all(busy.get(rid, 0) > 0 for rid in pids), f"samples not in flight on both replicas: {busy}"
        stopped_id = sorted(pids)[0]
        os.kill(pids[stopped_id], signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            ended = []
            for f in futures:
                r = f.result(timeout=HOLD_S)
                ended.append((time.monotonic() - t_stop, r))
        finally:
            os.kill(pids[stopped_id], signal.SIGCONT)
        t_cont = time.monotonic() - t_stop
        print(f"stopped {stopped_id}; samples ended {[round(t, 2) for t, _ in ended]} s after the stop; "
              f"resumed at {t_cont:.2f} s; served by {[r.replica_id for _, r in ended]}")
        assert t_cont < HOLD_S, f"the samples waited for the stopped replica ({t_cont:.1f} s)"
        for i, (_, r) in enumerate(ended):
            assert r.replica_id != stopped_id, f"sample {i} was served by the stopped replica {stopped_id}"
            assert r.policy_version == 1, (i, r.policy_version)
            assert len(r.sequences[0].tokens) == PARAMS.max_tokens, (i, len(r.sequences[0].tokens))
        text = log.read_text()
        assert f"replica {stopped_id} is suspect: its request is re-issued on another replica" in text, text[-3000:]

        # Resumed, it answers a probe and serves again.
        deadline = time.monotonic() + 120
        served = set()
        while stopped_id not in served and time.monotonic() < deadline:
            served |= {f.result(timeout=120).replica_id for f in
                       [s.sample([5, 6, 7], tt.SamplingParams(max_tokens=4, seed=1)) for _ in range(4)]}
        assert stopped_id in served, f"{stopped_id} never served again: {served}"
        s.stop()
