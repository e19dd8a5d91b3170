"""The loss table (docs/design.md §4): what each served loss takes, for validation and ``GetCapabilities``.

``LOSS_SPECS`` is the table the service validates requests with and
``GetCapabilities`` lists: for each loss its ``loss_fn_inputs`` (name, dtype,
required), its parameters (type, default, choices), its formula and its
parameter and input-value checks (``LossSpec.check``, ``LossSpec.check_inputs``).
`complete_params` is the one home of the parameter rules both the service
(``validation.validate_loss_params``) and the trainer engines apply. This
module imports no torch (the service imports it); the math of every loss is
in `engines.losses`, whose docstring gives the notation used in the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = [
    "InputSpec",
    "ParamSpec",
    "LossSpec",
    "ParamError",
    "LOSS_SPECS",
    "complete_params",
    "required_inputs",
]


class ParamError(ValueError):
    """A loss parameter the loss cannot take; ``key`` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


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
        check: validates the full parameter dict (defaults filled); raises
            ``ParamError(key, message)``. None = no constraint beyond types.
        conditional_inputs: given the parameters, optional inputs that become
            required, as ``{name: reason}`` (e.g. grpo's reference_logprobs
            when beta > 0).
        check_inputs: validates the values of one sample's ``loss_fn_inputs``
            (numpy float32/int64 ``[n]`` arrays, after the generic dtype/length/
            finiteness checks) given the full parameters; raises
            ``ParamError(key, message)``. None = no value constraint.
    """

    name: str
    inputs: tuple[InputSpec, ...]
    params: tuple[ParamSpec, ...]
    formula: str
    available: bool
    description: str = ""
    check: Callable[[Mapping[str, Any]], None] | None = field(default=None, compare=False, repr=False)
    conditional_inputs: Callable[[Mapping[str, Any]], dict[str, str]] | None = field(
        default=None, compare=False, repr=False
    )
    check_inputs: Callable[[Mapping[str, Any], Mapping[str, Any]], None] | None = field(
        default=None, compare=False, repr=False
    )

    def input(self, name: str) -> InputSpec | None:
        """The input spec called ``name``, or None."""
        return next((i for i in self.inputs if i.name == name), None)

    def param(self, name: str) -> ParamSpec | None:
        """The parameter spec called ``name``, or None."""
        return next((p for p in self.params if p.name == name), None)


_TARGETS = InputSpec("target_tokens", "int64", True, "token id scored at each position: full[i+1]")
_WEIGHTS_OPT = InputSpec(
    "weights", "float32", False,
    "per-position factor m multiplying the token's term (default 1; 0 = not trained; "
    "fractional values scale the term and its gradient)",
)
_MASK_OPT = InputSpec(
    "mask", "float32", False,
    "per-position mask, multiplied with weights (default 1; 0 = not trained)",
)
_SAMPLER_LP = InputSpec(
    "logprobs", "float32", True, "sampler logprob q of the target token (temperature-scaled, nats)"
)
_ADV = InputSpec("advantages", "float32", True, "advantage A at each position")
_POLICY_INPUTS = (_TARGETS, _SAMPLER_LP, _ADV, _WEIGHTS_OPT, _MASK_OPT)
# Tinker's per-token clip thresholds (the tinker SDK types them float32 under these exact keys): where
# given, position t is clipped to [clip_low_threshold[t], clip_high_threshold[t]] instead of the
# loss_fn_config values; each may come without the other.
_CLIP_INPUTS = (
    InputSpec("clip_low_threshold", "float32", False,
              "per-position lower absolute ratio bound; overrides the parameter at every position"),
    InputSpec("clip_high_threshold", "float32", False,
              "per-position upper absolute ratio bound; overrides the parameter at every position"),
)
_SEQ_RATIO_MASK = InputSpec(
    "sequence_ratio_mask", "float32", True,
    "positions whose log-ratio p - q enters the sample's sequence ratio (!= 0 = in; e.g. the sampled tokens)",
)


def _clip(lo: float, hi: float) -> tuple[ParamSpec, ParamSpec]:
    return (
        ParamSpec("clip_low_threshold", "float", False, lo,
                  description="lower absolute bound of the ratio r (<= 1)"),
        ParamSpec("clip_high_threshold", "float", False, hi,
                  description="upper absolute bound of the ratio r (>= 1)"),
    )


def _check_clip(params: Mapping[str, Any], *, low_may_be_zero: bool) -> None:
    lo, hi = float(params["clip_low_threshold"]), float(params["clip_high_threshold"])
    if low_may_be_zero:
        if not 0.0 <= lo <= 1.0:
            raise ParamError("clip_low_threshold",
                             f"clip_low_threshold must be in [0, 1] (an absolute ratio bound), got {lo}")
    elif not 0.0 < lo <= 1.0:
        raise ParamError("clip_low_threshold",
                         f"clip_low_threshold must be in (0, 1] (an absolute ratio bound, e.g. 0.8), got {lo}")
    if not hi >= 1.0:
        raise ParamError("clip_high_threshold",
                         f"clip_high_threshold must be >= 1 (an absolute ratio bound, e.g. 1.2), got {hi}")


def _check_ppo(params: Mapping[str, Any]) -> None:
    _check_clip(params, low_may_be_zero=False)


def _check_cispo(params: Mapping[str, Any]) -> None:
    _check_clip(params, low_may_be_zero=True)


def _check_clip_inputs(inputs: Mapping[str, Any], *, low_may_be_zero: bool) -> None:
    """Per-token thresholds obey the parameter's bounds at every position (first offender named)."""
    import numpy as np

    for key, ok, want in (
        ("clip_low_threshold",
         (lambda v: (v >= 0) & (v <= 1)) if low_may_be_zero else (lambda v: (v > 0) & (v <= 1)),
         "in [0, 1]" if low_may_be_zero else "in (0, 1]"),
        ("clip_high_threshold", lambda v: v >= 1, ">= 1"),
    ):
        if key in inputs:
            v = np.asarray(inputs[key])
            bad = np.flatnonzero(~ok(v))
            if bad.size:
                t = int(bad[0])
                raise ParamError(key, f"{key} must be {want} at every position (an absolute ratio bound), "
                                      f"got {float(v[t])} at position {t}")


def _check_ppo_inputs(params: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    _check_clip_inputs(inputs, low_may_be_zero=False)


def _check_cispo_inputs(params: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    _check_clip_inputs(inputs, low_may_be_zero=True)


def _check_gspo_inputs(params: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    _check_clip_inputs(inputs, low_may_be_zero=False)
    if not (inputs["sequence_ratio_mask"] != 0).any():
        raise ParamError("sequence_ratio_mask", "sequence_ratio_mask marks no position (all zero), so the "
                                                "sequence ratio is undefined; mark the sampled tokens")


def _check_beta(params: Mapping[str, Any]) -> None:
    if float(params["beta"]) < 0:
        raise ParamError("beta", f"beta must be >= 0, got {params['beta']}")


def _check_grpo(params: Mapping[str, Any]) -> None:
    _check_clip(params, low_may_be_zero=False)
    _check_beta(params)
    h = params.get("horizon", 0)
    if h < 0:
        raise ParamError("horizon", f"horizon must be >= 0, got {h}")
    if params.get("aggregation") == "fixed_horizon" and h <= 0:
        raise ParamError("horizon", "aggregation='fixed_horizon' needs horizon > 0 "
                                    "(the constant token count each sequence is normalised by)")


def _grpo_conditional(params: Mapping[str, Any]) -> dict[str, str]:
    if float(params.get("beta", 0.0)) > 0:
        return {"reference_logprobs": "grpo with beta > 0 computes the KL to the reference policy"}
    return {}


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
        formula="loss = -sum_t m_t * r_t * A_t,  r_t = exp(p_t - q_t), m_t = weights_t * mask_t",
        available=True,
        description="off-policy REINFORCE with importance weights",
    ),
    "ppo": LossSpec(
        name="ppo",
        inputs=_POLICY_INPUTS + _CLIP_INPUTS,
        params=_clip(0.8, 1.2),
        formula="loss = -sum_t m_t * min(r_t * A_t, clip(r_t, lo_t, hi_t) * A_t)",
        available=True,
        description="PPO clipped surrogate (Schulman et al. 2017)",
        check=_check_ppo,
        check_inputs=_check_ppo_inputs,
    ),
    "cispo": LossSpec(
        name="cispo",
        inputs=_POLICY_INPUTS + _CLIP_INPUTS,
        params=_clip(0.0, 4.0),
        formula="loss = -sum_t m_t * stopgrad(clip(r_t, lo_t, hi_t)) * A_t * p_t",
        available=True,
        description="clipped importance-sampling policy optimisation (MiniMax-M1)",
        check=_check_cispo,
        check_inputs=_check_cispo_inputs,
    ),
    "dro": LossSpec(
        name="dro",
        inputs=_POLICY_INPUTS,
        params=(ParamSpec("beta", "float", True, None,
                          description="quadratic penalty on p - q (>= 0)"),),
        formula="loss = -sum_t m_t * (p_t * A_t - 0.5 * beta * (p_t - q_t)^2)",
        available=True,
        description="direct reward optimisation with a quadratic off-policy penalty",
        check=_check_beta,
    ),
    "grpo": LossSpec(
        name="grpo",
        inputs=_POLICY_INPUTS + (
            InputSpec("reference_logprobs", "float32", False,
                      "reference-policy logprob of the target (required when beta > 0)"),
        ),
        params=_clip(0.8, 1.2) + (
            ParamSpec("beta", "float", False, 0.0,
                      description="KL coefficient to the reference (k3 estimator), >= 0"),
            ParamSpec("ratio_type", "string", False, "token", ("token", "sequence"),
                      "per-token ratio r_t, or the sequence ratio exp(mean over the sample's "
                      "selected positions of (p - q)) (GSPO, Zheng et al. 2025)"),
            ParamSpec("aggregation", "string", False, "token_mean",
                      ("token_mean", "sequence_mean", "fixed_horizon"),
                      "token_mean: sum / selected tokens of the request; sequence_mean: mean over "
                      "samples of per-sample token means; fixed_horizon: sum / (samples * horizon)"),
            ParamSpec("horizon", "int", False, 0,
                      description="tokens per sequence divided by with aggregation=fixed_horizon (> 0 there)"),
        ),
        formula=(
            "per token: l_t = m_t * (-min(rho_t*A_t, clip(rho_t, lo, hi)*A_t) + beta*k3_t), "
            "rho_t = r_t (token) or exp(mean_{selected s}(p_s - q_s)) (sequence), "
            "k3_t = exp(ref_t - p_t) - (ref_t - p_t) - 1; loss = sum_t l_t / D, "
            "D = aggregation's normaliser"
        ),
        available=True,
        description="group relative policy optimisation (Shao et al. 2024), GSPO and Dr. GRPO variants",
        check=_check_grpo,
        conditional_inputs=_grpo_conditional,
    ),
    "gspo": LossSpec(
        name="gspo",
        inputs=(_TARGETS, _SAMPLER_LP, _ADV, _SEQ_RATIO_MASK, _WEIGHTS_OPT, _MASK_OPT) + _CLIP_INPUTS,
        params=_clip(0.8, 1.2),
        formula=(
            "loss = -sum_t m_t * min(s_t * A_t, clip(s_t, lo_t, hi_t) * A_t), "
            "s_t = stopgrad(s) * exp(p_t - stopgrad(p_t)), "
            "s = exp(mean_{t: sequence_ratio_mask_t != 0}(p_t - q_t)) per sample"
        ),
        available=True,
        description="GSPO-token (Zheng et al. 2025) as Tinker defines it: the sequence ratio's value, "
                    "each token's own gradient",
        check=_check_ppo,
        check_inputs=_check_gspo_inputs,
    ),
    # Tinker's StableReinforce needs per-sequence information its sampler records
    # (record_stability_info, provenance spans naming sequence ids) and its objective is not
    # published; refused by name rather than served with guessed math.
    "stable_reinforce": LossSpec(
        name="stable_reinforce",
        inputs=_POLICY_INPUTS,
        params=(),
        formula="not served",
        available=False,
        description=(
            "Tinker's StableReinforce (alpha) uses stability information Tinker's sampler records "
            "(record_stability_info, sequence_id provenance) and its objective is not published; "
            "this resource does not serve it: use importance_sampling, ppo, cispo or gspo"
        ),
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
        available=True,
        description="any loss of the logprobs, differentiated by the client",
    ),
}


def required_inputs(name: str, params: Mapping[str, Any]) -> dict[str, str]:
    """Optional inputs of loss ``name`` that ``params`` make required: ``{key: reason}``."""
    spec = LOSS_SPECS[name]
    return dict(spec.conditional_inputs(params)) if spec.conditional_inputs else {}


def complete_params(spec: LossSpec, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """``params`` with the spec's defaults filled in, checked by the spec's rules.

    Type and name checks of each given value are the caller's (the service's
    ``validate_loss_params``); this is what both the service and the engines require.

    Raises:
        ParamError: a required parameter is missing (``"loss 'dro' requires parameter
            'beta'"``), or ``spec.check`` refuses a value (naming the parameter).
    """
    out = {p.name: p.default for p in spec.params if p.default not in (None, "")}
    out.update(params or {})
    for p in spec.params:
        if p.required and p.name not in out:
            raise ParamError(p.name, f"loss {spec.name!r} requires parameter {p.name!r}")
    if spec.check is not None:
        spec.check(out)
    return out
