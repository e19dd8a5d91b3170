"""Session paging on a real resource (service/sessions/pager.py, engines/session_pages.py).

The resident budget is two tiny rank-4 sessions (8,192 LoRA parameters x 16 bytes = 0.125 MiB each:
``--session-memory-mb 0.25``), so a third session's call pages the least recently used idle one out.

- A session paged out and back in (twice a round, once with a gradient accumulated) continues bit for
  bit like its twin that never left: the same forward_backward losses, logprobs, and final training
  state (weights, AdamW moments, RNG stream), with LoRA dropout on.
- A page that fails its checksum: the call fails with DATA_LOSS naming the session, never a fresh adapter.
- A page-out whose write fails (disk full, injected: TOGETHER_TRAIN_TEST_PAGE_FAULTS=enospc:1) keeps the
  session resident and training, logs an error naming it and counts it in /metrics; the next least
  recently used one goes.
- A session whose SDK client is alive (heartbeating) but not using it is paged out after --page-out-idle:
  heartbeats keep a session from being discarded, not resident; it continues bit for bit after.
- kill -9 while a page is being written: the session's previous page is still there, whole (checksum
  verified), and a restart on the same storage removes the unfinished temporary file.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import together_train as tt
from _checkpoint_helpers import ADAM, assert_bit_equal, make_batch, state_tensors
from together_train import errors

LORA = tt.LoraConfig(rank=4, alpha=8.0, seed=3, dropout=0.1)
OTHER = tt.LoraConfig(rank=4, alpha=8.0, seed=9)
ARGS = ["--session-memory-mb", "0.25", "--page-out-idle", "0", "--trainer-threads", "1"]
T = 120


def _launch(model_dir, storage, log, env=None, **kw):
    return tt.launch_local(model=str(model_dir), generators=0, storage_dir=storage, extra_args=ARGS,
                           log_file=log, env=env, **kw)


def _metric(client, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(client.http_url + "/metrics", timeout=30).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _lp(session, probe):
    return session.forward(probe, loss_fn="cross_entropy", return_logprobs=True).result(timeout=T).logprobs


def _fb(session, batch):
    return session.forward_backward(batch, loss_fn="cross_entropy").result(timeout=T).loss


def _page(storage: Path, s) -> Path:
    return storage / "pages" / f"{s.session_id}.page"


def _trained_once(client):
    """A fresh session after one step: (session, probe batch, its logprobs on the probe)."""
    vocab = client.get_capabilities().vocab_size
    probe = make_batch(500, vocab)
    s = client.create_session(lora=LORA)
    _fb(s, make_batch(1, vocab))
    s.optim_step(ADAM).result(timeout=T)
    return s, probe, _lp(s, probe)


def test_paged_session_continues_bit_exactly_like_its_twin(tiny_model_dir, tmp_path):
    storage, log = tmp_path / "storage", tmp_path / "server.log"
    with _launch(tiny_model_dir, storage, log) as client:
        vocab = client.get_capabilities().vocab_size
        probe = make_batch(500, vocab)
        o = client.create_session(lora=OTHER)
        b = client.create_session(lora=LORA)        # the one paged out and back
        a = client.create_session(lora=LORA)        # its twin: touched before every page-in, never leaves
        assert _page(storage, o).is_file() and not _page(storage, a).exists()
        losses = {"a": [], "b": []}
        for i in range(3):
            batch = make_batch(100 + i, vocab)
            losses["a"].append(_fb(a, batch))
            losses["b"].append(_fb(b, batch))        # b in, o out
            _lp(a, probe)
            _lp(o, probe)                            # o in, b out: with its gradient accumulated
            a.optim_step(ADAM).result(timeout=T)
            _lp(a, probe)
            b.optim_step(ADAM).result(timeout=T)     # b in, o out
            _lp(a, probe)
            _lp(o, probe)                            # o in, b out
            assert _page(storage, b).is_file()
        assert losses["a"] == losses["b"], losses
        _lp(a, probe)
        lp_b = _lp(b, probe)                          # b in, o out
        lp_a = _lp(a, probe)
        for x, y in zip(lp_a, lp_b):
            assert np.array_equal(x, y), (x, y)
        st_a, st_b = a.save_state("twin").result(timeout=T), b.save_state("twin").result(timeout=T)
        assert_bit_equal(state_tensors(st_a.path), state_tensors(st_b.path))
        assert a.info().step == b.info().step == 3
        assert not _page(storage, a).exists(), "the twin was paged out: the test proves nothing"
        assert f"paged out session {b.session_id}" in log.read_text()

        # A page that fails its checksum: DATA_LOSS naming the session, every time (never a fresh adapter).
        _lp(a, probe)
        _lp(o, probe)                                 # b out again
        page = _page(storage, b)
        raw = bytearray(page.read_bytes())
        raw[-3] ^= 0x55
        page.write_bytes(bytes(raw))
        for _ in range(2):
            with pytest.raises(errors.InternalError, match=f"session {b.session_id}.*checksum") as err:
                _lp(b, probe)
            assert err.value.code == "DATA_LOSS", err.value
        b.stop()
        assert not page.exists()
        assert np.array_equal(_lp(a, probe)[0], lp_a[0])


def test_failed_page_out_keeps_the_session_resident(tiny_model_dir, tmp_path):
    storage, log = tmp_path / "storage", tmp_path / "server.log"
    env = {"TOGETHER_TRAIN_TEST_PAGE_FAULTS": "enospc:1"}
    with _launch(tiny_model_dir, storage, log, env, http_port=0) as client:
        vocab = client.get_capabilities().vocab_size
        x = client.create_session(lora=LORA)
        y = client.create_session(lora=LORA)
        z = client.create_session(lora=OTHER)       # x's page-out fails: x stays, y goes instead
        text = log.read_text()
        assert f"could not page out session {x.session_id}" in text and "No space left on device" in text
        assert not _page(storage, x).exists() and _page(storage, y).is_file()
        assert not list((storage / "pages").glob("*.tmp-*"))
        assert _metric(client, "together_train_page_errors_total") == 1      # the operator sees it
        assert _metric(client, 'together_train_sessions_paging{state="paged_out"}') == 1
        batch = make_batch(7, vocab)
        assert _fb(x, batch) == _fb(y, batch)         # x kept its state; y came back whole
        x.optim_step(ADAM).result(timeout=T)
        y.optim_step(ADAM).result(timeout=T)
        assert x.info().step == y.info().step == 1
        z.stop()


def test_kill_9_during_a_page_out_keeps_the_previous_page(tiny_model_dir, tmp_path):
    from together_train_server.engines.session_pages import read_page

    storage, log = tmp_path / "storage", tmp_path / "server.log"
    env = {"TOGETHER_TRAIN_TEST_PAGE_FAULTS": "stall:120,stall_from:3"}
    with _launch(tiny_model_dir, storage, log, env) as client:
        vocab = client.get_capabilities().vocab_size
        probe = make_batch(500, vocab)
        y = client.create_session(lora=OTHER)
        x = client.create_session(lora=LORA)
        _fb(x, make_batch(1, vocab))
        x.optim_step(ADAM).result(timeout=T)        # step 1, acknowledged
        _lp(y, probe)
        z = client.create_session(lora=OTHER)       # write 1: x out at step 1
        assert read_page(_page(storage, x), x.session_id)[1]["step"] == 1
        _fb(x, make_batch(2, vocab))                 # x in, y out (write 2)
        x.optim_step(ADAM).result(timeout=T)        # step 2, acknowledged
        _lp(z, probe)
        pending = y.forward(probe, loss_fn="cross_entropy")   # y in, x out: write 3 stalls
        deadline = time.monotonic() + 60
        while "PAGE-WRITE-STALL" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        pid = client.local_resource.process.pid
        os.kill(pid, signal.SIGKILL)
        client.local_resource.process.wait(timeout=30)
        del pending
    tensors, meta = read_page(_page(storage, x), x.session_id)   # the previous page, whole
    assert meta["step"] == 1 and meta["adapter_id"] == x.session_id
    assert list((storage / "pages").glob("*.tmp-*")), "the kill did not land inside the page write"
    with _launch(tiny_model_dir, storage, log) as client:
        assert client.get_capabilities().vocab_size == vocab
        assert not list((storage / "pages").glob("*.tmp-*"))


def test_idle_discard_writes_a_checkpoint_to_resume_from(tiny_model_dir, tmp_path):
    """``--idle-timeout 3``: the idle session expires only after a training checkpoint its owner lists and
    resumes from (same step, same logprobs bit for bit); without the flag nothing is discarded."""
    with tt.launch_local(model=str(tiny_model_dir), generators=0, storage_dir=tmp_path / "storage",
                         extra_args=["--idle-timeout", "3", "--trainer-threads", "1"],
                         client_kwargs={"keepalive_interval_s": None}) as client:
        s, probe, before = _trained_once(client)
        deadline = time.monotonic() + 60
        while client.get_session(s.session_id).state != "expired":
            assert time.monotonic() < deadline
            time.sleep(0.3)
        (ckpt,) = client.list_checkpoints(session_id=s.session_id, kind="state")
        assert ckpt.name.startswith("idle-1-"), ckpt
        resumed = client.create_session(checkpoint_uri=ckpt.uri, with_optimizer=True)
        assert resumed.info().step == 1
        for x, y in zip(before, _lp(resumed, probe)):
            assert np.array_equal(x, y)


def test_idle_page_out_while_the_client_heartbeats(tiny_model_dir, tmp_path):
    """``--page-out-idle 2`` with the SDK heartbeating every 0.2 s: the session no operation used for 2 s is
    paged out all the same (heartbeats keep it from being discarded, not resident), stays ACTIVE, and its
    next call pages it back in with the logprobs it had before, bit for bit."""
    storage, log = tmp_path / "storage", tmp_path / "server.log"
    with tt.launch_local(model=str(tiny_model_dir), generators=0, storage_dir=storage, log_file=log, http_port=0,
                         extra_args=["--page-out-idle", "2", "--trainer-threads", "1"],
                         client_kwargs={"keepalive_interval_s": 0.2}) as client:
        s, probe, before = _trained_once(client)
        last_op = s.info().last_active_at
        deadline = time.monotonic() + 60
        while _metric(client, "together_train_page_outs_total") < 1:
            assert time.monotonic() < deadline, "never paged out while heartbeating: " + log.read_text()[-2000:]
            time.sleep(0.3)
        assert f"paged out session {s.session_id}" in log.read_text()
        assert _page(storage, s).is_file()
        info = s.info()
        assert info.state == "active" and info.last_active_at > last_op + 1.0, (info, last_op)  # heartbeats came
        assert _metric(client, 'together_train_sessions_paging{state="paged_out"}') == 1
        after = _lp(s, probe)                          # paged back in
        assert _metric(client, "together_train_page_ins_total") == 1
        for x, y in zip(before, after):
            assert np.array_equal(x, y), (x, y)
