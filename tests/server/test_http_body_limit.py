"""The HTTP port refuses bodies larger than any valid request (413) before reading them into memory.

The limit is ``JSON_BODY_FACTOR`` x the gRPC receive limit (``Resource.max_request_bytes``):
a declared Content-Length over it is answered without reading the body, a chunked body is
refused as soon as it passes the limit. The server's RSS stays within 10 %.
"""

from __future__ import annotations

import time

import httpx
import numpy as np

import together_train as tt
from together_train_server.wire.http.app import JSON_BODY_FACTOR


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_oversized_bodies_get_413_and_memory_stays(tiny_model_dir, tmp_path):
    with tt.launch_local(model=str(tiny_model_dir), generators=0, storage_dir=tmp_path / "storage", api_key="k",
                         http_port=0, extra_args=["--trainer-threads", "1"]) as client:
        session = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
        base = f"http://127.0.0.1:{client.local_resource.http_port}"
        headers = {"X-API-Key": "tml-k", "Content-Type": "application/json"}
        pid = client.local_resource.process.pid
        rss0 = _rss(pid)
        huge = b"[" + b"1," * (100 << 20) + b"1]"    # 200 MB of token ids
        t0 = time.time()
        r = httpx.post(f"{base}/api/v1/forward_backward", content=huge, headers=headers, timeout=120)
        assert r.status_code == 413, (r.status_code, r.text[:300])
        assert "larger than this server's limit" in r.text and "--max-tokens-per-batch" in r.text, r.text
        limit = int(r.text.split("limit of ")[1].split()[0])
        # 4 x the gRPC receive limit of the default limits (~5.9 MB): tens of MB, not hundreds.
        assert limit < 64 << 20, limit

        def chunks():
            for _ in range(200):
                yield b"1," * (1 << 19)              # 1 MiB at a time, no Content-Length
        r2 = httpx.post(f"{base}/api/v1/forward_backward", content=chunks(), headers=headers, timeout=120)
        assert r2.status_code == 413, (r2.status_code, r2.text[:300])
        elapsed = time.time() - t0
        rss1 = _rss(pid)
        print(f"413 x2 in {elapsed:.2f} s; server RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB; limit {limit}")
        assert rss1 <= rss0 * 1.10, (rss0, rss1)
        # A body under the limit still reaches the route (and the session works, untouched).
        ok = httpx.post(f"{base}/api/v1/healthz", content=b"", headers=headers, timeout=30)
        assert ok.status_code in (200, 405), ok.text
        toks = np.arange(1, 12)
        out = session.forward_backward([tt.Sample(model_input=toks[:-1], loss_fn_inputs={
            "target_tokens": toks[1:], "weights": np.ones(10, np.float32)})], "cross_entropy").result(timeout=120)
        assert np.isfinite(out.loss) and session.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=60).step == 1
        assert JSON_BODY_FACTOR == 4
