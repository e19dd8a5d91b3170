"""Loaded weights at version 0 are served as themselves on every sampling road, never as the base model.

A session's version 0 used to be read as "the fresh adapter, B = 0: serve the base model", which is wrong for
a session created from an imported peft adapter or from a step-0 ``save_state`` of one. One real resource
(tiny random Llama, one generator replica, two API keys, gRPC and HTTP) serves such sessions; each road samples
and scores them: gRPC ``sample`` / ``compute_logprobs`` (after ``weights_sync`` and without it), Tinker
sampling clients (official ``tinker`` package), Together ``sample`` operations (official ``together``
package), OpenAI completions on a rollout and on the imported sampler checkpoint (official ``openai``
package), and a gRPC SDK snapshot taken at step 0 (only its API key may use it). The reference is plain
transformers + peft on the adapter directory, built here with random B
(tests/server/test_adapter_import.py's helpers). Sampled logprobs are compared at temperature 1 (no filter), where a
sampled token's logprob is the model's own.
"""

from __future__ import annotations

import numpy as np
import pytest

import together_train as tt
from test_adapter_import import TOL, TOKENS, make_peft_adapter, peft_logprobs

KEY, OTHER_KEY = "k-imported-weights", "k-imported-other"
PROMPT = [5, 17, 99, 3, 250, 41]
TIMEOUT = 120


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """(gRPC ResourceClient, HTTP base url, a client of another API key) of one resource with two keys."""
    tmp = tmp_path_factory.mktemp("imp-storage")
    (tmp / "keys").write_text(f"{KEY}\n{OTHER_KEY}\n")
    (tmp / "keys").chmod(0o600)
    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=tmp / "storage", api_key=KEY,
                         http_port=0, extra_args=["--trainer-threads", "1", "--generator-threads", "1",
                                                  "--api-key-file", str(tmp / "keys")]) as client:
        with tt.ResourceClient(client.local_resource.address, api_key=OTHER_KEY) as other:
            yield client, client.http_url, other


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("imp-peft") / "adapter", seed=3)


@pytest.fixture(scope="module")
def imported(served, adapter):
    """The adapter imported as a training checkpoint (step 0)."""
    info = served[0].import_adapter(adapter, "imp-train", type="training")
    assert info.step == 0
    return info


@pytest.fixture(scope="module")
def step0_state(served, imported):
    """A step-0 save_state of a session created from the import (its B is the import's, not zero)."""
    s = served[0].create_session(checkpoint_uri=imported.uri)
    try:
        info = s.save_state("imp-step0").result(timeout=TIMEOUT)
    finally:
        s.stop()
    assert info.step == 0
    return info


def _close(what: str, got, want, tol: float = TOL) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = float(np.max(np.abs(got - want)))
    assert err <= tol, f"{what}: max |delta logprob| {err:.3g} > {tol} (served {got[:4]}, peft {want[:4]})"


def _check_sampled(what: str, model_dir, adapter, prompt, tokens, logprobs) -> None:
    """Sampled `tokens` after `prompt` have the peft reference's logprobs (temperature 1)."""
    assert len(tokens) > 0 and len(tokens) == len(logprobs), (what, tokens, logprobs)
    ref = peft_logprobs(model_dir, adapter, [np.asarray(list(prompt) + list(tokens))])[0]
    _close(what, logprobs, ref[len(prompt) - 1:])


def test_the_adapter_differs_from_the_base(served, adapter, tiny_model_dir):
    """Guard: the references below would not tell the adapter from the base model otherwise."""
    ref = peft_logprobs(tiny_model_dir, adapter, TOKENS)
    base = served[0].compute_logprobs(TOKENS).result(timeout=TIMEOUT).logprobs
    assert max(float(np.max(np.abs(np.asarray(b)[-len(r):] - r))) for b, r in zip(base, ref)) > 100 * TOL


@pytest.mark.parametrize("source", ["import", "step0_state"])
@pytest.mark.parametrize("sync", [False, True])
def test_grpc_sample_and_compute_logprobs(served, adapter, tiny_model_dir, imported, step0_state, source, sync):
    """gRPC: a session from the import (or a step-0 save_state of one) samples and scores its weights at
    version 0, before and after weights_sync."""
    client = served[0]
    uri = imported.uri if source == "import" else step0_state.uri
    s = client.create_session(checkpoint_uri=uri)
    try:
        if sync:
            assert s.weights_sync().result(timeout=TIMEOUT).policy_version == 0
        scored = s.compute_logprobs(TOKENS).result(timeout=TIMEOUT)
        assert scored.policy_version == 0
        for i, (got, ref) in enumerate(zip(scored.logprobs, peft_logprobs(tiny_model_dir, adapter, TOKENS))):
            _close(f"{source} sync={sync} compute_logprobs[{i}]", np.asarray(got)[-len(ref):], ref)
        out = s.sample(PROMPT, tt.SamplingParams(max_tokens=6, temperature=1.0, seed=11),
                       num_samples=2).result(timeout=TIMEOUT)
        assert out.policy_version == 0
        for j, seq in enumerate(out.sequences):
            _check_sampled(f"{source} sync={sync} sample[{j}]", tiny_model_dir, adapter, PROMPT, seq.tokens,
                           seq.logprobs)
    finally:
        s.stop()


def test_load_state_of_the_import_into_a_fresh_session(served, adapter, tiny_model_dir, imported):
    """A fresh session (served as the base) that loads the import is served the import from then on."""
    client = served[0]
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0, target_modules=["q_proj", "v_proj"]))
    try:
        base = client.compute_logprobs(TOKENS).result(timeout=TIMEOUT).logprobs
        np.testing.assert_array_equal(s.compute_logprobs(TOKENS).result(timeout=TIMEOUT).logprobs[0], base[0])
        assert s.load_state(imported.uri).result(timeout=TIMEOUT).step == 0
        scored = s.compute_logprobs(TOKENS).result(timeout=TIMEOUT)
        assert scored.policy_version == 0
        for i, (got, ref) in enumerate(zip(scored.logprobs, peft_logprobs(tiny_model_dir, adapter, TOKENS))):
            _close(f"after load_state compute_logprobs[{i}]", np.asarray(got)[-len(ref):], ref)
    finally:
        s.stop()


def test_a_fresh_session_is_still_the_base_model(served):
    """Only a fresh, never-trained, never-loaded adapter is served as the base (policy version 0)."""
    client = served[0]
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        s.weights_sync().result(timeout=TIMEOUT)
        got = s.compute_logprobs(TOKENS).result(timeout=TIMEOUT)
        base = client.compute_logprobs(TOKENS).result(timeout=TIMEOUT)
        assert got.policy_version == 0
        for a, b in zip(got.logprobs, base.logprobs):
            np.testing.assert_array_equal(a, b)
    finally:
        s.stop()


def test_tinker_sampling_client(served, adapter, tiny_model_dir, imported):
    """Tinker: a training client from the imported state; its sampling client (a snapshot at step 0) samples
    and scores the imported weights."""
    tinker = pytest.importorskip("tinker")
    from tinker import types as T

    run, _, name = imported.uri[len("together-train://"):].split("/", 2)
    service = tinker.ServiceClient(base_url=served[1], api_key="tml-" + KEY)
    tc = service.create_training_client_from_state(f"tinker://{run}/weights/{name}").result()
    sc = tc.save_weights_and_get_sampling_client().result()
    full = TOKENS[0]
    lp = sc.compute_logprobs(T.ModelInput.from_ints(full.tolist())).result()
    ref = peft_logprobs(tiny_model_dir, adapter, [full])[0]
    _close("tinker compute_logprobs", lp[1:], ref)
    out = sc.sample(T.ModelInput.from_ints(PROMPT), num_samples=2,
                    sampling_params=T.SamplingParams(max_tokens=6, temperature=1.0, seed=5)).result()
    for j, seq in enumerate(out.sequences):
        _check_sampled(f"tinker sample[{j}]", tiny_model_dir, adapter, PROMPT, seq.tokens, seq.logprobs)


def test_together_sample_operation(served, adapter, tiny_model_dir, imported):
    """Together: a session resumed from the imported checkpoint samples its weights (version 0)."""
    pytest.importorskip("together")
    from together import post_training as pt

    mr = pt.ModelResourcesClient.create(api_key=KEY, base_url=served[1], base_model=str(tiny_model_dir),
                                        interval=0.1)
    try:
        run, kind, name = imported.uri[len("together-train://"):].split("/", 2)
        sess = mr.create_session(resume_from_checkpoint_id=f"{run}.{kind}.{name}", load_optimizer=False,
                                 interval=0.1)
        try:
            mi = {"chunks": [{"encoded_text": {"tokens": PROMPT}}]}
            out = sess.generator.sample(mi, num_samples=2, sampling_params={"max_tokens": 6, "temperature": 1.0,
                                                                            "seed": 7})
            assert [(p.start_token, p.version) for p in out.policy_segments] == [(0, 0)]
            for j, q in enumerate(out.sequences):
                _check_sampled(f"together sample[{j}]", tiny_model_dir, adapter, PROMPT,
                               [int(t) for t in q.tokens], list(q.logprobs))
        finally:
            sess.stop()
    finally:
        mr.detach()


def test_openai_on_a_rollout_and_on_the_checkpoint(served, adapter, tiny_model_dir, imported):
    """OpenAI: completions naming the session (recorded under a rollout) and naming the imported sampler
    checkpoint sample the imported weights; the rollout records version 0."""
    openai = pytest.importorskip("openai")
    client, url, _ = served
    s = client.create_session(checkpoint_uri=imported.uri)
    sampler = client.import_adapter(adapter, "imp-sampler", type="sampler")
    try:
        for model, run in ((s.session_id, "imp-session"), (sampler.uri, "imp-ckpt")):
            oai = openai.OpenAI(base_url=f"{url}/v1/rollouts/{run}", api_key=KEY, max_retries=0, timeout=TIMEOUT)
            oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=9, n=2)
            (call,) = client.get_rollout(run).calls
            assert call.prompt_tokens == PROMPT
            for j, ch in enumerate(call.choices):
                if model == s.session_id:
                    assert ch.policy_versions == [0] * len(ch.tokens), ch.policy_versions
                _check_sampled(f"openai {run}[{j}]", tiny_model_dir, adapter, PROMPT, ch.tokens, ch.logprobs)
            client.delete_rollout(run)
    finally:
        s.stop()


def test_a_snapshot_of_loaded_weights_is_theirs_and_its_owners(served, adapter, tiny_model_dir, imported):
    """gRPC SDK: a step-0 snapshot of the imported weights scores them; another API key can neither use
    nor release it (NOT_FOUND naming it), and the owner's handle still works after those tries."""
    client, _, other = served
    s = client.create_session(checkpoint_uri=imported.uri)
    try:
        with s.snapshot().result(timeout=TIMEOUT) as snap:
            assert snap.policy_version == 0
            ref = peft_logprobs(tiny_model_dir, adapter, TOKENS)
            got = snap.compute_logprobs(TOKENS).result(timeout=TIMEOUT).logprobs
            for i, (a, b) in enumerate(zip(got, ref)):
                _close(f"snapshot compute_logprobs[{i}]", np.asarray(a)[-len(b):], b)
            theirs = tt.Snapshot(other, snap.snapshot_id, s.session_id, 0)
            with pytest.raises(tt.NotFoundError, match=snap.snapshot_id):
                theirs.compute_logprobs(TOKENS).result(timeout=TIMEOUT)
            with pytest.raises(tt.NotFoundError, match=snap.snapshot_id):
                theirs.sample(PROMPT, tt.SamplingParams(max_tokens=2)).result(timeout=TIMEOUT)
            from together_train._proto import session_pb2
            with pytest.raises(tt.NotFoundError, match=snap.snapshot_id):
                other._call(other._sessions.ReleaseSnapshot,
                            session_pb2.ReleaseSnapshotRequest(snapshot_id=snap.snapshot_id), what="ReleaseSnapshot")
            theirs._finalizer.detach()
            again = snap.compute_logprobs(TOKENS).result(timeout=TIMEOUT).logprobs
            np.testing.assert_array_equal(again[0], got[0])
    finally:
        s.stop()
