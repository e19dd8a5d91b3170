"""Typed values of the SDK, one per module, and their conversion to and from the wire messages.

Conventions used throughout:

- Token ids are non-negative integers, sent as int64.
- A `Sample` is one training example (docs/design.md §4): `model_input` is the full
  sequence minus its last token; every `loss_fn_inputs` array is 1-D and
  exactly as long as `model_input`; position ``i`` is scored on predicting
  ``target_tokens[i] = full[i + 1]``. Nothing is ever shifted by the server.
- Losses are **sums** over samples and positions, never means. Divide by
  ``metrics["num_tokens:sum"]`` (or the weight sum) yourself for a mean.
- Logprobs are natural-log probabilities (float32). Training logprobs are
  never temperature-scaled; sampler logprobs are of the temperature-scaled
  distribution.
- Times are Unix seconds (float); durations are seconds.

Client-side validation (`Sample.to_proto`, `validate_samples`) rejects what is
certainly wrong before anything is sent, raising `InvalidArgumentError` that
names the sample index and the key. The server validates again, including the
limits only it knows (vocabulary size, context length, tokens per batch).

Modules: `sample` (`Sample`, `validate_samples`), `loss_config`, `lora_config`,
`adam_params`, `sampling_params`, the results (`forward_result`,
`optim_step_result`, `weights_sync_result`, `load_state_result`,
`sampled_sequence`, `sample_result`, `compute_logprobs_result`),
`checkpoint_info`, `session_info`, `operation_status`, `usage`, `loss_spec`, `capabilities`.
"""

from __future__ import annotations

from together_train.types._checks import TokenArray
from together_train.types.adam_params import AdamParams
from together_train.types.capabilities import Capabilities, SamplingLimits
from together_train.types.checkpoint_info import CheckpointInfo
from together_train.types.compute_logprobs_result import ComputeLogprobsResult
from together_train.types.forward_result import ForwardResult
from together_train.types.load_state_result import LoadStateResult
from together_train.types.lora_config import LoraConfig
from together_train.types.loss_config import loss_config_to_proto
from together_train.types.loss_spec import InputSpec, LossSpec, ParamSpec
from together_train.types.operation_status import OperationStatus
from together_train.types.optim_step_result import OptimStepResult
from together_train.types.sample import Sample, validate_samples
from together_train.types.rollout import Rollout, RolloutCall, RolloutChoice
from together_train.types.sample_result import SampleResult
from together_train.types.sampled_sequence import SampledSequence, VersionSpan
from together_train.types.sampling_params import MIN_TEMPERATURE, SamplingParams
from together_train.types.session_info import SessionInfo
from together_train.types.usage import Usage
from together_train.types.weights_sync_result import WeightsSyncResult

__all__ = [
    "TokenArray",
    "Sample",
    "LoraConfig",
    "AdamParams",
    "SamplingParams",
    "MIN_TEMPERATURE",
    "ForwardResult",
    "OptimStepResult",
    "WeightsSyncResult",
    "LoadStateResult",
    "VersionSpan",
    "SampledSequence",
    "SampleResult",
    "ComputeLogprobsResult",
    "CheckpointInfo",
    "SessionInfo",
    "OperationStatus",
    "Usage",
    "InputSpec",
    "ParamSpec",
    "LossSpec",
    "SamplingLimits",
    "Capabilities",
    "validate_samples",
    "loss_config_to_proto",
    "Rollout",
    "RolloutCall",
    "RolloutChoice",
]
