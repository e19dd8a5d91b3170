"""The Together RL REST API (``/v1/rl/...``) over the resource's service layer.

The official ``together`` SDK (3.1.1, ``together.post_training``) runs
unchanged against these routes: a user points ``base_url`` at this server
and passes one of its API keys (``Authorization: Bearer <key>``). The
contract is the SDK's sources (``together/resources/post_training/*``,
``together/post_training/*``); how it maps onto ours:

- a running server is ONE model resource (``mr-...``), READY from the
  start: ``create`` with the base model this server holds returns it (another
  base model is a 400 naming ours); ``stop`` without ``force`` is refused while
  sessions are active, with ``force`` it stops every session of the caller's
  key; the next ``create`` makes it READY again (the server keeps running).
- a training session is one of our sessions (same id, ``s-...``), created
  within the POST, so it is RUNNING at the SDK's first GET.
- operations carry no seq_id: a session's operations take the next seq_id
  of its queue in arrival order (under a per-session lock), so they run in
  arrival order, ``sample`` included (`session_sampling.submit_sample`). The
  ``Idempotency-Key`` header maps to the queue's idempotency key: a retried
  POST returns the original operation and the work is applied once. An
  operation id is our operation id; an inference checkpoint is two queued
  operations (adapter, then merged model, same step), reported as one.
- a POST refused by validation is a 400 (the JSON body names the sample
  index and key, and the operation ran nothing); a stopped session is 400 with
  code SESSION_NOT_ACTIVE; the session cap is 429 with ``x-should-retry:
  false`` (the SDK would retry it 7 times otherwise). The POST waits up to
  `POST_HOLD_S` for the operation to finish and the GET up to `GET_HOLD_S`,
  so a short operation costs no 0.5 s poll.
- checkpoints are listed from the model registry (`CheckpointsApi.page_checkpoints`);
  checkpoint ids are ``<session>.<kind>.<name>`` (our URI
  ``together-train://<session>/<kind>/<name>``, reversible without a table).
  Inference checkpoints download as files behind URLs served here under
  ``/v1/rl/files/`` with their own short-lived credential (an HMAC over
  the checkpoint, the file name and an expiry time), because the SDK fetches
  them without the Authorization header. A URL names one file of one
  checkpoint's manifest, so it cannot read anything else.
- request bodies over 0.5 MiB arrive through ``payloads/upload-url``: the SDK
  PUTs the JSON body to a signed URL here (stored under
  ``<storage>/.payloads/``, at most `max_payload_bytes`) and then POSTs the
  operation with ``payload_id`` and a truncated copy of the body, which is
  ignored in favour of the uploaded one.

Not served (a clear 400): Muon (``muon_params``), LOSS_TYPE_DPPO, full-weight
resources (``lora_enabled=false``), ``base_weights_ref``, ``return_routed_experts``
(no mixture-of-experts here), non-encoded-text prompt chunks.

Modules: `routing` (router, errors, request context), `ids` (this API's ids and tables),
`parsing` / `rendering` (JSON <-> service values), `resources` (model resources), `sessions`,
`operations` (the operation endpoints, one `operations.KINDS` entry per kind: `training`,
`sampling`), `payloads` (large bodies), `checkpoints` (listing, signed downloads).
"""

from __future__ import annotations

from fastapi import FastAPI

from together_train_server.service.interfaces import ResourceApi
from together_train_server.wire.http.together import checkpoints, operations, payloads, resources, sessions
from together_train_server.wire.http.together.ids import TogetherIds
from together_train_server.wire.http.together.routing import ERROR_PREFIXES, OPEN_PREFIXES, error_response, router

# The route modules register their routes on `router` when imported.
_ROUTE_MODULES = (resources, sessions, operations, payloads, checkpoints)

__all__ = ["ERROR_PREFIXES", "OPEN_PREFIXES", "error_response", "install", "router"]


def install(app: FastAPI, resource: ResourceApi) -> None:
    """Attach this API's tables to the app (``app.state.together``)."""
    app.state.together = TogetherIds(resource)
