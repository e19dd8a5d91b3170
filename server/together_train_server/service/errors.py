"""Errors raised by the service layer; the wire layer maps them to gRPC statuses."""

from __future__ import annotations

import logging
import uuid

log = logging.getLogger("together_train_server")


class ServiceError(Exception):
    """A request the service refuses or an operation that failed.

    Args:
        code: gRPC status code name, e.g. "INVALID_ARGUMENT", "NOT_FOUND",
            "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "UNIMPLEMENTED",
            "UNAVAILABLE", "INTERNAL".
        message: what is wrong, in words a user can act on.
        sample_index: which sample of the batch is at fault, if any.
        key: which loss_fn_inputs key, loss parameter or request field, if any.
        retryable: True when the same request may succeed if sent again.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        sample_index: int | None = None,
        key: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.sample_index = sample_index
        self.key = key
        self.retryable = retryable

    def __str__(self) -> str:
        where = []
        if self.sample_index is not None:
            where.append(f"sample {self.sample_index}")
        if self.key:
            where.append(f"key {self.key!r}")
        return f"{self.code}: {self.message}" + (f" ({', '.join(where)})" if where else "")


def invalid(message: str, *, sample_index: int | None = None, key: str | None = None) -> ServiceError:
    """Shorthand for an INVALID_ARGUMENT ServiceError."""
    return ServiceError("INVALID_ARGUMENT", message, sample_index=sample_index, key=key)


def internal_error(
    err: BaseException, *, what: str, session_id: str = "", operation_id: str = ""
) -> ServiceError:
    """An unexpected exception (an engine bug, OOM, ...) as the INTERNAL error a client gets, logged.

    Logs ``err`` with its traceback at ERROR level on the ``together_train_server``
    logger under a fresh error id (``err-<12 hex>``), with the session and
    operation ids; the returned ServiceError's message carries the same id, so
    an operator can find the traceback from what a user reports.

    Args:
        err: the exception caught.
        what: the operation kind or RPC method it happened in, e.g. "optim_step".
        session_id, operation_id: where, when known ("" otherwise).
    """
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    log.error(
        "internal error %s in %s (session %s, operation %s): %s: %s",
        error_id, what, session_id or "-", operation_id or "-", type(err).__name__, err,
        exc_info=(type(err), err, err.__traceback__),
    )
    return ServiceError(
        "INTERNAL",
        f"internal error {error_id} in {what}: {type(err).__name__}: {err} "
        f"(the server log has its traceback under {error_id})",
    )
