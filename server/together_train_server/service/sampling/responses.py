"""Stored Responses (OpenAI's ``POST /v1/responses`` with ``store``), so a multi-turn agent chains with
``previous_response_id``.

A stored response keeps its response object (``GET /v1/responses/{id}``) and the conversation it
ends as chat messages (the earlier turns, its input and its output; its ``instructions`` are not
carried over, as OpenAI's are not): the next call's messages start with them. A response belongs to
the API key that created it: another key gets NOT_FOUND, as for one that does not exist. The store
keeps the most recently written `max_responses` (least recently written dropped first).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from together_train_server.service.errors import ServiceError

__all__ = ["ResponseStore", "StoredResponse"]

DEFAULT_MAX_RESPONSES = 10_000


@dataclass
class StoredResponse:
    """One stored response.

    Attributes:
        body: the response object as it was answered (JSON-ready dict).
        messages: the conversation it ends, in chat form (without instructions).
    """

    body: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """Thread-safe, bounded map (owner, response id) -> `StoredResponse`."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        self._max = int(max_responses)
        self._items: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, owner: str, response_id: str, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Store a response (copies of `body` and `messages`), dropping the oldest past the bound."""
        with self._lock:
            self._items[(owner, response_id)] = StoredResponse(copy.deepcopy(body), copy.deepcopy(messages))
            self._items.move_to_end((owner, response_id))
            while len(self._items) > self._max:
                self._items.popitem(last=False)

    def get(self, owner: str, response_id: Any, key: str = "response_id") -> StoredResponse:
        """The stored response (a copy).

        Raises:
            ServiceError: NOT_FOUND naming `key` for an unknown id, another key's, or one not stored.
        """
        with self._lock:
            item = self._items.get((owner, response_id)) if isinstance(response_id, str) else None
        if item is None:
            raise ServiceError("NOT_FOUND", f"response {response_id!r} was not found (stored responses only: "
                                            "store must not be false)", key=key)
        return StoredResponse(copy.deepcopy(item.body), copy.deepcopy(item.messages))

    def delete(self, owner: str, response_id: str) -> None:
        """Forget a stored response. Raises as `get`."""
        with self._lock:
            if self._items.pop((owner, response_id), None) is not None:
                return
        raise ServiceError("NOT_FOUND", f"response {response_id!r} was not found", key="response_id")
