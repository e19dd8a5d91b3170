"""Errors raised by the service layer; the wire layer maps them to gRPC statuses."""

from __future__ import annotations


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


def unimplemented(feature: str) -> ServiceError:
    """UNIMPLEMENTED naming the feature that a later release adds."""
    return ServiceError("UNIMPLEMENTED", f"{feature} is not implemented by this resource yet")
