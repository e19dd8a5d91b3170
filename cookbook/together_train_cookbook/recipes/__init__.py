"""Recipes: one file each (`sft`, `rl`, `dpo`, `distill`, `main`), a ``Config`` dataclass whose fields are the
command-line flags and builders for the data or envs, run by the supervised or the RL loop."""
