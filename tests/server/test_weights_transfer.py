"""Weights pushes at transport speed, against real replica processes.

1. One replica process, the real GrpcReplicaClient: a push through shared
   memory (memfd segment, same host) and one by gRPC stream leave the replica
   scoring exactly alike (ComputeLogprobs equal) and equal to a push of the
   float32 tensors rounded to the replica's dtype; a bf16 replica is sent 2
   bytes per value, a float32 one 4. A stream whose trailer does not match is
   DATA_LOSS and leaves the version served; a segment handle that is not one
   (a path, an fd this replica cannot open) is refused (INVALID_ARGUMENT /
   FAILED_PRECONDITION "cannot open shared-memory segment", which makes the
   client stream from then on). Nothing appears in /dev/shm; after
   `close()` the client holds no segment.
2. A resource with 2 spawned replicas: weights_sync goes through shared
   memory; a replica killed (SIGKILL) is restarted and re-pushed, the resource
   then holds at most 2 segments per live replica (the dead client's are
   closed), and /dev/shm gains nothing through syncs, the kill, and shutdown.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

import together_train as tt
from together_train._proto import common_pb2, generator_pb2
from together_train_server.engines.types import LoraConfig
from together_train_server.wire import weights as wt
from together_train_server.wire.replica_client import GrpcReplicaClient

SPEC = LoraConfig(rank=4, alpha=8.0, seed=0)
SEQ = [1, 5, 9, 2, 7, 3, 8]


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def segments_held(pid: int) -> int:
    """memfd weights segments process `pid` holds open (distinct files whose link is /memfd:tt-weights)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:tt-weights"):
                inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    return len(inodes)


def start_replica(tiny_model_dir: Path, tmp_path: Path, dtype: str) -> tuple[subprocess.Popen, GrpcReplicaClient, str]:
    secret = secrets.token_hex(16)
    sf = tmp_path / f"secret-{dtype}"
    sf.write_text(secret)
    sf.chmod(0o600)
    pf = tmp_path / f"port-{dtype}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "together_train_server.cli", "generator", "--model", str(tiny_model_dir),
         "--host", "127.0.0.1", "--port", "0", "--port-file", str(pf), "--threads", "1", "--dtype", dtype,
         "--replica-id", f"r-{dtype}", "--replica-secret-file", str(sf)],
        env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    deadline = time.monotonic() + 180
    while not pf.exists() or not pf.read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, "generator did not start"
        time.sleep(0.2)
    client = GrpcReplicaClient(f"127.0.0.1:{pf.read_text().strip()}", f"r-{dtype}", secret=secret, same_host=True)
    client.wait_ready(60)
    return proc, client, secret


def adapter(tiny_model_dir: Path, scale: float) -> dict[str, torch.Tensor]:
    """A rank-4 adapter for the tiny model (peft keys, float32, B non-zero so it changes the logprobs)."""
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    eng = TorchTrainerEngine(tiny_model_dir)
    eng.create_adapter("a", SPEC)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in eng.trainable_parameters("a").values():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return eng.adapter_tensors("a")


def logprobs(client: GrpcReplicaClient, key: str) -> tuple[np.ndarray, int]:
    r = client.compute_logprobs(key, [SEQ])
    return np.asarray(r.logprobs[0]), r.policy_version


def push_corrupt(client: GrpcReplicaClient, tensors: dict[str, torch.Tensor], dtype: str, key: str,
                 version: int) -> None:
    """Stream `tensors` to `key` with a trailer that does not match the bytes: the replica says DATA_LOSS."""
    header = generator_pb2.PushWeightsHeader(session_id=key, policy_version=version,
                                             tensors=wt.layout(tensors, dtype)[0],
                                             lora=common_pb2.LoraConfig(rank=4, alpha=8.0, seed=0))
    frames = [generator_pb2.PushWeightsChunk(header=header).SerializeToString(),
              *wt.chunk_frames(wt.pack(tensors, dtype).data, 1 << 12),
              generator_pb2.PushWeightsChunk(trailer_xxh3_128="0" * 32).SerializeToString()]
    with pytest.raises(grpc.RpcError) as err:
        client._push_frames(iter(frames), timeout=30, metadata=client._metadata)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS, err.value.details()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_shared_memory_and_stream_pushes_agree(tiny_model_dir, tmp_path, dtype):
    before = shm_entries()
    tensors = adapter(tiny_model_dir, 0.05)
    values = sum(t.numel() for t in tensors.values())
    proc, client, secret = start_replica(tiny_model_dir, tmp_path, dtype)
    try:
        assert client.wire_mode() == (dtype, True)
        assert client.push("shm", 1, SPEC, tensors) == values * (2 if dtype == "bfloat16" else 4)
        assert segments_held(os.getpid()) == 1  # kept for the next push
        streamed = GrpcReplicaClient(client.address, "r-stream", secret=secret, same_host=False)
        assert streamed.wire_mode() == (dtype, False)
        assert streamed.push("stream", 1, SPEC, tensors) == values * (2 if dtype == "bfloat16" else 4)
        # The reference: the float32 tensors rounded to the replica's dtype, streamed as float32.
        rounded = {k: v.to(getattr(torch, dtype)).float() for k, v in tensors.items()}
        streamed._wire = ("float32", False)
        assert streamed.push("rounded", 1, SPEC, rounded) == values * 4
        lp_shm, v_shm = logprobs(client, "shm")
        lp_stream, _ = logprobs(client, "stream")
        lp_ref, _ = logprobs(client, "rounded")
        assert v_shm == 1
        np.testing.assert_array_equal(lp_shm, lp_stream)
        np.testing.assert_array_equal(lp_shm, lp_ref)
        # A second push through the same (reused) segment replaces the adapter.
        other = adapter(tiny_model_dir, 0.2)
        client.push("shm", 2, SPEC, other)
        client.push("rounded", 2, SPEC, other)
        lp2, v2 = logprobs(client, "shm")
        assert v2 == 2 and not np.array_equal(lp2, lp_shm)
        np.testing.assert_array_equal(lp2, logprobs(client, "rounded")[0])

        # A stream whose trailer does not match its bytes: DATA_LOSS, version 2 still served.
        meta, nbytes = wt.layout(other, dtype)
        packed = wt.pack(other, dtype)
        push_corrupt(client, other, dtype, "shm", 3)
        lp3, v3 = logprobs(client, "shm")
        assert v3 == 2
        np.testing.assert_array_equal(lp3, lp2)

        # Segment handles that are not a weights segment of a process this replica can open.
        for name, code, text in [("/etc/passwd", grpc.StatusCode.INVALID_ARGUMENT, "not /proc/<pid>/fd/<fd>"),
                                 (f"/proc/{os.getpid()}/fd/987654", grpc.StatusCode.FAILED_PRECONDITION,
                                  "cannot open shared-memory segment"),
                                 (f"/proc/{os.getpid()}/fd/0", grpc.StatusCode.INVALID_ARGUMENT,
                                  "is not a weights segment")]:
            h = generator_pb2.PushWeightsHeader(session_id="shm", policy_version=4, tensors=meta,
                                                segment=generator_pb2.SharedSegment(name=name, size=nbytes),
                                                lora=common_pb2.LoraConfig(rank=4, alpha=8.0, seed=0))
            frames = [generator_pb2.PushWeightsChunk(header=h).SerializeToString(),
                      generator_pb2.PushWeightsChunk(trailer_xxh3_128=wt.checksum(packed.data.numpy())).SerializeToString()]
            with pytest.raises(grpc.RpcError) as err:
                client._push_frames(iter(frames), timeout=30, metadata=client._metadata)
            assert err.value.code() == code and text in err.value.details(), (name, err.value.details())
        assert logprobs(client, "shm")[1] == 2
        assert shm_entries() <= before, shm_entries() - before
        streamed.close()
        client.close()
        assert segments_held(os.getpid()) == 0
    finally:
        proc.kill()
        proc.wait()


def test_receive_buffers_are_one_pushers_at_a_time_and_bounded():
    metas = wt.layout({"x": torch.zeros(4, 8), "y": torch.zeros(8, 4)}, "bfloat16")[0]
    bufs = wt.ReceiveBuffers(keep=2, max_bytes=1 << 20)
    a, views = bufs.take(metas)
    assert views is None and a.numel() == 2 * 64 and a.dtype == torch.uint8
    b, _ = bufs.take(metas)
    assert b.data_ptr() != a.data_ptr()  # two pushes at once: two buffers
    va = wt.unpack(metas, a)
    bufs.give(metas, a, va)
    got, got_views = bufs.take(metas)
    assert got is a and got_views is va
    assert bufs.take(metas)[1] is None  # taken: not handed out twice
    other = wt.layout({"x": torch.zeros(4, 9)}, "bfloat16")[0]
    assert bufs.take(other)[1] is None  # another layout never gets these views
    for _ in range(3):
        d, _ = bufs.take(metas)
        bufs.give(metas, d, wt.unpack(metas, d))
    assert len(bufs._kept) <= 2
    big = wt.layout({"x": torch.zeros(1024, 1024)}, "float32")[0]  # 4 MiB > max_bytes: not kept
    d, _ = bufs.take(big)
    bufs.give(big, d, wt.unpack(big, d))
    assert all(k[1] is not d for k in bufs._kept)
    with pytest.raises(ValueError):
        bufs.take([generator_pb2.TensorMeta(name="z", dtype=common_pb2.BFLOAT16, shape=[-1])])


def test_data_chunks_are_read_without_a_copy_and_everything_else_by_protobuf():
    from google.protobuf.message import DecodeError

    data = torch.arange(3 * 4096 + 5, dtype=torch.int64).to(torch.uint8)
    frames = list(wt.chunk_frames(data, 4096))
    got = [wt.parse_chunk(f) for f in frames]
    assert [type(c) for c in got] == [wt.DataChunk] * 4 and all(c.WhichOneof("part") == "data" for c in got)
    assert b"".join(bytes(c.data) for c in got) == bytes(data.numpy())
    assert all(c.data.obj is f for c, f in zip(got, frames))  # a view of the received message, not a copy
    # The same bytes as protobuf frames them, an empty chunk, and whatever chunk_frames does not write.
    assert bytes(wt.parse_chunk(generator_pb2.PushWeightsChunk(data=b"abc").SerializeToString()).data) == b"abc"
    assert bytes(wt.parse_chunk(generator_pb2.PushWeightsChunk(data=b"").SerializeToString()).data) == b""
    header = generator_pb2.PushWeightsChunk(header=generator_pb2.PushWeightsHeader(session_id="s", policy_version=3))
    trailer = generator_pb2.PushWeightsChunk(trailer_xxh3_128="ab" * 16)
    for msg in (header, trailer):
        parsed = wt.parse_chunk(msg.SerializeToString())
        assert isinstance(parsed, generator_pb2.PushWeightsChunk) and parsed == msg
    # Data then another field: protobuf's oneof keeps the last one, so does parse_chunk.
    both = generator_pb2.PushWeightsChunk(data=b"xyz").SerializeToString() + trailer.SerializeToString()
    assert wt.parse_chunk(both).WhichOneof("part") == "trailer_xxh3_128"
    for bad in (b"\x12\x05ab", b"\x12\xff"):  # a length past the end; a varint cut short
        with pytest.raises(DecodeError):
            wt.parse_chunk(bad)
    # The length 3 in k varint bytes: protobuf reads at most 5, and so does parse_chunk.
    for k in range(1, 11):
        frame = b"\x12" + (b"\x03" if k == 1 else b"\x83" + b"\x80" * (k - 2) + b"\x00") + b"abc"
        if k <= 5:
            assert bytes(generator_pb2.PushWeightsChunk.FromString(frame).data) == b"abc"
            assert bytes(wt.parse_chunk(frame).data) == b"abc", k
        else:
            for parse in (generator_pb2.PushWeightsChunk.FromString, wt.parse_chunk):
                with pytest.raises(DecodeError):
                    parse(frame)


def test_unpacked_pushes_of_one_dtype_are_one_flat_buffer():
    from together_train_server.engines.generator_base import flat_in_order
    from together_train_server.engines.lora import FlatTensors

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(2, 7)}
    packed = wt.pack(tensors, "bfloat16")
    got = wt.unpack(packed.metas, packed.data.clone())
    assert isinstance(got, FlatTensors) and list(got) == ["a", "b"]
    for k, t in tensors.items():
        assert torch.equal(got[k], t.to(torch.bfloat16)), k
    assert flat_in_order(got, ["a", "b"]) is got.flat and flat_in_order(got, ["b", "a"]) is None
    metas = wt.layout(got, "bfloat16")[0]
    assert isinstance(metas, tuple) and wt.layout(got, "bfloat16")[0] is metas  # built once, shared read-only
    mixed = [*packed.metas[:1], generator_pb2.TensorMeta(name="c", dtype=common_pb2.FLOAT32, shape=[2])]
    raw = torch.cat([packed.data[:30], torch.tensor([1.5, -2.0]).view(torch.uint8)])
    out = wt.unpack(mixed, raw)  # the float32 tensor starts at byte 30: not a view, a copy
    assert not isinstance(out, FlatTensors) and list(out) == ["a", "c"]
    assert torch.equal(out["c"], torch.tensor([1.5, -2.0])) and torch.equal(out["a"], tensors["a"].to(torch.bfloat16))


@pytest.mark.timeout(600)
def test_streamed_pushes_reusing_a_buffer_never_mix_adapters(tiny_model_dir, tmp_path):
    """Two sessions of one layout share the replica's receive buffer; each serves its own weights,
    also after a corrupt push went through that buffer and after a push of another layout."""
    first, second = adapter(tiny_model_dir, 0.05), adapter(tiny_model_dir, 0.2)
    proc, client, secret = start_replica(tiny_model_dir, tmp_path, "bfloat16")
    try:
        streamed = GrpcReplicaClient(client.address, "r-stream", secret=secret, same_host=False)
        client.push("ref1", 1, SPEC, first)   # references through shared memory (no receive buffer)
        client.push("ref2", 1, SPEC, second)
        ref1, ref2 = logprobs(client, "ref1")[0], logprobs(client, "ref2")[0]
        assert not np.array_equal(ref1, ref2)
        streamed.push("a", 1, SPEC, first)
        streamed.push("b", 1, SPEC, second)  # lands in the buffer "a" came through
        np.testing.assert_array_equal(logprobs(client, "a")[0], ref1)
        np.testing.assert_array_equal(logprobs(client, "b")[0], ref2)
        push_corrupt(streamed, second, "bfloat16", "a", 2)
        np.testing.assert_array_equal(logprobs(client, "a")[0], ref1)  # the corrupt bytes were never loaded
        wide = LoraConfig(rank=8, alpha=16.0, seed=0)
        from together_train_server.engines.torch_trainer import TorchTrainerEngine

        eng = TorchTrainerEngine(tiny_model_dir)
        eng.create_adapter("w", wide)
        streamed.push("w", 1, wide, eng.adapter_tensors("w"))
        streamed.push("a", 3, SPEC, second)
        streamed.push("b", 2, SPEC, first)
        np.testing.assert_array_equal(logprobs(client, "a")[0], ref2)
        np.testing.assert_array_equal(logprobs(client, "b")[0], ref1)
        streamed.close()
        client.close()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(600)
def test_sync_through_shared_memory_survives_a_killed_replica_without_leaks(tiny_model_dir, tmp_path):
    from test_e2e_replicas import replica_health

    before = shm_entries()
    # A sync waits for every live replica here (--replica-sync-s 60): this test is about segments surviving a
    # killed replica, not about leaving a slow one behind (tests/server/test_e2e_stuck_replica_sync.py checks that).
    flags = ["--replica-probe-period-s", "0.5", "--replica-probe-timeout-s", "2", "--replica-probe-misses", "2",
             "--trainer-threads", "1", "--generator-threads", "1", "--replica-sync-s", "60"]
    with tt.launch_local(model=str(tiny_model_dir), generators=2, storage_dir=tmp_path, extra_args=flags) as client:
        server = client.local_resource.process.pid
        s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
        toks = np.arange(1, 20)
        sample = tt.Sample(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:],
                                                                  "weights": np.ones(18, np.float32)})

        def step_and_sync(step: int) -> None:
            s.forward_backward([sample], "cross_entropy").result(timeout=120)
            s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
            r = s.weights_sync().result(timeout=120)
            assert (r.policy_version, r.num_replicas) == (step, 2)

        step_and_sync(1)
        step_and_sync(2)
        replicas = children(server)
        assert len(replicas) == 2 and 1 <= segments_held(server) <= 4, (replicas, segments_held(server))
        os.kill(replicas[0], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:  # restarted, and the adapter re-pushed to it (through a new client's segment)
            assert time.monotonic() < deadline, f"replica not restarted with v2: {children(server)}"
            now = children(server)
            try:
                if replicas[0] not in now and len(now) == 2 and all(
                        replica_health(pid)().loaded_versions.get(s.session_id) == 2 for pid in now):
                    break
            except (grpc.RpcError, OSError, ValueError):
                pass  # still starting
            time.sleep(0.5)
        step_and_sync(3)
        assert [replica_health(pid)().loaded_versions[s.session_id] for pid in children(server)] == [3, 3]
        assert segments_held(server) <= 4, segments_held(server)  # the dead replica's client closed its own
        assert shm_entries() <= before, shm_entries() - before
    assert shm_entries() <= before, shm_entries() - before


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]
