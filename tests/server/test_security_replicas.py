"""Generator replicas answer only their resource (docs/design.md §10).

A real resource (`launch_local`) spawns a real replica process on loopback.
An outside client that connects to the replica's port directly, with no
secret or a wrong one, is refused UNAUTHENTICATED on each GeneratorService
call: Health (would list session ids), ComputeLogprobs with another user's
session (would score with their private adapter), PushWeights with
policy_version=10**9 (would replace their adapter) and DropWeights (would
make their samples fail). The owner's samples are unchanged afterwards. The
same calls carrying the resource's secret do what the attack wanted, so the
refusal (not a malformed request) is what protected the session.

A replica started by hand (`together-train generator --replica-secret-file F
--tls-cert ... --tls-client-ca ...`) and attached with `serve
--generator-address ... --replica-secret-file F --generator-tls-ca ...
--tls-cert ...` serves samples over mutual TLS; a resource with another
secret stops at startup naming the reason.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import together_train as tt
from together_train._proto import common_pb2, generator_pb2, generator_pb2_grpc

THREADS = ["--trainer-threads", "1", "--generator-threads", "1"]
PROMPT = [5, 6, 7]
PARAMS = tt.SamplingParams(max_tokens=16, seed=3, ignore_eos=True)
SECRET_KEY = "together-train-replica-secret"


def _child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _spawned_replica(client: tt.ResourceClient) -> tuple[int, Path]:
    """(port, secret file) of the resource's only replica, read from its command line."""
    (pid,) = _child_pids(client.local_resource.process.pid)
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    port = int(Path(argv[argv.index("--port-file") + 1]).read_text())
    return port, Path(argv[argv.index("--replica-secret-file") + 1])


def _push_chunks(session_id: str, version: int, tensors: dict[str, np.ndarray]):
    """A well-formed PushWeights stream (header, float32 data, sha256 trailer) for a rank-4 adapter."""
    header = generator_pb2.PushWeightsHeader(
        session_id=session_id,
        policy_version=version,
        lora=common_pb2.LoraConfig(rank=4, alpha=8.0, seed=0),
        tensors=[generator_pb2.TensorMeta(name=k, dtype=common_pb2.FLOAT32, shape=list(a.shape)) for k, a in tensors.items()],
    )
    yield generator_pb2.PushWeightsChunk(header=header)
    h = hashlib.sha256()
    for a in tensors.values():
        data = np.ascontiguousarray(a, dtype="<f4").tobytes()
        h.update(data)
        yield generator_pb2.PushWeightsChunk(data=data)
    yield generator_pb2.PushWeightsChunk(trailer_sha256=h.hexdigest())


def _train_and_sync(session: tt.Session) -> None:
    toks = np.arange(1, 30)
    sample = tt.Sample(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": np.ones(28, np.float32)})
    session.forward_backward([sample], "cross_entropy").result(timeout=120)
    session.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
    assert session.weights_sync().result(timeout=120).policy_version == 1


@pytest.mark.timeout(300)
def test_outside_client_cannot_read_hijack_or_drop_a_session(tiny_model_dir, tmp_path):
    from safetensors.numpy import load_file

    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=tmp_path / "storage",
                         api_key="owner-key", extra_args=THREADS) as client:
        owner = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
        _train_and_sync(owner)
        before = owner.sample(PROMPT, PARAMS).result(timeout=60)
        assert before.policy_version == 1
        saved = owner.save_weights("adapter").result(timeout=60)
        # A well-formed adapter with other values: what a hijacker would push.
        hijack = {k: np.full_like(v, 0.05, dtype=np.float32) for k, v in load_file(saved.path / "adapter_model.safetensors").items()}

        port, secret_file = _spawned_replica(client)
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600, oct(secret_file.stat().st_mode)
        secret = secret_file.read_text().strip()
        assert len(secret) >= 32

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)
            calls = {
                "Health": lambda md: stub.Health(generator_pb2.HealthRequest(), timeout=30, metadata=md),
                "ComputeLogprobs": lambda md: stub.ComputeLogprobs(
                    generator_pb2.ComputeLogprobsRequest(session_id=owner.session_id, source=generator_pb2.SESSION,
                                                         sequences=[generator_pb2.TokenSequence(tokens=[1, 2, 3, 4])]),
                    timeout=30, metadata=md),
                "PushWeights": lambda md: stub.PushWeights(_push_chunks(owner.session_id, 10**9, hijack),
                                                           timeout=30, metadata=md),
                "DropWeights": lambda md: stub.DropWeights(
                    generator_pb2.DropWeightsRequest(session_id=owner.session_id), timeout=30, metadata=md),
            }
            outsiders = {
                "no secret": (),
                "wrong secret": ((SECRET_KEY, "x" * len(secret)),),
                "the API key": (("authorization", "Bearer owner-key"),),
                "secret prefix": ((SECRET_KEY, secret[:-1]),),
            }
            for who, md in outsiders.items():
                for name, call in calls.items():
                    with pytest.raises(grpc.RpcError) as err:
                        call(md)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (who, name, err.value)
                    assert "replica" in err.value.details(), (who, name, err.value.details())

            # The standard health service stays open and says only SERVING.
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            assert owner.session_id not in str(answer)

            # The owner's samples did not change: same version, same tokens for the same seed.
            after = owner.sample(PROMPT, PARAMS).result(timeout=60)
            assert after.policy_version == 1
            assert after.sequences[0].tokens == before.sequences[0].tokens

            # The same calls with the resource's secret do what the attacker wanted: the
            # refusals above were the credential check, not malformed requests.
            good = ((SECRET_KEY, secret),)
            assert calls["Health"](good).loaded_versions[owner.session_id] == 1
            assert len(calls["ComputeLogprobs"](good).sequences[0].logprobs) == 3
            calls["PushWeights"](good)
            hijacked = owner.sample(PROMPT, PARAMS).result(timeout=60)
            assert hijacked.policy_version == 10**9
            assert hijacked.sequences[0].tokens != before.sequences[0].tokens
        owner.stop()


def _start_generator(tiny_model_dir: Path, tmp_path: Path, secret_file: Path, extra: list[str]) -> tuple[subprocess.Popen, int]:
    port_file = tmp_path / "generator.port"
    log = open(tmp_path / "generator.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "together_train_server.cli", "generator", "--model", str(tiny_model_dir),
         "--port", "0", "--port-file", str(port_file), "--threads", "1", "--replica-id", "attached-0",
         "--replica-secret-file", str(secret_file), *extra],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not port_file.exists():
        assert proc.poll() is None, (tmp_path / "generator.log").read_text()
        assert time.monotonic() < deadline, "generator did not start"
        time.sleep(0.2)
    return proc, int(port_file.read_text())


def _secret_file(path: Path, secret: str) -> Path:
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return path


@pytest.mark.timeout(400)
def test_attached_replica_with_secret_file_and_mutual_tls(tiny_model_dir, tmp_path):
    """A replica with --replica-secret-file and mutual TLS, attached to a TLS resource presenting its certificate."""
    from _tls_helpers import make_ca, make_leaf

    ca, ca_cert, ca_key = make_ca(tmp_path)
    replica_cert = make_leaf(tmp_path, "replica", ca_cert, ca_key, server=True)
    resource_cert = make_leaf(tmp_path, "resource", ca_cert, ca_key, server=True)  # also its client certificate
    secret = _secret_file(tmp_path / "replica-secret", "s3cret-" + "a" * 40)
    proc, port = _start_generator(tiny_model_dir, tmp_path, secret,
                                  ["--tls-cert", str(replica_cert.cert_path), "--tls-key", str(replica_cert.key_path),
                                   "--tls-client-ca", str(ca.cert_path)])
    try:
        address = f"127.0.0.1:{port}"
        # TLS to the replica is not enough: a client certificate and then the secret are needed too.
        health = generator_pb2.HealthRequest()
        no_cert = grpc.ssl_channel_credentials(ca.cert)
        with_cert = grpc.ssl_channel_credentials(ca.cert, resource_cert.key, resource_cert.cert)
        for creds, code in ((no_cert, grpc.StatusCode.UNAVAILABLE), (with_cert, grpc.StatusCode.UNAUTHENTICATED)):
            with grpc.secure_channel(address, creds) as ch, pytest.raises(grpc.RpcError) as err:
                generator_pb2_grpc.GeneratorServiceStub(ch).Health(health, timeout=20)
            assert err.value.code() == code, err.value

        attach = ["--generator-address", address, "--generator-tls-ca", str(ca.cert_path), "--startup-timeout", "120",
                  "--tls-cert", str(resource_cert.cert_path), "--tls-key", str(resource_cert.key_path), *THREADS]
        sdk_tls = {"root_certificates": ca.cert}  # the resource serves TLS too (no client CA there)
        with tt.launch_local(model=str(tiny_model_dir), generators=0, storage_dir=tmp_path / "storage",
                             extra_args=[*attach, "--replica-secret-file", str(secret)], client_kwargs=sdk_tls) as client:
            session = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
            _train_and_sync(session)
            result = session.sample(PROMPT, PARAMS).result(timeout=60)
            assert result.replica_id == "attached-0" and result.policy_version == 1
            assert len(result.sequences[0].tokens) == 16
            session.stop()

        # Another secret: the resource refuses to start and says why.
        wrong = _secret_file(tmp_path / "wrong-secret", "other-" + "b" * 40)
        with pytest.raises(tt.ServerStartError) as err:
            with tt.launch_local(model=str(tiny_model_dir), generators=0, storage_dir=tmp_path / "storage",
                                 extra_args=[*attach, "--replica-secret-file", str(wrong)], client_kwargs=sdk_tls,
                                 startup_timeout=180):
                pass
        assert f"{address} refused this resource's replica secret" in err.value.log_tail, err.value.log_tail
        assert proc.poll() is None  # the replica is unharmed
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_secret_files_are_checked_before_anything_starts(tiny_model_dir, tmp_path):
    """A group-readable secret file, or --generator-address without a secret file, stops with one clear line."""
    loose = tmp_path / "loose-secret"
    loose.write_text("c" * 40 + "\n")
    loose.chmod(0o644)
    cli = [sys.executable, "-m", "together_train_server.cli"]
    gen = subprocess.run([*cli, "generator", "--model", str(tiny_model_dir), "--replica-secret-file", str(loose)],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 2 and f"chmod 600 {loose}" in gen.stderr, gen.stderr
    missing = subprocess.run([*cli, "generator", "--model", str(tiny_model_dir)], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--replica-secret-file" in missing.stderr, missing.stderr
    serve = subprocess.run([*cli, "serve", "--model", str(tiny_model_dir), "--generators", "0", "--port", "0",
                            "--generator-address", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert serve.returncode != 0 and "--generator-address needs --replica-secret-file" in serve.stderr, serve.stderr


def test_secret_file_contents_are_checked(tmp_path):
    """write_secret_file makes a 0600 file; short, empty or non-ASCII secrets are refused naming the file."""
    from together_train_server.wire.replica_auth import new_secret, read_secret_file, write_secret_file

    secret = new_secret()
    made = write_secret_file(tmp_path / "made", secret)
    assert stat.S_IMODE(made.stat().st_mode) == 0o600 and read_secret_file(made) == secret
    with pytest.raises(FileExistsError):
        write_secret_file(made, secret)  # never overwrites (or follows) an existing path
    for name, text, words in (("empty", "", "at least 16 characters"), ("short", "abc\n", "at least 16 characters"),
                              ("accents", "é" * 20 + "\n", "printable ASCII")):
        path = _secret_file(tmp_path / name, text.rstrip("\n"))
        with pytest.raises(ValueError, match=words) as err:
            read_secret_file(path)
        assert str(path) in str(err.value)
