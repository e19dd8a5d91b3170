"""Retry policy for every RPC the SDK sends (tenacity).

Only errors marked retryable are retried (`TogetherTrainError.retryable`, i.e.
the server's ``ErrorDetail.retryable`` flag, else UNAVAILABLE or
DEADLINE_EXCEEDED, see `together_train.errors`). Waits grow exponentially
with jitter and are bounded both in attempts and in total time.

Resending is safe:

- operation RPCs (``Forward``, ``ForwardBackward``, ``OptimStep``, ...) are
  resent with the *same* idempotency key and seq_id, so the server returns the
  first request's operation and never runs it twice;
- ``WaitOperation``, ``GetOperation``, ``Sample``, ``ComputeLogprobs`` and the
  read-only resource calls do not change state;
- ``CreateSession`` has no idempotency key: it is retried only on UNAVAILABLE
  (`RetryPolicy.call(..., idempotent=False)`), where the request most likely
  never reached the server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, TypeVar

import grpc
import tenacity

from together_train.errors import TogetherTrainError, from_rpc_error

__all__ = ["RetryPolicy", "NO_RETRY", "is_retryable"]

T = TypeVar("T")
logger = logging.getLogger("together_train")


def is_retryable(exc: BaseException, *, idempotent: bool = True) -> bool:
    """True when `exc` is a TogetherTrainError marked retryable (and, for a
    non-idempotent request, its code is UNAVAILABLE)."""
    if not isinstance(exc, TogetherTrainError) or not exc.retryable:
        return False
    return idempotent or exc.code == "UNAVAILABLE"


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter.

    Args:
        max_attempts: attempts in total, including the first (1 = no retry).
        max_elapsed_s: stop retrying once this many seconds have passed since
            the first attempt (the attempt running then still finishes).
        initial_backoff_s: first wait; doubles after each failure ...
        max_backoff_s: ... up to this.
        jitter_s: a uniform random 0..jitter_s seconds added to every wait.

    The defaults ride out about 12 s of a server that does not answer (a restart) in
    waits of at most a second: a longer wait outlasts the outage it waits out (with 5 s
    waits a client slept on up to 5 s past the moment a restarted server answered).
    """

    max_attempts: int = 16
    max_elapsed_s: float = 120.0
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 1.0
    jitter_s: float = 0.2

    def call(self, fn: Callable[[], T], *, idempotent: bool = True, what: str = "rpc") -> T:
        """Run `fn()`, retrying retryable failures; `grpc.RpcError` is converted
        to the typed `TogetherTrainError` (and re-raised once retries are spent).
        """

        def attempt() -> T:
            try:
                return fn()
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None

        if self.max_attempts <= 1:
            return attempt()

        def log_retry(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            logger.info(
                "retrying %s after %s (attempt %d, next wait %.2fs)",
                what,
                exc,
                state.attempt_number,
                state.next_action.sleep if state.next_action else 0.0,
            )

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: is_retryable(e, idempotent=idempotent)),
            wait=tenacity.wait_exponential(multiplier=self.initial_backoff_s, max=self.max_backoff_s)
            + tenacity.wait_random(0, self.jitter_s),
            stop=tenacity.stop_after_attempt(self.max_attempts) | tenacity.stop_after_delay(self.max_elapsed_s),
            before_sleep=log_retry,
            reraise=True,
        )
        try:
            return retrying(attempt)
        except TogetherTrainError as err:
            raise err.with_traceback(None) from None  # keep tracebacks short: no tenacity frames


#: A policy that never retries.
NO_RETRY = RetryPolicy(max_attempts=1)
