"""Orchestra (Du et al., CF'22): local SGD whose per-worker local steps are balanced so all
workers reach the synchronisation barrier together, with the barrier tuned by an
actor-critic agent.

- Load Balance Controller (`lcm_barrier`): with t_n the seconds worker n takes per batch,
  the barrier T is searched among the common multiples of the t_n (the least-common-
  multiple principle): from T = max t_n upwards, each candidate a multiple of some t_n,
  its idle time max_n (T mod t_n), until the local steps' spread max τ_n − min τ_n
  (τ_n = ⌊T/t_n⌋) passes the bound M; the candidate with the least idle time is T*.
- Barrier Controller (`BarrierAgent`): an online actor-critic that, at every decision,
  moves T by one step (one batch of the fastest worker) up, down, or keeps it. State:
  training progress (rounds done, mean local steps), training accuracy, the last round's
  waiting share. Reward +1 / −1 / 0 as the rate p = Δacc / time · √steps beats, trails or
  equals a baseline: the paper's is the best p so far (Section 3.1.3), which the steep
  early rounds set, so that afterwards nearly every reward is −1 whatever the action and
  the barrier drifts to its floor (measured: docs/benchmarks.md); fedlb's default is a
  moving baseline, an exponential average of the recent p, which falls as training slows
  and keeps the reward saying whether the last move helped.
- τ_n = T / t_n: each worker's local steps before the models are averaged.

The agent is a small torch network trained online on one environment (the job): an A2C,
which is what A3C reduces to with one worker. Its cost per decision is measured
(`decision_s`); it runs on rank 0 between rounds, where the ranks wait for the average.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

ACTIONS = (-1, 0, 1)  # the barrier one step down, kept, one step up
BASELINES = ("moving", "best")  # what a round's rate is rewarded against


@dataclass(frozen=True)
class Barrier:
    """A barrier and what it gives each worker: seconds T, local steps τ_n, the idle time
    the slowest-to-fit worker has before T."""

    seconds: float
    steps: tuple[int, ...]
    idle_s: float


def steps_for(seconds: float, batch_times: Sequence[float]) -> tuple[int, ...]:
    """τ_n = ⌊T / t_n⌋, at least 1: the batches each worker fits before the barrier."""
    return tuple(max(1, math.floor(seconds / t + 1e-9)) for t in batch_times)


def lcm_barrier(batch_times: Sequence[float], bound: int, max_candidates: int = 10_000) -> Barrier:
    """The Load Balance Controller's search (see the module docstring).

    Args:
        batch_times: t_n, seconds per batch of each worker (> 0).
        bound: M, the largest spread of local steps allowed (>= 0).
        max_candidates: a cap on the candidates tried (the search is O(M·N) in practice).
    """
    if not batch_times or min(batch_times) <= 0 or not all(map(math.isfinite, batch_times)):
        raise ValueError(f"batch times must be finite and > 0, got {list(batch_times)}")
    if bound < 0:
        raise ValueError(f"the local-step bound M must be >= 0, got {bound}")
    start = max(batch_times)
    best: Barrier | None = None
    multiples = [max(1, math.ceil(start / t - 1e-9)) for t in batch_times]
    for _ in range(max_candidates):
        # the next candidate: the smallest pending multiple of any worker's batch time
        n = min(range(len(batch_times)), key=lambda i: multiples[i] * batch_times[i])
        seconds = multiples[n] * batch_times[n]
        multiples[n] += 1
        steps = steps_for(seconds, batch_times)
        if max(steps) - min(steps) > bound:
            break
        idle = max(seconds - s * t for s, t in zip(steps, batch_times, strict=True))
        if best is None or idle < best.idle_s - 1e-12:
            best = Barrier(seconds, steps, idle)
    if best is None:  # even T = max t_n spreads the steps past M: the slowest sets T
        return Barrier(start, steps_for(start, batch_times), 0.0)
    return best


class _ActorCritic(nn.Module):
    def __init__(self, inputs: int, hidden: int = 32) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh())
        self.policy = nn.Linear(hidden, len(ACTIONS))
        self.value = nn.Linear(hidden, 1)

    def forward(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.trunk(state)
        return self.policy(hidden), self.value(hidden).squeeze(-1)


@dataclass(frozen=True)
class Decision:
    """One decision of the agent: its action, the reward it learnt from (of the previous
    action), the barrier level after it, and its cost in seconds."""

    action: int
    reward: float
    level: int
    decision_s: float


class BarrierAgent:
    """The Barrier Controller: an online actor-critic over {−1, 0, +1} barrier steps.

    Args:
        seed: the network's initialisation and the action sampling.
        lr: Adam's learning rate. Default 0.01.
        gamma: discount of the next state's value. Default 0.9.
        entropy: weight of the exploration bonus. Default 0.01.
        max_level: the largest number of steps the barrier moves from T*. Default 20.
        baseline: what a round's rate p is compared with: "moving" (the default: an
            exponential average of the recent p, weight `smoothing` for the newest) or
            "best" (the paper's: the best p so far).
        smoothing: the moving baseline's weight of the newest p. Default 0.5 (a baseline
            that lags a falling rate too far rewards nothing).
    """

    STATE = 4  # progress, mean local steps / 100, training accuracy, waiting share

    def __init__(
        self,
        seed: int = 0,
        lr: float = 0.01,
        gamma: float = 0.9,
        entropy: float = 0.01,
        max_level: int = 20,
        baseline: str = "moving",
        smoothing: float = 0.5,
    ) -> None:
        if baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {', '.join(BASELINES)}, got {baseline!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.baseline = baseline
        self.smoothing = smoothing
        torch.manual_seed(seed)
        self.network = _ActorCritic(self.STATE)
        self.optimizer = torch.optim.Adam(self.network.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.gamma = gamma
        self.entropy = entropy
        self.max_level = max_level
        self.level = 0
        self.baseline_rate: float | None = None
        self.history: list[Decision] = []
        self._last: tuple[torch.Tensor, int] | None = None  # (state, action index)
        self._accuracy: float | None = None

    def reward(self, accuracy: float, seconds: float, steps: int) -> float:
        """+1 / −1 / 0 as p = Δacc/time·√steps beats / trails / equals the baseline."""
        if self._accuracy is None:
            self._accuracy = accuracy
            return 0.0
        rate = (accuracy - self._accuracy) / max(seconds, 1e-9) * math.sqrt(max(steps, 1))
        self._accuracy = accuracy
        if self.baseline_rate is None:
            self.baseline_rate = rate
            return 0.0
        sign = (rate > self.baseline_rate) - (rate < self.baseline_rate)
        if self.baseline == "best":
            self.baseline_rate = max(self.baseline_rate, rate)
        else:
            self.baseline_rate += self.smoothing * (rate - self.baseline_rate)
        return float(sign)

    def decide(
        self, progress: float, mean_steps: float, accuracy: float, waiting: float, seconds: float
    ) -> Decision:
        """After a round: learn from the last action's reward, choose the next step."""
        began = time.perf_counter()
        state = torch.tensor([progress, mean_steps / 100.0, accuracy, waiting], dtype=torch.float32)
        reward = self.reward(accuracy, seconds, round(mean_steps))
        logits, value = self.network(state)
        if self._last is not None:  # one actor-critic step on (s, a, r, s')
            previous, action = self._last
            old_logits, old_value = self.network(previous)
            advantage = reward + self.gamma * value.detach() - old_value
            log_probabilities = torch.log_softmax(old_logits, dim=-1)
            entropy = -(log_probabilities.exp() * log_probabilities).sum()
            loss = (
                -log_probabilities[action] * advantage.detach()
                + 0.5 * advantage.pow(2)
                - self.entropy * entropy
            )
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            logits = self.network(state)[0]
        probabilities = torch.softmax(logits.detach(), dim=-1)
        index = int(torch.multinomial(probabilities, 1, generator=self.generator))
        self.level = max(-self.max_level, min(self.max_level, self.level + ACTIONS[index]))
        self._last = (state, index)
        decision = Decision(ACTIONS[index], reward, self.level, time.perf_counter() - began)
        self.history.append(decision)
        return decision


def barrier_steps(base: Barrier, level: int, batch_times: Sequence[float]) -> Barrier:
    """The barrier `level` steps (one batch of the fastest worker each) from T*: never
    below the slowest worker's one batch."""
    seconds = max(max(batch_times), base.seconds + level * min(batch_times))
    steps = steps_for(seconds, batch_times)
    idle = max(seconds - s * t for s, t in zip(steps, batch_times, strict=True))
    return Barrier(seconds, steps, idle)
