"""together-train cookbook: codecs, sample builders, tasks, recipes, metrics and plots.

- `get_codec(tokenizer)` renders chats with the tokenizer's own chat template into
  tokens + a per-token train mask (assistant turns only).
- `build_cross_entropy_sample(tokens, weights)` takes one value per token and
  returns a shifted `together_train.Sample`; `build_policy_sample(tokens, logprobs,
  advantages, ...)` does the same for the policy losses.
- `custom_loss.forward_backward_custom` runs a client-side loss (e.g. `custom_loss.dpo_loss`)
  through `forward` + `custom_forward_backward`.
- `tasks.ArithmeticTask`: a generated, strictly checkable task.
- `supervised`: the supervised loop (``supervised.train.train``) over a `SupervisedDataset`
  with a loss object (`CrossEntropy`, or a client-side one such as DPO's) and evaluators.
- `data.load_rows(path, split=None)`: rows of our JSONL or a local Hugging Face dataset
  (JSON / Parquet file, ``save_to_disk`` dir); never a hub download.
- `recipes.sft`, `recipes.rl`, `recipes.dpo`, `recipes.distill`, `recipes.main` (SFT then RL):
  ``python -m together_train_cookbook.recipes.<name> --help``.
- `metrics.MetricsWriter`, `plotting.plot_loss`: JSONL metrics and PNG curves.
- `ml_log.setup_logging`: one logger for metrics.jsonl, TensorBoard and Weights & Biases.

Imports only the SDK and (inside functions) transformers tokenizers / matplotlib;
never the server or torch.
"""

from together_train_cookbook.codec import Codec, RenderedConversation, TemplateNotPrefixStableError, get_codec
from together_train_cookbook.samples import (
    build_cross_entropy_sample,
    build_policy_sample,
    build_sample,
    conversation_to_sample,
    conversation_to_samples,
)

__all__ = [
    "Codec",
    "RenderedConversation",
    "TemplateNotPrefixStableError",
    "get_codec",
    "build_cross_entropy_sample",
    "build_policy_sample",
    "build_sample",
    "conversation_to_sample",
    "conversation_to_samples",
]
