"""Engines: trainer and generator backends (torch + transformers + peft).

No gRPC and no generated wire code here; inputs and outputs are plain Python,
numpy and torch (see docs/internals.md). Heavy modules (torch_trainer,
torch_generator) are imported lazily by the caller.
"""

from .types import (  # noqa: F401
    AdamParams,
    ForwardOutput,
    GenOutput,
    SamplingParams,
    GenSequence,
    LoraConfig,
    OptimOutput,
    Sample,
)
