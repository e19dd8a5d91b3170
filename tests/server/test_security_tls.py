"""Server TLS end to end: `serve --tls-cert/--tls-key/--tls-client-ca` and the SDK.

Certificates are made in the test with `cryptography` (a CA, a server
certificate for 127.0.0.1, a client certificate). A real resource with mutual
TLS and an API key serves create_session + forward_backward + optim_step +
sample to the SDK presenting its client certificate; a plaintext client, a
TLS client without a certificate, one with a certificate from another CA,
and one that does not trust the server's CA are all refused. The plaintext
warning appears when API keys are served in plaintext on a non-loopback bind.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from _tls_helpers import make_ca, make_leaf

import together_train as tt
from together_train._proto import resource_pb2, resource_pb2_grpc

WARNING = "API keys are enabled but"


def _caps(channel: grpc.Channel, key: str = "k-tls") -> resource_pb2.GetCapabilitiesResponse:
    return resource_pb2_grpc.ResourceServiceStub(channel).GetCapabilities(
        resource_pb2.GetCapabilitiesRequest(), timeout=20, metadata=(("authorization", f"Bearer {key}"),)
    )


@pytest.mark.timeout(300)
def test_mutual_tls_end_to_end_and_refusals(tiny_model_dir, tmp_path):
    ca, ca_cert, ca_key = make_ca(tmp_path)
    server = make_leaf(tmp_path, "server", ca_cert, ca_key, server=True)
    client_cert = make_leaf(tmp_path, "client", ca_cert, ca_key, server=False)
    other_ca, other_cert, other_key = make_ca(tmp_path, cn="other CA")
    stranger = make_leaf(tmp_path, "stranger", other_cert, other_key, server=False)

    tls_args = ["--tls-cert", str(server.cert_path), "--tls-key", str(server.key_path),
                "--tls-client-ca", str(ca.cert_path), "--trainer-threads", "1", "--generator-threads", "1"]
    sdk_tls = {"root_certificates": ca.cert, "certificate_chain": client_cert.cert, "private_key": client_cert.key}
    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=tmp_path / "storage", api_key="k-tls",
                         extra_args=tls_args, client_kwargs=sdk_tls) as client:
        session = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
        toks = np.arange(1, 20)
        batch = [tt.Sample(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": np.ones(18, np.float32)})]
        out = session.forward_backward(batch, "cross_entropy").result(timeout=120)
        assert np.isfinite(out.loss)
        session.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
        assert session.weights_sync().result(timeout=120).policy_version == 1
        result = session.sample([5, 6, 7], tt.SamplingParams(max_tokens=8, seed=1, ignore_eos=True)).result(timeout=60)
        assert result.policy_version == 1 and len(result.sequences[0].tokens) == 8
        address = client.address

        # The same credentials on a raw channel answer (the refusals below are about the credentials).
        creds = grpc.ssl_channel_credentials(ca.cert, client_cert.key, client_cert.cert)
        with grpc.secure_channel(address, creds) as ch:
            assert _caps(ch).model_id
            with pytest.raises(grpc.RpcError) as err:
                _caps(ch, key="wrong-key")  # TLS does not replace the API key
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

        refused = {
            "plaintext": grpc.insecure_channel(address),
            "TLS without a client certificate": grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.cert)),
            "client certificate from another CA": grpc.secure_channel(
                address, grpc.ssl_channel_credentials(ca.cert, stranger.key, stranger.cert)),
            "server CA not trusted": grpc.secure_channel(
                address, grpc.ssl_channel_credentials(other_ca.cert, client_cert.key, client_cert.cert)),
        }
        for what, ch in refused.items():
            with ch, pytest.raises(grpc.RpcError) as err:
                _caps(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (what, err.value)

        # The SDK without a client certificate is refused too (no retries: the handshake fails every time).
        with tt.ResourceClient(address, api_key="k-tls", root_certificates=ca.cert, timeout=10,
                               retry=tt.RetryPolicy(max_attempts=1)) as bare:
            with pytest.raises(tt.TogetherTrainError) as err:
                bare.get_capabilities()
            assert err.value.code == "UNAVAILABLE", err.value
        session.stop()
        log = client.local_resource.log_tail()
    assert WARNING not in log  # TLS on loopback: no plaintext warning


def test_sdk_refuses_half_a_client_certificate(tmp_path):
    ca, ca_cert, ca_key = make_ca(tmp_path)
    client_cert = make_leaf(tmp_path, "client", ca_cert, ca_key, server=False)
    with pytest.raises(tt.InvalidArgumentError, match="certificate_chain and private_key go together"):
        tt.ResourceClient("127.0.0.1:1", certificate_chain=client_cert.cert)


def test_server_flags_refuse_bad_tls_files(tiny_model_dir, tmp_path):
    """A key without a certificate, or a file that is not PEM, stops `serve` with one line naming the flag."""
    cli = [sys.executable, "-m", "together_train_server.cli", "serve", "--model", str(tiny_model_dir),
           "--generators", "0", "--port", "0"]
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello")
    for extra, words in (
        (["--tls-key", str(not_pem)], "--tls-cert and --tls-key go together"),
        (["--tls-cert", str(not_pem), "--tls-key", str(not_pem)], f"{not_pem}: not a PEM file"),
        (["--tls-client-ca", str(not_pem)], "--tls-client-ca needs --tls-cert"),
    ):
        run = subprocess.run([*cli, *extra], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and words in run.stderr, (extra, run.stderr)


def test_plaintext_api_keys_on_a_public_bind_warn(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "together_train_server.cli", "serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0",
         "--port", "0", "--port-file", str(port_file), "--generators", "0", "--api-key-file", str(keys),
         "--storage", str(tmp_path / "s"), "--trainer-threads", "1"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert port_file.exists(), "serve did not start"
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    (line,) = [ln for ln in stderr.splitlines() if WARNING in ln]
    assert "WARNING" in line and "0.0.0.0" in line and "--tls-cert" in line, line


def test_http_port_speaks_the_same_tls(tiny_model_dir, tmp_path):
    """`--http-port` with `--tls-cert/--tls-key/--tls-client-ca`: HTTPS with mutual TLS, plain HTTP refused."""
    import ssl

    import httpx

    ca, ca_cert, ca_key = make_ca(tmp_path)
    server = make_leaf(tmp_path, "server", ca_cert, ca_key, server=True)
    client_cert = make_leaf(tmp_path, "client", ca_cert, ca_key, server=False)
    tls_args = ["--tls-cert", str(server.cert_path), "--tls-key", str(server.key_path),
                "--tls-client-ca", str(ca.cert_path), "--trainer-threads", "1"]
    sdk_tls = {"root_certificates": ca.cert, "certificate_chain": client_cert.cert, "private_key": client_cert.key}
    with tt.launch_local(model=str(tiny_model_dir), generators=0, storage_dir=tmp_path / "storage", api_key="k-tls",
                         extra_args=tls_args, client_kwargs=sdk_tls, http_port=0) as client:
        url = f"https://127.0.0.1:{client.local_resource.http_port}/api/v1/healthz"
        ctx = ssl.create_default_context(cafile=str(ca.cert_path))
        ctx.load_cert_chain(str(client_cert.cert_path), str(client_cert.key_path))
        r = httpx.get(url, verify=ctx, timeout=30)
        assert r.status_code == 200, r.text
        bare = ssl.create_default_context(cafile=str(ca.cert_path))   # trusts the server, shows no certificate
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(url, verify=bare, timeout=30).raise_for_status()
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(url.replace("https://", "http://"), timeout=30)
