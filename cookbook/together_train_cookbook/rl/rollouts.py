"""Rollouts: run a batch of env groups against a session's sampler, every env in flight at once.

Turn by turn: `submit_rollouts` makes the envs and submits the first turn's sample requests
(returns at once); `PendingRollouts.collect` waits for them, steps each env, submits the next
turn of the envs still going, and so on until every episode is done. The requests of one turn
are all submitted before any is waited on, so the generator batches them.

Requests: within a group, envs whose observations are equal share one request with
``num_samples`` = their count (the first turn of a GRPO group is one request, as a plain
``sample(prompt, num_samples=G)``); the sampler seed is a function of (seed, step, group, turn,
env), so a run is reproducible and a resumed run samples what the uninterrupted one did.

Versions: ``sample`` is served by the last ``weights_sync`` submitted before it. In async mode the
loop submits step k+1's first turn before step k trains (one step stale); later turns are
submitted when the loop collects, after step k's sync (on-policy). Each token records its version.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import together_train as tt

from together_train_cookbook.rl.env import Env
from together_train_cookbook.rl.env_group import EnvGroupBuilder
from together_train_cookbook.rl.trajectory import RolloutBatch, Trajectory, TrajectoryGroup, Transition

MAX_TURNS = 100  # an env that never ends is a bug in the env; fail instead of sampling forever


@dataclass(frozen=True)
class SamplingSettings:
    """How actions are sampled: `max_tokens` per turn, `temperature` (keep 1.0 so the sampler's q
    and the trainer's p describe one distribution), stop tokens / strings (the codec's end of turn)."""

    max_tokens: int
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def params(self, seed: int | None) -> tt.SamplingParams:
        return tt.SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=seed,
                                 stop_token_ids=list(self.stop_token_ids), stop=list(self.stop_strings))


def sampler_seed(seed: int, step: int, j: int, turn: int = 0, env: int = 0) -> int:
    """Sampler seed of group j of `step` (turn 0, env 0: the group's shared first request, as the
    single-turn recipe always seeded it); any other request mixes in (turn, env). Its ``num_samples`` streams use (seed, i) server-side."""
    base = seed * 1_000_003 + step * 10_007 + j
    if turn or env:
        base = base * 131 + turn * 65_537 + env * 257
    return base % (2**31 - 1)


def _token_versions(seq: tt.SampledSequence, served_by: int) -> list[int]:
    versions = [served_by] * len(seq.tokens)
    for span in seq.version_spans:
        versions[span.start:span.end] = [span.policy_version] * (span.end - span.start)
    return versions


class PendingRollouts:
    """A step's rollouts in flight; `collect` finishes them. Build with `submit_rollouts`."""

    def __init__(self, session: tt.Session, builders: Sequence[EnvGroupBuilder], sampling: SamplingSettings,
                 step: int, seed: int) -> None:
        self.session, self.builders, self.sampling, self.step, self.seed = session, builders, sampling, step, seed
        self.envs: list[list[Env]] = [list(b.make_envs()) for b in builders]
        self.transitions: list[list[list[Transition]]] = [[[] for _ in g] for g in self.envs]
        self.observations = [[env.initial_observation() for env in g] for g in self.envs]
        self.submitted_at, self.done_at = time.time(), []
        self.turn = 0
        self.prompt_tokens = self.prompt_cache_hit_tokens = 0   # over the requests (one prompt each)
        self.requests = self._submit([(j, i) for j, g in enumerate(self.envs) for i in range(len(g))])

    def _submit(self, active: list[tuple[int, int]]) -> list[tuple[list[tuple[int, int]], tt.OperationFuture]]:
        """One request per (group, distinct observation) among the `active` (group, env) pairs."""
        clusters: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = {}
        for j, i in active:
            clusters.setdefault((j, tuple(self.observations[j][i])), []).append((j, i))
        out = []
        for (j, obs), members in clusters.items():
            seed = sampler_seed(self.seed, self.step, j, self.turn, members[0][1])
            fut = self.session.sample(list(obs), self.sampling.params(seed), num_samples=len(members))
            fut.add_done_callback(lambda _f: self.done_at.append(time.time()))
            out.append((members, fut))
        return out

    def collect(self) -> RolloutBatch:
        """Wait for every turn of every env; returns the graded batch."""
        while self.requests:
            active = []
            for members, fut in self.requests:
                res = fut.result()
                self.prompt_tokens += len(self.observations[members[0][0]][members[0][1]])
                self.prompt_cache_hit_tokens += int(getattr(res, "prompt_cache_hit_tokens", 0))
                for (j, i), seq in zip(members, res.sequences):
                    env = self.envs[j][i]
                    out = env.step(list(seq.tokens))
                    self.transitions[j][i].append(Transition(
                        list(self.observations[j][i]), list(seq.tokens), [float(x) for x in seq.logprobs],
                        _token_versions(seq, res.policy_version), float(out.reward), bool(out.episode_done),
                        {k: float(v) for k, v in out.metrics.items()}))
                    if not out.episode_done:
                        if out.next_observation is None:
                            raise ValueError(f"{type(env).__name__}.step: episode not done but no next_observation")
                        self.observations[j][i] = list(out.next_observation)
                        active.append((j, i))
            self.turn += 1
            if active and self.turn >= MAX_TURNS:
                raise RuntimeError(f"an episode of step {self.step} ran {MAX_TURNS} turns without ending")
            self.requests = self._submit(active) if active else []
        groups = []
        for b, trs in zip(self.builders, self.transitions):
            trajs = [Trajectory(t) for t in trs]
            groups.append(TrajectoryGroup(trajs, [float(r) for r in b.compute_group_rewards(trajs)]))
        span = max(self.done_at, default=time.time()) - self.submitted_at
        return RolloutBatch(self.step, groups, span, self.prompt_tokens, self.prompt_cache_hit_tokens)


def submit_rollouts(session: tt.Session, builders: Sequence[EnvGroupBuilder], sampling: SamplingSettings,
                    step: int, seed: int) -> PendingRollouts:
    """Make the envs of `builders` and submit their first turn (returns at once)."""
    return PendingRollouts(session, builders, sampling, step, seed)
