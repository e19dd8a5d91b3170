"""Direct Preference Optimization beside the supervised loop: the `DPO` loss and the `HeldOutPreferences`
evaluator (Rafailov et al. 2023, "Direct Preference Optimization", arXiv:2305.18290).

`DPO` runs on batches of `PreferencePair` (supervised/preference.py) through ``forward`` +
``custom_forward_backward`` against a frozen reference session (custom_loss.dpo_loss); an online
variant takes a function that replaces the rejected replies before each step (the recipe's
`recipes.dpo.on_policy_rejected`). Imports only the SDK at module level.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np
import together_train as tt

from together_train_cookbook.codec import Codec
from together_train_cookbook.custom_loss import dpo_loss, forward_backward_custom, sequence_logprobs
from together_train_cookbook.supervised.evaluators import Evaluation, Evaluator
from together_train_cookbook.supervised.loss import Metrics, SupervisedLoss
from together_train_cookbook.supervised.preference import PreferencePair, pair_samples

__all__ = ["DPO", "HeldOutPreferences", "Resample", "preference_stats"]

# Online DPO: (policy session, batch, step) -> (batch with new rejected replies, metrics).
Resample = Callable[[tt.Session, Sequence[PreferencePair], int], tuple[list[PreferencePair], dict[str, float]]]


def preference_stats(pi: np.ndarray, ref: np.ndarray, beta: float) -> dict[str, float]:
    """From per-sample sums ordered chosen, rejected, ...: preference accuracy, reward margin
    ``mean((pi_c - ref_c) - (pi_r - ref_r))``, chosen / rejected rewards ``beta·(pi - ref)``."""
    d = pi - ref
    margin = d[0::2] - d[1::2]
    return {"accuracy": float((margin > 0).mean()), "margin": float(margin.mean()),
            "chosen_reward": float(beta * d[0::2].mean()), "rejected_reward": float(beta * d[1::2].mean())}


# -- the loss and its held-out readout -----------------------------------------------------------


class DPO(SupervisedLoss):
    """The DPO loss on batches of `PreferencePair`, against a frozen reference session opened in `setup`
    (same start as the policy).

    Args:
        codec: renders the pairs (`pair_samples`).
        beta: DPO's inverse temperature on the implicit reward ``beta * (log pi - log ref)``.
        max_length: tokens per rendered sample (longer ones are cut).
        resample: online DPO: each step first publishes the policy's weights (weights_sync) and
            replaces the batch's rejected replies with ``resample(policy, batch, step)``; None: offline.
    """

    def __init__(self, codec: Codec, beta: float, max_length: int, resample: Resample | None = None) -> None:
        self.codec, self.beta, self.max_length, self.resample = codec, beta, max_length, resample
        self.reference: tt.Session | None = None

    def setup(self, client: tt.ResourceClient, policy: tt.Session, *, init_uri: str | None,
              lora: tt.LoraConfig, stack: contextlib.ExitStack) -> None:
        self.reference = client.create_session(lora=None if init_uri else lora, checkpoint_uri=init_uri,
                                               name="dpo-ref")
        stack.enter_context(self.reference)  # stopped however the run ends

    def forward_backward(self, session: tt.Session, batch: Sequence[PreferencePair], step: int) -> Metrics:
        sampled: dict[str, float] = {}
        if self.resample is not None:
            session.weights_sync().result()  # after the previous step's optim_step: sample this version
            batch, sampled = self.resample(session, batch, step)
        assert self.reference is not None, "setup() opens the reference session"
        samples = pair_samples(self.codec, batch, self.max_length)
        ref = sequence_logprobs(self.reference, samples)
        res = forward_backward_custom(session, samples, dpo_loss(ref[0::2], ref[1::2], self.beta))
        pi = np.array([float(np.dot(s.loss_fn_inputs["weights"].astype(np.float64), lp))
                       for s, lp in zip(samples, res.logprobs)])
        rec = {"loss": res.loss / len(batch), **preference_stats(pi, ref, self.beta), **sampled}
        return lambda: rec


class HeldOutPreferences(Evaluator):
    """Held-out pairs under the current policy (one ``forward``; periodic): ``held_out_pref_accuracy``
    (implicit reward z > 0, DPO's own readout; 0 at the start where policy = reference),
    ``held_out_margin`` (mean reward margin), ``held_out_likelihood_accuracy`` (pi_c > pi_r: the
    policy itself ranks the chosen reply higher, reference-free)."""

    periodic = True

    def __init__(self, loss: DPO, samples: list[tt.Sample]) -> None:
        self.loss, self.held_out = loss, samples
        self._ref: np.ndarray | None = None

    def __call__(self, session: tt.Session) -> Evaluation:
        if not self.held_out:
            return Evaluation()
        if self._ref is None:  # the reference never changes: its sums once
            assert self.loss.reference is not None, "the loss's setup() opens the reference session"
            self._ref = sequence_logprobs(self.loss.reference, self.held_out)
        pi = sequence_logprobs(session, self.held_out)
        st = preference_stats(pi, self._ref, self.loss.beta)
        return Evaluation({"held_out_pref_accuracy": st["accuracy"], "held_out_margin": st["margin"],
                           "held_out_likelihood_accuracy": float((pi[0::2] > pi[1::2]).mean())})
