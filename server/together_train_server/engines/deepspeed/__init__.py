"""The DeepSpeed ZeRO trainer (``--trainer deepspeed``): the `TrainerEngine` interface across ranks.

Split as vLLM splits executor from worker:

- `engine.DeepSpeedTrainerEngine`: what rank 0's service calls; builds the worker and the executor.
- `ranks.RankExecutor`: rank 0 broadcasts each operation, every rank runs it; heartbeats, `RankFailure`.
- `worker.DeepSpeedWorker`: a `TorchTrainerEngine` run on every rank (data-parallel forward, ZeRO step),
  one subclass per layout: `lora_zero12.LoraZero12Worker`, `lora_zero3.LoraZero3Worker`, `full.FullWorker`.
- `loading`: ZeRO-3 partitioned model loading (no rank holds the whole model).
- `config`: the DeepSpeed config and the user's overrides.

How the layouts train, their checkpoints and failure handling: docs/multi_gpu.md.
"""

from .config import deepspeed_available, merge_config
from .engine import DeepSpeedTrainerEngine
from .errors import FullModeError
from .ranks import RankFailure, init_distributed

__all__ = ["DeepSpeedTrainerEngine", "FullModeError", "RankFailure", "deepspeed_available", "init_distributed",
           "merge_config"]
