"""NARX speed prediction for shared CPU clusters (LB-BSP Section 3.2.2, Algorithm 1).

v^k = F(v^{k-1}, v^{k-2}, c^k, c^{k-1}, c^{k-2}, m^k, m^{k-1}, m^{k-2}): the next speed from
the last two speeds and the CPU and memory use now and two reports back, through one hidden
layer. One model per worker, trained online on its own history with early stopping, used
once `warmup` reports have been seen (an EMA answers before), and able to start from weights
saved from another worker or job (model reuse), in which case it answers from the start.

torch is imported only when a model is trained; prediction is a small numpy forward pass so
the per-iteration cost stays in microseconds.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .estimators import EMA, SpeedEstimator
from .reports import WorkerReport

log = logging.getLogger("fedlb.balance")

LOOK_BACK = 2
N_INPUTS = LOOK_BACK + 2 * (LOOK_BACK + 1)  # 2 speeds, 3 CPU and 3 memory readings


class NARX(SpeedEstimator):
    """Nonlinear autoregressive model with exogenous CPU/memory inputs.

    Args:
        hidden: units in the one hidden layer (tanh). Default 16.
        warmup: reports to collect before the model is trained and used; an EMA(α=0.2)
            predicts until then. Default 500, the paper's setting.
        retrain_every: reports between online re-trainings. Default 50.
        history: reports kept for training (a sliding window). Default 1000.
        max_epochs: full-batch Adam epochs per training at most. Default 300.
        patience: early stopping, epochs without validation improvement. Default 10.
        lr: Adam learning rate. Default 0.01.
        seed: torch seed for the initial weights. Default 0.
        weights: a `weights()` result from another NARX (model reuse): the model predicts
            from its first full look-back window and keeps training online.

    Reports without `cpu` or `mem` cannot drive the model; for them the EMA answers and a
    warning is logged once.
    """

    kind = "narx"

    def __init__(
        self,
        hidden: int = 16,
        warmup: int = 500,
        retrain_every: int = 50,
        history: int = 1000,
        max_epochs: int = 300,
        patience: int = 10,
        lr: float = 0.01,
        seed: int = 0,
        weights: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if hidden < 1 or warmup < LOOK_BACK + 2 or retrain_every < 1 or patience < 1:
            raise ValueError(
                "NARX needs hidden >= 1, warmup >= 4, retrain_every >= 1 and patience >= 1"
            )
        if history < warmup:
            raise ValueError(f"history ({history}) must be >= warmup ({warmup})")
        self.hidden = hidden
        self.warmup = warmup
        self.retrain_every = retrain_every
        self.max_epochs = max_epochs
        self.patience = patience
        self.lr = lr
        self.seed = seed
        self.fallback = EMA(alpha=0.2)
        self.speeds: deque[float] = deque(maxlen=history)
        self.cpu: deque[float] = deque(maxlen=history)
        self.mem: deque[float] = deque(maxlen=history)
        self.trained_at: int | None = None  # observation count at the last training
        self.last_epochs = 0
        self._net: dict[str, NDArray[np.float64]] | None = None
        self._warned_missing = False
        if weights is not None:
            self.load_weights(weights)

    # ---- model reuse -------------------------------------------------------------------
    def weights(self) -> dict[str, Any]:
        """The trained network as plain lists (JSON-serialisable), for reuse elsewhere."""
        if self._net is None:
            raise ValueError("this NARX has not been trained yet: there are no weights to save")
        return {k: v.tolist() for k, v in self._net.items()}

    def load_weights(self, weights: dict[str, Any]) -> None:
        net = {k: np.asarray(weights[k], dtype=np.float64) for k in ("w1", "b1", "w2", "b2")}
        if net["w1"].shape[1] != N_INPUTS or net["w2"].shape[0] != net["w1"].shape[0]:
            raise ValueError(
                f"NARX weights do not fit: w1 {net['w1'].shape}, w2 {net['w2'].shape}; "
                f"expected w1 (hidden, {N_INPUTS}) and w2 (hidden,)"
            )
        self.hidden = net["w1"].shape[0]
        self._net = net

    @property
    def using_model(self) -> bool:
        """Whether predict() answers from the network (else from the warm-up EMA)."""
        return self._net is not None and len(self.speeds) > LOOK_BACK

    # ---- estimator interface -----------------------------------------------------------
    def update(self, report: WorkerReport) -> None:
        self.observations += 1
        self.fallback.update(report)
        if report.cpu is None or report.mem is None:
            if not self._warned_missing:
                log.warning(
                    "worker %s reports no cpu/mem use: NARX cannot use its resources and "
                    "falls back to EMA for it",
                    report.worker,
                )
                self._warned_missing = True
            self.speeds.clear()
            self.cpu.clear()
            self.mem.clear()
            return
        self.speeds.append(report.speed)
        self.cpu.append(report.cpu)
        self.mem.append(report.mem)
        due = self.trained_at is None or self.observations - self.trained_at >= self.retrain_every
        # A reused model is fine-tuned as soon as a little local history exists.
        needed = self.warmup if self._net is None else min(self.warmup, max(self.retrain_every, 10))
        if len(self.speeds) >= needed and due:
            self._train()

    def predict(self) -> float:
        if not self.ready:
            raise self._not_ready()
        if not self.using_model:
            return self.fallback.predict()
        assert self._net is not None
        scale = self._scale()
        x = self._features(len(self.speeds), scale)
        h = np.tanh(self._net["w1"] @ x + self._net["b1"])
        predicted = float(self._net["w2"] @ h + self._net["b2"][0]) * scale
        # A network can extrapolate to nonsense on inputs it never saw: never predict
        # below a tenth of the slowest or above ten times the fastest speed seen.
        low, high = min(self.speeds) / 10.0, max(self.speeds) * 10.0
        if not math.isfinite(predicted):
            return self.fallback.predict()
        return min(max(predicted, low), high)

    # ---- internals ---------------------------------------------------------------------
    def _scale(self) -> float:
        return float(np.mean(self.speeds))

    def _features(self, end: int, scale: float) -> NDArray[np.float64]:
        """Inputs to predict the speed of iteration `end` from reports [.. end-1].

        Report j carries v^j (the iteration just run) and c, m measured after it, which
        drive iteration j+1; so for target `end` the newest resources are at end-1.
        """
        v, c, m = self.speeds, self.cpu, self.mem
        return np.array(
            [v[end - 1] / scale, v[end - 2] / scale]
            + [c[end - 1 - i] for i in range(LOOK_BACK + 1)]
            + [m[end - 1 - i] for i in range(LOOK_BACK + 1)],
            dtype=np.float64,
        )

    def _dataset(self, scale: float) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        first = LOOK_BACK + 1  # c[end-3] must exist
        ends = range(first, len(self.speeds))
        x = np.stack([self._features(e, scale) for e in ends])
        y = np.array([self.speeds[e] / scale for e in ends], dtype=np.float64)
        return x, y

    def _train(self) -> None:
        import torch  # lazily: only clusters that use NARX pay for the import

        scale = self._scale()
        x_all, y_all = self._dataset(scale)
        split = max(1, int(len(x_all) * 0.8))
        x = torch.as_tensor(x_all, dtype=torch.float32)
        y = torch.as_tensor(y_all, dtype=torch.float32).unsqueeze(1)
        x_train, y_train, x_val, y_val = x[:split], y[:split], x[split:], y[split:]
        if len(x_val) == 0:
            x_val, y_val = x_train, y_train

        generator = torch.Generator().manual_seed(self.seed)
        first, second = torch.nn.Linear(N_INPUTS, self.hidden), torch.nn.Linear(self.hidden, 1)
        net = torch.nn.Sequential(first, torch.nn.Tanh(), second)
        with torch.no_grad():
            if self._net is not None:  # warm start: online training continues the model
                first.weight.copy_(torch.as_tensor(self._net["w1"]))
                first.bias.copy_(torch.as_tensor(self._net["b1"]))
                second.weight.copy_(torch.as_tensor(self._net["w2"]).unsqueeze(0))
                second.bias.copy_(torch.as_tensor(self._net["b2"]))
            else:
                for p in net.parameters():
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        optimiser = torch.optim.Adam(net.parameters(), lr=self.lr)
        loss_fn = torch.nn.MSELoss()
        best = math.inf
        best_state = [p.detach().clone() for p in net.parameters()]
        stale = epochs = 0
        for epochs in range(1, self.max_epochs + 1):  # noqa: B007 (used after the loop)
            optimiser.zero_grad()
            loss_fn(net(x_train), y_train).backward()
            optimiser.step()
            with torch.no_grad():
                val = float(loss_fn(net(x_val), y_val))
            if val < best - 1e-9:
                best, stale = val, 0
                best_state = [p.detach().clone() for p in net.parameters()]
            else:
                stale += 1
                if stale >= self.patience:
                    break
        w1, b1, w2, b2 = (t.double().numpy() for t in best_state)
        self._net = {"w1": w1, "b1": b1, "w2": w2.reshape(-1), "b2": b2.reshape(-1)}
        self.trained_at = self.observations
        self.last_epochs = epochs

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "fallback": self.fallback.state_dict(),
            "speeds": list(self.speeds),
            "cpu": list(self.cpu),
            "mem": list(self.mem),
            "trained_at": self.trained_at,
            "weights": self.weights() if self._net is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.fallback.load_state_dict(state["fallback"])
        for name in ("speeds", "cpu", "mem"):
            target: deque[float] = getattr(self, name)
            target.clear()
            target.extend(float(x) for x in state[name])
        self.trained_at = state["trained_at"]
        self._net = None
        if state["weights"] is not None:
            self.load_weights(state["weights"])
