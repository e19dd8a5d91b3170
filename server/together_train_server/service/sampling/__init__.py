"""Sampling: the replica sampler every API samples through (`replica_sampler`), fixed-weight snapshots
(`snapshots`), the HTTP entry points (`ops`), OpenAI inference (`inference`, `openai_params`, `chat_tools`,
`model_catalog`), recorded rollouts (`rollouts`), and sampling as a session operation (`session_ops`)."""
