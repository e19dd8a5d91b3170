"""Small Tinker contract points, with the official tinker SDK against a real resource.

- ``create_lora_training_client(seed=None)`` is random (the SDK documents None as "random
  seed"): two such models start from different LoRA A matrices; one seed twice gives the same.
- ``RestClient.list_sessions`` / ``get_session`` answer with the caller's client sessions, their
  training runs (model ids), samplers, metadata and display name (were a bare 404).
- Top-k prompt logprobs: uncomputed rows are ``None`` in the SDK (the SDK's sentinel, token 0 and
  logprob -99999, not NaN), and ``prompt_logprobs_last_n`` limits the top-k rows like the logprobs.
- `CheckpointInfo.path`: the resource sends only the URI (a raw ListCheckpoints has no path); a
  client that knows the storage directory (`launch_local`) resolves the path, a remote one gets None.
"""

from __future__ import annotations

import math

import grpc
import httpx
import numpy as np
import pytest

import together_train as tt
from _served import launch_with_http

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402

KEY = "k-tinker-gaps"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with launch_with_http(tiny_model_dir, tmp_path_factory.mktemp("gaps"), KEY) as client:
        yield client


@pytest.fixture(scope="module")
def service(served):
    sc = tinker.ServiceClient(base_url=served.http_url, api_key="tml-" + KEY, user_metadata={"run": "gaps"},
                              display_name="gaps run")
    yield sc
    sc.close("success").result()


def _lora_a(served, tc) -> dict[str, np.ndarray]:
    """The LoRA A matrices of a tinker model at step 0, from a save_state on this machine."""
    from safetensors.numpy import load_file

    path = tc.save_state(f"init-{tc.model_id.replace(':', '-')}").result().path  # tinker://<our session>/weights/<name>
    sid, name = path[len("tinker://"):].split("/")[0], path.rsplit("/", 1)[1]
    (ckpt,) = [c for c in served.list_checkpoints(sid) if c.name == name]
    out = {}
    for f in ckpt.path.glob("*.safetensors"):
        out.update({k: v for k, v in load_file(f).items() if "lora_A" in k and not k.startswith("opt::")})
    assert out, list(ckpt.path.iterdir())
    return out


def test_seed_none_is_random_and_a_seed_repeats(served, service, tiny_model_dir):
    base = str(tiny_model_dir)
    a, b = (service.create_lora_training_client(base_model=base, rank=2) for _ in range(2))
    c, d = (service.create_lora_training_client(base_model=base, rank=2, seed=7) for _ in range(2))
    la, lb, lc, ld = (_lora_a(served, m) for m in (a, b, c, d))
    assert any(not np.array_equal(la[k], lb[k]) for k in la), "seed=None gave the same initial adapter twice"
    assert all(np.array_equal(lc[k], ld[k]) for k in lc)


def test_rest_client_sessions(served, service, tiny_model_dir):
    # The model first: the tinker SDK (0.38) deadlocks in create_rest_client while a create is pending.
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=2, seed=0).result()
    rest = service.create_rest_client()
    ids = rest.list_sessions().result().sessions
    assert len(ids) >= 1
    mine = [s for s in ids if tc.model_id.startswith(s + ":")]
    assert len(mine) == 1, (ids, tc.model_id)
    info = rest.get_session(mine[0]).result()
    assert tc.model_id in info.training_run_ids
    assert info.user_metadata == {"run": "gaps"} and info.display_name == "gaps run"
    # An unknown id (or another key's) is a 404 naming it (raw HTTP: the SDK treats errors here as fatal).
    r = httpx.get(f"{served.http_url}/api/v1/sessions/ts-no-such-session", headers={"X-API-Key": f"tml-{KEY}"})
    assert r.status_code == 404 and "ts-no-such-session" in r.text, r.text


def test_topk_prompt_logprobs_rows(service, tiny_model_dir):
    sc = service.create_sampling_client(base_model=str(tiny_model_dir))
    prompt = T.ModelInput.from_ints([5, 9, 13, 17, 21, 25])
    params = T.SamplingParams(max_tokens=1, temperature=0.0)
    full = sc.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    rows = full.topk_prompt_logprobs
    assert len(rows) == 6 and rows[0] is None, rows[:2]  # position 0 has no logprob: None, not NaN
    for row in rows[1:]:
        assert len(row) == 3 and all(not math.isnan(lp) and lp > -1e4 for _, lp in row), row
    last = sc.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3,
                     prompt_logprobs_last_n=2).result()
    assert last.prompt_logprobs[:4] == [None] * 4
    assert last.topk_prompt_logprobs[:4] == [None] * 4, last.topk_prompt_logprobs
    assert last.topk_prompt_logprobs[4:] == rows[4:]


def test_checkpoint_path_is_not_sent(served):
    from together_train._proto import resource_pb2, resource_pb2_grpc

    s = served.create_session(lora=tt.LoraConfig(rank=2))
    try:
        ckpt = s.save_state("where").result(timeout=120)
        assert ckpt.path is not None and (ckpt.path / "manifest.json").exists()  # resolved by this client
        with grpc.insecure_channel(served.address) as ch:
            msg = resource_pb2_grpc.ResourceServiceStub(ch).ListCheckpoints(
                resource_pb2.ListCheckpointsRequest(session_id=s.session_id),
                metadata=[("authorization", f"Bearer {KEY}")], timeout=30)
        assert [c.path for c in msg.checkpoints] == [""], msg
        remote = tt.ResourceClient(served.address, api_key=KEY)  # knows no storage directory
        try:
            (info,) = remote.list_checkpoints(s.session_id)
            assert info.uri == ckpt.uri and info.path is None
        finally:
            remote.close()
    finally:
        s.stop()
