"""Supervised learning: one pipelined loop (`train.train`) over a dataset of batches, with a
loss object and evaluators. SFT is chats + `CrossEntropy`; DPO is preference pairs + a
client-side loss (`dpo.DPO`, run by `recipes.dpo`).

- `dataset`: `SupervisedDataset` (batch of step k, a pure function of k), `ShuffledDataset`;
- `chat`: chat rows -> ``cross_entropy`` samples (`load_chats`, `chat_dataset`);
- `preference`: preference pairs (`PreferencePair`, `load_pairs`, `pair_samples`);
- `dpo`: the `DPO` loss (frozen reference session, optionally online) and `HeldOutPreferences`;
- `loss`: `SupervisedLoss` (what a step does before ``optim_step``), `CrossEntropy`;
- `evaluators`: `Evaluator`, `GreedyAccuracy`;
- `schedule`: `learning_rate_at` (constant / linear, warmup);
- `train`: the loop's `Config` (recipes subclass it) and ``train.train(cfg, dataset, ...)``
  (the function is not re-exported here: ``supervised.train`` stays the module).

Imports only the SDK at module level (as the rest of the cookbook).
"""

from together_train_cookbook.supervised.dataset import ShuffledDataset, SupervisedDataset
from together_train_cookbook.supervised.evaluators import Evaluation, Evaluator, GreedyAccuracy
from together_train_cookbook.supervised.loss import CrossEntropy, SupervisedLoss
from together_train_cookbook.supervised.schedule import learning_rate_at
from together_train_cookbook.supervised.train import Config, Result

__all__ = ["Config", "CrossEntropy", "Evaluation", "Evaluator", "GreedyAccuracy", "Result", "ShuffledDataset",
           "SupervisedDataset", "SupervisedLoss", "learning_rate_at"]
