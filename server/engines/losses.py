"""Loss specifications (DESIGN §4) and the math of the available losses.

``LOSS_SPECS`` is the table the service validates requests with and
``GetCapabilities`` lists: for each loss its ``loss_fn_inputs`` (name, dtype,
required), its parameters (type, default, choices) and its formula. Every
loss is **summed over tokens**; the server never averages.

Notation (per position of one sample): ``p`` = current (untempered) logprob
of the target token, ``q`` = sampler logprob (``loss_fn_inputs["logprobs"]``),
``r = exp(p - q)``, ``A`` = advantage, ``w`` = weight.

Only ``cross_entropy`` is served in this release (``available=True``); the
other rows are declared so clients can discover them, and the service answers
UNIMPLEMENTED for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

__all__ = [
    "InputSpec",
    "ParamSpec",
    "LossSpec",
    "LOSS_SPECS",
    "LossResult",
    "cross_entropy",
    "compute_loss",
    "available_losses",
]


@dataclass(frozen=True)
class InputSpec:
    """One ``loss_fn_inputs`` entry: a 1-D array as long as ``model_input``.

    Attributes:
        name: key in ``loss_fn_inputs``.
        dtype: ``"int64"`` or ``"float32"``.
        required: whether the key must be present.
        description: meaning and units.
    """

    name: str
    dtype: str
    required: bool
    description: str


@dataclass(frozen=True)
class ParamSpec:
    """One loss parameter (``loss_fn_config.params``).

    Attributes:
        name: parameter name.
        type: ``"float"``, ``"int"`` or ``"string"``.
        required: whether it must be given.
        default: value used when absent (``None`` when required or none).
        choices: allowed values for string parameters (empty = any).
        description: meaning.
    """

    name: str
    type: str
    required: bool = False
    default: Any = None
    choices: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class LossSpec:
    """A loss as advertised to clients.

    Attributes:
        name: the ``loss_fn`` string.
        inputs: accepted ``loss_fn_inputs``.
        params: accepted parameters.
        formula: the loss in text (summed over tokens).
        available: served by this release.
        description: one-line summary.
    """

    name: str
    inputs: tuple[InputSpec, ...]
    params: tuple[ParamSpec, ...]
    formula: str
    available: bool
    description: str = ""

    def input(self, name: str) -> InputSpec | None:
        """The input spec called ``name``, or None."""
        return next((i for i in self.inputs if i.name == name), None)

    def param(self, name: str) -> ParamSpec | None:
        """The parameter spec called ``name``, or None."""
        return next((p for p in self.params if p.name == name), None)


_TARGETS = InputSpec("target_tokens", "int64", True, "token id scored at each position: full[i+1]")
_WEIGHTS_OPT = InputSpec(
    "weights", "float32", False, "per-position weight selecting positions (default 1)"
)
_MASK_OPT = InputSpec("mask", "float32", False, "per-position 0/1 mask (default 1)")
_SAMPLER_LP = InputSpec(
    "logprobs", "float32", True, "sampler logprob q of the target token (temperature-scaled, nats)"
)
_ADV = InputSpec("advantages", "float32", True, "advantage A at each position")
_POLICY_INPUTS = (_TARGETS, _SAMPLER_LP, _ADV, _WEIGHTS_OPT, _MASK_OPT)


def _clip(lo: float, hi: float) -> tuple[ParamSpec, ParamSpec]:
    return (
        ParamSpec("clip_low_threshold", "float", False, lo,
                  description="lower absolute bound of the ratio r"),
        ParamSpec("clip_high_threshold", "float", False, hi,
                  description="upper absolute bound of the ratio r"),
    )


LOSS_SPECS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(
        name="cross_entropy",
        inputs=(
            _TARGETS,
            InputSpec("weights", "float32", True,
                      "per-position weight w; any real value (0 = not trained, negative allowed)"),
        ),
        params=(),
        formula="loss = -sum_t w_t * p_t",
        available=True,
        description="weighted negative log-likelihood (SFT)",
    ),
    "importance_sampling": LossSpec(
        name="importance_sampling",
        inputs=_POLICY_INPUTS,
        params=(),
        formula="loss = -sum_t r_t * A_t,  r_t = exp(p_t - q_t)",
        available=False,
        description="off-policy REINFORCE with importance weights",
    ),
    "ppo": LossSpec(
        name="ppo",
        inputs=_POLICY_INPUTS,
        params=_clip(0.8, 1.2),
        formula="loss = -sum_t min(r_t * A_t, clip(r_t, lo, hi) * A_t)",
        available=False,
        description="PPO clipped surrogate (Schulman et al. 2017)",
    ),
    "cispo": LossSpec(
        name="cispo",
        inputs=_POLICY_INPUTS,
        params=_clip(0.0, 4.0),
        formula="loss = -sum_t stopgrad(clip(r_t, lo, hi)) * A_t * p_t",
        available=False,
        description="clipped importance-sampling policy optimisation (MiniMax-M1)",
    ),
    "dro": LossSpec(
        name="dro",
        inputs=_POLICY_INPUTS,
        params=(ParamSpec("beta", "float", True, None,
                          description="quadratic penalty on p - q"),),
        formula="loss = -sum_t (p_t * A_t - 0.5 * beta * (p_t - q_t)^2)",
        available=False,
        description="direct reward optimisation with a quadratic off-policy penalty",
    ),
    "grpo": LossSpec(
        name="grpo",
        inputs=_POLICY_INPUTS + (
            InputSpec("reference_logprobs", "float32", False,
                      "reference-policy logprob of the target (required when beta > 0)"),
        ),
        params=_clip(0.8, 1.2) + (
            ParamSpec("beta", "float", False, 0.0,
                      description="KL coefficient to the reference (k3 estimator)"),
            ParamSpec("ratio_type", "string", False, "token", ("token", "sequence"),
                      "per-token ratio, or sequence-level geometric-mean ratio (GSPO)"),
            ParamSpec("aggregation", "string", False, "token_mean",
                      ("token_mean", "sequence_mean", "fixed_horizon"),
                      "how per-token terms are aggregated"),
            ParamSpec("horizon", "int", False, 0,
                      description="token count divided by with aggregation=fixed_horizon"),
        ),
        formula=(
            "per token: l_t = -min(r_t*A_t, clip(r_t, lo, hi)*A_t) + beta*k3_t, "
            "k3_t = exp(ref_t - p_t) - (ref_t - p_t) - 1; aggregated as named"
        ),
        available=False,
        description="group relative policy optimisation (Shao et al. 2024), GSPO variant",
    ),
    "custom": LossSpec(
        name="custom",
        inputs=(
            _TARGETS,
            InputSpec("gradients", "float32", True,
                      "client gradient g_t = dL/dp_t (CustomForwardBackward)"),
        ),
        params=(),
        formula="backprop of sum_t g_t * p_t (reported loss = sum_t g_t * p_t)",
        available=False,
        description="any loss of the logprobs, differentiated by the client",
    ),
}


def available_losses() -> list[str]:
    """Names of the losses this release serves."""
    return [n for n, s in LOSS_SPECS.items() if s.available]


@dataclass
class LossResult:
    """Loss of one sample.

    Attributes:
        elementwise: float32-or-wider ``[n]`` tensor (differentiable), the loss
            at each position; the sample's loss is its sum.
        metrics: named scalars with reduction suffix (summed across samples).
    """

    elementwise: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def cross_entropy(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                  params: Mapping[str, Any] | None = None) -> LossResult:
    """Weighted negative log-likelihood, ``l_t = -w_t * p_t`` (DESIGN §4).

    Args:
        logprobs: ``[n]`` float32 logprobs ``p_t`` of the target tokens
            (differentiable).
        inputs: ``weights`` ``[n]`` (any real values; negative allowed).
        params: unused.

    Returns:
        elementwise ``[n]`` loss; metrics ``loss:sum``, ``num_tokens:sum``
        (positions with nonzero weight), ``weight:sum``.
    """
    w = inputs["weights"].to(logprobs.dtype)
    elementwise = -w * logprobs
    return LossResult(
        elementwise,
        {
            "loss:sum": float(elementwise.detach().sum()),
            "num_tokens:sum": float((w != 0).sum()),
            "weight:sum": float(w.sum()),
        },
    )


_LOSS_FNS: dict[str, Callable[..., LossResult]] = {"cross_entropy": cross_entropy}


def compute_loss(name: str, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                 params: Mapping[str, Any] | None = None) -> LossResult:
    """Compute the loss ``name`` for one sample.

    Raises:
        KeyError: unknown loss. NotImplementedError: declared but not available.
    """
    if name not in LOSS_SPECS:
        raise KeyError(f"unknown loss {name!r}; known: {sorted(LOSS_SPECS)}")
    fn = _LOSS_FNS.get(name)
    if fn is None or not LOSS_SPECS[name].available:
        raise NotImplementedError(f"loss {name!r} is not available in this release")
    return fn(logprobs, inputs, params or {})
