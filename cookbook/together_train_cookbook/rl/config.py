"""Settings of the RL loop (`rl.train.run`). A recipe's ``Config`` subclasses this one, adds its
task's fields (data, batch shape) and may change defaults; every field is a flag
(``num_samples`` -> ``--num-samples``, `cli.parse_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from together_train_cookbook.cli import ConfigError
from together_train_cookbook.connection import Connection

LOSSES = ("importance_sampling", "ppo", "cispo", "grpo")


@dataclass
class Config(Connection):
    """RL loop settings: resource, session, loss and optimizer, sampling, schedule, output."""

    init_from: str | None = field(
        default=None, metadata={"help": "training checkpoint URI or SFT run dir to start from (fresh optimizer)"}
    )
    resume: bool = field(default=False, metadata={"help": "continue from the last save_state in --out-dir"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank (fresh sessions)"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (fresh sessions)"})
    loss: str = field(default="importance_sampling", metadata={"help": "policy loss", "choices": LOSSES})
    loss_config: str = field(default="", metadata={"help": 'loss parameters as JSON, e.g. {"clip_high_threshold": 1.3}'})
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate (constant)"})
    grad_clip_norm: float = field(default=0.0, metadata={"help": "0 = off"})
    steps: int = field(default=20, metadata={"help": "optimizer steps (0 = evaluate the start, save it)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    max_tokens: int = field(default=8, metadata={"help": "max new tokens per turn"})
    async_mode: bool = field(default=False, metadata={"help": "sample step k+1 while training step k (1-step off-policy)"})
    eval_every: int = field(default=5, metadata={"help": "held-out evaluation every N steps (and at the end); 0 = end only"})
    eval_at_start: bool = field(default=True, metadata={"help": "evaluate before the first step"})
    seed: int = field(default=0, metadata={"help": "prompts, sampler seeds, LoRA init, held-out split"})
    save_every: int = field(default=10, metadata={"help": "save_state every N steps (0 = only at the end)"})
    stop_after: int = field(default=0, metadata={"help": "stop after N steps of this run, as if killed", "hidden": True})
    out_dir: str | None = field(default=None, metadata={"help": "default runs/<recipe>-<timestamp>"})
    tensorboard: bool = field(default=False, metadata={"help": "also write TensorBoard event files (OUT_DIR/tensorboard)"})
    wandb_project: str | None = field(default=None, metadata={"help": "also log to this Weights & Biases project"})
    adapter_name: str = field(default="rl-final", metadata={
        "help": "name of the saved adapter (the session id's first 8 characters are appended)"})

    def check(self) -> None:
        """The loop's own settings (`cli.validate` runs this before the shared checks)."""
        if self.loss not in LOSSES:
            raise ConfigError(f"--loss {self.loss}: must be one of {', '.join(LOSSES)}")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens {self.max_tokens}: must be >= 1")
