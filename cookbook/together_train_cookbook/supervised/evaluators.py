"""Evaluations the supervised loop runs at the start, every ``eval_every`` steps and at the end.

An `Evaluator` reads the policy session and returns an `Evaluation`: metrics (name -> number)
and optional per-item records (written to ``eval.jsonl``). Two kinds:

- ``periodic = True``: cheap readouts (e.g. DPO's held-out preference accuracy, one
  ``forward``) run every ``eval_every`` steps and after the last step; their values go into
  that step's metrics record, the start values into a record of step -1;
- ``periodic = False`` (default): run at the start and the end only (e.g. greedy accuracy,
  which samples); their values go into the run's summary.

``samples = True`` marks an evaluator that samples the last *synced* weights: the loop calls
``weights_sync`` before running it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import together_train as tt

from together_train_cookbook.codec import Codec
from together_train_cookbook.evaluation import EvalItem, evaluate

__all__ = ["Evaluation", "Evaluator", "GreedyAccuracy", "run_evaluators"]


@dataclass
class Evaluation:
    """Metrics of one evaluation (name -> number) and its per-item records."""

    metrics: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)


class Evaluator(ABC):
    """One evaluation of the policy session (see the module doc for `periodic` / `samples`)."""

    periodic: bool = False
    samples: bool = False

    @abstractmethod
    def __call__(self, session: tt.Session) -> Evaluation:
        """Evaluate the session's current weights (or last synced ones when `samples`)."""


class GreedyAccuracy(Evaluator):
    """Greedy sampling of every `EvalItem` (all requests in flight at once), graded by the
    item's checker: metric `key` = fraction right in [0, 1] (NaN without items); records =
    prompt, reference, response, correct, policy_version per item."""

    samples = True

    def __init__(self, codec: Codec, items: Sequence[EvalItem], max_tokens: int, key: str = "accuracy") -> None:
        self.codec, self.items, self.max_tokens, self.key = codec, list(items), max_tokens, key

    def __call__(self, session: tt.Session) -> Evaluation:
        acc, records = evaluate(session, self.codec, self.items, self.max_tokens)
        return Evaluation({self.key: acc}, records)


def run_evaluators(session: tt.Session, evaluators: Sequence[Evaluator]) -> Evaluation:
    """Run `evaluators` on `session` (one ``weights_sync`` first when any samples) and merge
    their metrics and records."""
    out = Evaluation()
    if any(e.samples for e in evaluators):
        session.weights_sync().result()
    for e in evaluators:
        ev = e(session)
        out.metrics.update(ev.metrics)
        out.records.extend(ev.records)
    return out
