"""The Tinker API (``/api/v1/...``) over the resource's service layer.

The official ``tinker`` SDK (0.38) runs unchanged against this router: a
user changes ``base_url`` and nothing else. The contract is the SDK's
sources (``tinker/resources/*.py``, ``tinker/lib/*``); what each route maps to:

- a tinker *client session* (``create_session``, heartbeats every 10 s,
  ``sessions/{id}/finish``) is only a name space here: it owns the training
  models created in it, its heartbeat keeps them alive (`SessionsApi.keep_alive`)
  and finishing it stops them.
- a tinker *training model* is one of our sessions (a LoRA adapter with its
  optimizer). Its id is ``"{client_session}:train:{model_seq_id}"`` (the SDK
  derives that id itself when it creates a model by loading a checkpoint).
  The only state kept here is that id's translation to our session id.
- every call that does work answers a future ``{request_id, model_id}``; the
  request id is our operation id and ``retrieve_future`` long-polls it
  (about 40 s, then 408: the SDK gives up on a poll after 45 s and retries).
  A failed operation is a 200 ``{"error", "category"}`` (category "user" for
  a request the resource refused, "server" for its own failure).
- ordering: the SDK numbers a model's requests ``seq_id = 1, 2, ...``; ours
  start at 0, so ``seq = seq_id - 1``, and the session queue holds early ones
  back. A re-submission (the SDK retries with a new idempotency key) of the
  same seq_id and the same body returns the first operation; the same seq_id
  with another body is a 409.

LoRA: Tinker takes no alpha; we use ``LORA_ALPHA = 32`` for every rank (so the
adapter's scale is ``32 / rank``). ``train_attn`` trains q/k/v/o projections,
``train_mlp`` gate/up/down, ``train_unembed`` a copy of ``lm_head``.

The package, one concept per module: `base` (the router, LoRA conventions, the
request context), `ids` (tinker ids and tinker:// paths <-> ours, the API's only
state), `parsing` (request fields, protobuf datums), `results` (futures and
result shapes), and the routes: `server_info`, `sessions`, `models`,
`training`, `futures`, `checkpoints`, `sampling`, `listings`, `rest_sessions`.
"""

from __future__ import annotations

# Importing a route module registers its routes on `router`.
from together_train_server.wire.http.tinker import (  # noqa: F401
    checkpoints,
    futures,
    listings,
    models,
    rest_sessions,
    sampling,
    server_info,
    sessions,
    training,
)
from together_train_server.wire.http.tinker.base import router
from together_train_server.wire.http.tinker.ids import install

__all__ = ["install", "router"]
