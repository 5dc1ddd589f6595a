"""What every scheme of the virtual-clock engine shares: the job's settings, its costs,
the workers' speeds (and competing load) on a virtual clock, their batch streams, the
model and its updates, the learning-rate rule and the accuracy recorder.

Only time is virtual: a worker's iteration takes B / v + the fixed costs of `VirtualCosts`
seconds on the clock, without sleeping; its gradient is computed for real (torch, one
process, one gradient after another), so the accuracy is real. Every result says
`clock: virtual`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from fedlb.training import ResizableBatchSampler

VIRTUAL = "virtual"  # the clock every output of the engine names
LR_RULES = ("same", "linear")


@dataclass(frozen=True)
class VirtualCosts:
    """Seconds on the virtual clock besides a worker's compute (B / v).

    iteration_s: every worker iteration (data, optimizer, Python; a parameter server's
        pull and push round trip). Default 0.016.
    allreduce_s: one all-reduce (BSP's, eager-SGD's, local SGD's average). Default 0.005.
    exchange_s: a balancing policy's gather-decide-broadcast on top. Default 0.002.
    local_step_s: a local SGD / Orchestra step (no communication: the optimizer step and
        Python). Default 0.002.

    The defaults are fitted to the 1x row of the measured 4-worker table
    (docs/benchmarks.md): bsp 61 ms, lb-ema 63 ms, asp 56 ms per iteration at 40 ms of
    compute; local_step_s to local-sgd's 41.7 ms at 40 ms. At 64 workers a real
    all-reduce costs more; these stay constant.
    """

    iteration_s: float = 0.016
    allreduce_s: float = 0.005
    exchange_s: float = 0.002
    local_step_s: float = 0.002


@dataclass(frozen=True)
class VirtualJob:
    """One virtual job.

    speeds: samples/s of each worker with its machine to itself.
    batch_size: B, every worker's batch (X = n·B for the synchronous schemes).
    lr: the base learning rate (plain SGD).
    lr_rule: "same": every update at `lr`; "linear": an update over a global batch of b
        samples at lr · b / reference_batch (Goyal et al.'s linear scaling), reached by a
        linear warm-up over the first `warmup` updates. Asynchronous updates (b = B) and
        local steps keep `lr`.
    reference_batch: the batch `lr` was tuned for (default: batch_size).
    lr_max: the linear rule's ceiling (0: none): scaling holds until the lr diverges.
    load: > 0: each worker shares its machine with a competing process that starts or
        stops with this probability every `load_period_s` virtual seconds, taking a CPU
        share drawn in [0.2, 0.75] per episode; the worker's speed is then 1 − 0.8·share
        of its own (the relation of fedlb.experiments.CompetingLoad).
    speed_at: optional (worker, its iteration from 1) -> samples/s, a trace in place of
        `speeds` (the load still applies).
    target: test accuracy to reach (0: none).
    stop_at_target: end the run at the first evaluation at or above `target`.
    patience_s: > 0: end the run when the test accuracy has not beaten its best for this
        many virtual seconds (a stalled or diverged run; 0: never).
    max_seconds, max_samples: the run ends past either (virtual seconds; samples in the
        applied updates, 0: no cap).
    eval_every_s: virtual seconds between evaluations of the model on the test set.
    seed: batch streams (worker w: seed·1009 + w, as the real ranks), load, draws.
    narx_warmup: NARX's EMA reports before it predicts (lb-narx).
    """

    speeds: tuple[float, ...]
    batch_size: int = 32
    lr: float = 0.05
    lr_rule: str = "same"
    warmup: int = 10
    reference_batch: int = 0
    lr_max: float = 0.0
    load: float = 0.0
    load_period_s: float = 0.1
    speed_at: Callable[[int, int], float] | None = None
    target: float = 0.0
    stop_at_target: bool = True
    patience_s: float = 0.0
    max_seconds: float = 60.0
    max_samples: int = 0
    eval_every_s: float = 0.1
    seed: int = 0
    narx_warmup: int = 60
    costs: VirtualCosts = field(default_factory=VirtualCosts)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speeds", tuple(float(v) for v in self.speeds))
        if not self.speeds or min(self.speeds) <= 0 or not all(map(math.isfinite, self.speeds)):
            raise ValueError(f"speeds must be finite and > 0, got {self.speeds}")
        if self.batch_size < 1 or self.warmup < 0 or self.reference_batch < 0:
            raise ValueError("batch_size must be >= 1, warmup and reference_batch >= 0")
        if self.lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule must be one of {', '.join(LR_RULES)}, got {self.lr_rule}")
        if not (self.lr > 0 and 0 <= self.load <= 1 and 0 <= self.target <= 1):
            raise ValueError("lr must be > 0, load a probability, target in [0, 1]")
        if not (self.max_seconds > 0 and self.eval_every_s > 0 and self.load_period_s > 0):
            raise ValueError("max_seconds, eval_every_s and load_period_s must be > 0")

    @property
    def workers(self) -> int:
        return len(self.speeds)


@dataclass(frozen=True)
class VirtualData:
    """Training tensors the workers draw from, and the test tensors evaluated."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


@dataclass
class VirtualResult:
    """One run. `curve`: (virtual seconds, updates, samples, accuracy) at every
    evaluation; `iteration_s`: the virtual wall time over the iterations each worker ran
    (the hardware efficiency, as the measured table's); `samples_to_target`: samples in
    the applied updates at the first evaluation at or above the target. `log`: the
    scheme's own record (per iteration for the synchronous schemes, per gradient for the
    parameter server and eager-SGD)."""

    scheme: str
    workers: int
    clock: str = VIRTUAL
    seconds: float = 0.0
    updates: int = 0
    samples: int = 0
    iterations: list[int] = field(default_factory=list)
    iteration_s: float = 0.0
    time_to_target_s: float | None = None
    samples_to_target: int | None = None
    updates_to_target: int | None = None
    final_accuracy: float = 0.0
    curve: list[tuple[float, int, int, float]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    log: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Everything but the per-iteration log (JSON lines)."""
        return {k: v for k, v in asdict(self).items() if k != "log"}


class VirtualLoad:
    """One worker's competing process on the virtual clock: every period it starts or
    stops with probability `switch_prob`; its speed factor is 1 − 0.8·share while on."""

    def __init__(self, switch_prob: float, period_s: float, seed: int) -> None:
        self.switch_prob = switch_prob
        self.period_s = period_s
        self.rng = random.Random(seed)
        self.factors: list[float] = []
        self.running = False
        self.share = 0.0

    def factor(self, seconds: float) -> float:
        if self.switch_prob <= 0:
            return 1.0
        tick = int(seconds / self.period_s)
        while len(self.factors) <= tick:
            if self.rng.random() < self.switch_prob:
                self.running = not self.running
                if self.running:
                    self.share = self.rng.uniform(0.2, 0.75)
            self.factors.append(1.0 - 0.8 * self.share if self.running else 1.0)
        return self.factors[tick]


class Run:
    """One run's state: the model (the one global model; replicas are flat vectors kept
    by the schemes that need them), the workers' streams and clocks, the recorder."""

    def __init__(self, scheme: str, job: VirtualJob, model: nn.Module, data: VirtualData) -> None:
        self.job = job
        self.model = model
        self.data = data
        self.n = job.workers
        self.params = list(model.parameters())
        self.weights = parameters_to_vector(self.params).detach().clone()
        self.samplers = [
            ResizableBatchSampler(len(data.train_y), job.batch_size, seed=job.seed * 1009 + w)
            for w in range(self.n)
        ]
        self.streams = [iter(s) for s in self.samplers]
        self.loads = [
            VirtualLoad(job.load, job.load_period_s, job.seed * 100 + w) for w in range(self.n)
        ]
        self.result = VirtualResult(scheme, self.n, iterations=[0] * self.n)
        self._started = [0] * self.n  # iterations each worker began
        self.version = 0  # updates applied
        self._evals = 0  # evaluations made: the next is at _evals · eval_every_s
        self._accuracy: tuple[int, float] | None = None  # (version, accuracy)
        self._best = (-1.0, 0.0)  # (best test accuracy, when)
        self.done = False

    # ---- time -----------------------------------------------------------------------------
    def compute_s(self, worker: int, batch: int, now: float) -> float:
        """Seconds worker `worker` computes a batch of `batch` started at `now` (its
        speed at this iteration, the load's factor as it starts)."""
        self._started[worker] += 1
        if self.job.speed_at is not None:
            speed = self.job.speed_at(worker, self._started[worker])
        else:
            speed = self.job.speeds[worker]
        return batch / (speed * self.loads[worker].factor(now))

    def cpu(self, worker: int, now: float) -> float:
        """The CPU use a worker's machine shows at `now` (0.2 + its competitor's share),
        for estimators that read resources (NARX)."""
        return min(1.0, 0.2 + (1.0 - self.loads[worker].factor(now)) / 0.8)

    # ---- data and gradients ---------------------------------------------------------------
    def batch(self, worker: int, size: int) -> torch.Tensor:
        """The next `size` sample indices of worker `worker`'s stream."""
        self.samplers[worker].batch_size = size
        return torch.as_tensor(next(self.streams[worker]), dtype=torch.long)

    def gradient(self, index: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """The mean gradient over the samples `index`, on `weights` (default: the global
        model's), flattened."""
        vector_to_parameters(self.weights if weights is None else weights, self.params)
        self.model.zero_grad()
        x, y = self.data.train_x[index], self.data.train_y[index]
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        return torch.cat([p.grad.reshape(-1) for p in self.params if p.grad is not None])

    def lr(self, global_batch: int) -> float:
        """The learning rate of the next update over `global_batch` samples."""
        job = self.job
        if job.lr_rule == "same":
            return job.lr
        scaled = job.lr * global_batch / (job.reference_batch or job.batch_size)
        scaled = min(scaled, job.lr_max) if job.lr_max else scaled
        if job.warmup and self.version < job.warmup:
            return job.lr + (scaled - job.lr) * (self.version + 1) / job.warmup
        return scaled

    # ---- updates and evaluation -----------------------------------------------------------
    def apply(self, now: float, step: torch.Tensor, samples: int) -> None:
        """weights -= step, landing at virtual time `now` over `samples` samples; the
        evaluations due before it see the weights before it."""
        self.observe(now)
        self.weights -= step
        if not bool(torch.isfinite(self.weights).all()):  # diverged: nothing more to learn
            self.result.extra["diverged_s"] = now
            self.done = True
        self.version += 1
        self.result.samples += samples
        self.result.updates = self.version
        if self.job.max_samples and self.result.samples >= self.job.max_samples:
            self.done = True

    def observe(self, now: float) -> None:
        """Evaluate at every evaluation time up to `now`; ends the run past the limits."""
        while (seconds := round(self._evals * self.job.eval_every_s, 9)) <= now and not self.done:
            accuracy = self.accuracy()
            self.result.curve.append(
                (seconds, self.version, self.result.samples, round(accuracy, 5))
            )
            target = self.job.target
            if target and accuracy >= target and self.result.time_to_target_s is None:
                self.result.time_to_target_s = seconds
                self.result.samples_to_target = self.result.samples
                self.result.updates_to_target = self.version
                self.done = self.job.stop_at_target
            if accuracy > self._best[0]:
                self._best = (accuracy, seconds)
            elif self.job.patience_s and seconds - self._best[1] > self.job.patience_s:
                self.result.extra["stalled_s"] = seconds
                self.done = True
            self._evals += 1
        if now > self.job.max_seconds:
            self.done = True
        self.result.seconds = max(self.result.seconds, min(now, self.job.max_seconds))

    def accuracy(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> float:
        """The global model's accuracy on (x, y) (default: the test set; cached)."""
        if x is None and self._accuracy is not None and self._accuracy[0] == self.version:
            return self._accuracy[1]
        vector_to_parameters(self.weights, self.params)
        with torch.no_grad():
            xs = self.data.test_x if x is None else x
            ys = self.data.test_y if y is None else y
            accuracy = float((self.model(xs).argmax(dim=1) == ys).float().mean())
        if x is None:
            self._accuracy = (self.version, accuracy)
        return accuracy

    def finish(self) -> VirtualResult:
        result = self.result
        result.final_accuracy = self.accuracy()
        if not result.curve or result.curve[-1][1] != self.version:
            result.curve.append(
                (result.seconds, self.version, result.samples, result.final_accuracy)
            )
        done = sum(result.iterations) / self.n
        result.iteration_s = result.seconds / done if done else 0.0
        vector_to_parameters(self.weights, self.params)
        return result
