"""The refusal the DeepSpeed engines raise for an operation their layout does not offer."""

from __future__ import annotations

__all__ = ["FullModeError"]


class FullModeError(ValueError):
    """An operation that a ``--mode full`` resource (or a ZeRO-3 LoRA one) cannot serve.

    ``grpc_code`` is FAILED_PRECONDITION: the request is valid, this
    resource's mode does not offer it.
    """

    grpc_code = "FAILED_PRECONDITION"
    retryable = False
