"""Per-API-key limits of a resource (`TenancyConfig`): sessions, operations in flight, tokens.

Each refusal is a RESOURCE_EXHAUSTED `ServiceError` whose message names the limit's flag name and
value (the HTTP APIs answer 429 with the same words). A refused operation still occupies its seq_id
(a FAILED record, like a request refused by validation), so the session's order is kept and
nothing runs. Counts are of the refused key only: one key at its limit never refuses another.
"""

from __future__ import annotations

import threading
from typing import Callable

from together_train_server.service.errors import ServiceError
from together_train_server.service.tenancy.config import TenancyConfig


class Quotas:
    """The per-key checks, with the lock that makes check-then-queue atomic for one resource.

    Args:
        config: the limits (0 = none).
    """

    def __init__(self, config: TenancyConfig) -> None:
        self.config = config
        # Held around "count this key's operations, then queue one", so two concurrent submissions
        # of one key cannot both pass the last free place.
        self.lock = threading.Lock()

    def check_session(self, active_of_key: int) -> None:
        """Before a new session of a key holding `active_of_key` active sessions.

        Raises:
            ServiceError: RESOURCE_EXHAUSTED (retryable) naming ``max_sessions_per_key`` and its value.
        """
        limit = self.config.max_sessions_per_key
        if limit and active_of_key >= limit:
            raise ServiceError(
                "RESOURCE_EXHAUSTED",
                f"this API key already has {active_of_key} active sessions (max_sessions_per_key={limit}); "
                "stop one first", retryable=True)

    def operation_refusal(self, in_flight_of_key: int, tokens: int, tokens_in_flight: int,
                          used: Callable[[], int]) -> ServiceError | None:
        """Why a key may not queue one more trainer operation now (None: it may).

        Args:
            in_flight_of_key: the key's operations queued, held back or running.
            tokens: the new operation's model_input tokens.
            tokens_in_flight: model_input tokens of those operations.
            used: model_input tokens the key has trained on and scored so far (the usage meter; called
                only with a token budget).
        """
        limit = self.config.max_queued_per_key
        if limit and in_flight_of_key >= limit:
            return ServiceError(
                "RESOURCE_EXHAUSTED",
                f"this API key already has {in_flight_of_key} trainer operations queued or running "
                f"(max_queued_per_key={limit}); wait for one to finish", retryable=True)
        budget = self.config.max_tokens_per_key
        tokens_used_by_key = used() + tokens_in_flight if budget and tokens else 0
        if budget and tokens and tokens_used_by_key + tokens > budget:
            return ServiceError(
                "RESOURCE_EXHAUSTED",
                f"this API key's token budget is spent: {tokens_used_by_key} model_input tokens used or queued "
                f"+ {tokens} in this request > max_tokens_per_key={budget}")
        return None

