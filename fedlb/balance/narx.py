"""NARX speed prediction for shared CPU clusters (LB-BSP Section 3.2.2, Algorithm 1).

v^k = F(v^{k-1}, v^{k-2}, c^k, c^{k-1}, c^{k-2}, m^k, m^{k-1}, m^{k-2}): the next speed from
the last two speeds and the CPU and memory use now and two reports back, through one hidden
layer. One model per worker, trained online on its own history with early stopping, used
once `warmup` reports have been seen (an EMA answers before), and able to start from weights
saved from another worker or job (model reuse), in which case it answers from the start.

Training and prediction are numpy: the network is tiny, and torch's per-operation overhead
would cost more than the arithmetic (see _train).
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
        retrain_every: reports between online re-trainings. Default 50 (each takes a few
            ms here; see benchmarks/balance.py).
        history: reports kept for training (a sliding window). Default 1000.
        max_epochs: full-batch Adam epochs per training at most. Default 300.
        patience: early stopping, epochs without validation improvement. Default 30: with
            10, full-batch Adam stopped on the noise of the validation loss before the model
            had learnt more than the mean speed (measured on a real competing-load trace:
            RMSE 8% below EMA's with 10, 34% with 30 and retraining every 50 reports).
        lr: Adam learning rate. Default 0.01.
        seed: seed of the initial weights. Default 0.
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
        patience: int = 30,
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
        self._speed_sum = 0.0  # running sum of `speeds`, for the scale
        self._seen = (math.inf, 0.0)  # slowest and fastest speed seen
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

    def _clear_history(self) -> None:
        self.speeds.clear()
        self.cpu.clear()
        self.mem.clear()
        self._speed_sum = 0.0

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
            self._clear_history()
            return
        if len(self.speeds) == self.speeds.maxlen:
            self._speed_sum -= self.speeds[0]
        self.speeds.append(report.speed)
        self._speed_sum += report.speed
        self._seen = (min(self._seen[0], report.speed), max(self._seen[1], report.speed))
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
        v, c, m = self.speeds, self.cpu, self.mem
        x = np.array([v[-1] / scale, v[-2] / scale, c[-1], c[-2], c[-3], m[-1], m[-2], m[-3]])
        net = self._net
        predicted = float(net["w2"] @ np.tanh(net["w1"] @ x + net["b1"]) + net["b2"][0]) * scale
        if not math.isfinite(predicted):
            return self.fallback.predict()
        # A network can extrapolate to nonsense on inputs it never saw: keep the prediction
        # within a factor of ten of the speeds this worker has shown.
        return min(max(predicted, self._seen[0] / 10.0), self._seen[1] * 10.0)

    # ---- internals ---------------------------------------------------------------------
    def _scale(self) -> float:
        # Speeds enter the network relative to the worker's own mean, so one model fits
        # workers of any speed (model reuse) and training stays well conditioned.
        return self._speed_sum / len(self.speeds)

    def _dataset(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Training pairs: inputs for target v^e are v^{e-1}, v^{e-2} and the resources of
        reports e-1, e-2, e-3 (report j's c, m were measured after iteration j and drive
        iteration j+1)."""
        scale = self._scale()
        v = np.asarray(self.speeds) / scale
        c, m = np.asarray(self.cpu), np.asarray(self.mem)
        e = np.arange(LOOK_BACK + 1, len(v))
        x = np.column_stack(
            [v[e - 1], v[e - 2], c[e - 1], c[e - 2], c[e - 3], m[e - 1], m[e - 2], m[e - 3]]
        )
        return x, v[e]

    def _train(self) -> None:
        # A hand-written full-batch Adam: for an 8-16-1 network torch spends ~0.8 ms per
        # epoch in per-operation overhead (measured), numpy ~0.05 ms, and NARX must cost
        # under 1% of a CPU iteration.
        x, y = self._dataset()
        split = max(1, int(len(x) * 0.8))
        x_train, y_train = x[:split], y[:split]
        x_val, y_val = (x[split:], y[split:]) if split < len(x) else (x_train, y_train)
        if self._net is not None:  # warm start: online training continues the model
            params = {k: v.copy() for k, v in self._net.items()}
        else:
            rng = np.random.default_rng(self.seed)
            params = {
                "w1": rng.normal(0, 1 / math.sqrt(N_INPUTS), (self.hidden, N_INPUTS)),
                "b1": np.zeros(self.hidden),
                "w2": rng.normal(0, 1 / math.sqrt(self.hidden), self.hidden),
                "b2": np.array([1.0]),  # speeds are scaled to mean 1
            }
        moment = {k: np.zeros_like(v) for k, v in params.items()}
        second = {k: np.zeros_like(v) for k, v in params.items()}
        beta1, beta2, eps = 0.9, 0.999, 1e-8

        def val_loss() -> float:
            h = np.tanh(x_val @ params["w1"].T + params["b1"])
            return float(np.mean((h @ params["w2"] + params["b2"][0] - y_val) ** 2))

        best, best_params, stale, epochs = val_loss(), dict(params), 0, 0
        n = len(x_train)
        for epochs in range(1, self.max_epochs + 1):
            h = np.tanh(x_train @ params["w1"].T + params["b1"])
            err = h @ params["w2"] + params["b2"][0] - y_train
            d_out = 2.0 * err / n
            d_h = np.outer(d_out, params["w2"]) * (1.0 - h * h)
            grads = {
                "w2": h.T @ d_out,
                "b2": np.array([d_out.sum()]),
                "w1": d_h.T @ x_train,
                "b1": d_h.sum(axis=0),
            }
            for k, g in grads.items():
                moment[k] = beta1 * moment[k] + (1 - beta1) * g
                second[k] = beta2 * second[k] + (1 - beta2) * g * g
                m_hat = moment[k] / (1 - beta1**epochs)
                v_hat = second[k] / (1 - beta2**epochs)
                params[k] = params[k] - self.lr * m_hat / (np.sqrt(v_hat) + eps)
            loss = val_loss()
            if loss < best - 1e-9:
                best, best_params, stale = loss, dict(params), 0
            else:
                stale += 1
                if stale >= self.patience:
                    break
        self._net = best_params
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
            "seen": list(self._seen),
            "weights": self.weights() if self._net is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.fallback.load_state_dict(state["fallback"])
        self._clear_history()
        for name in ("speeds", "cpu", "mem"):
            target: deque[float] = getattr(self, name)
            target.extend(float(x) for x in state[name])
        self._speed_sum = math.fsum(self.speeds)
        low, high = state["seen"]
        self._seen = (float(low), float(high))
        self.trained_at = state["trained_at"]
        self._net = None
        if state["weights"] is not None:
            self.load_weights(state["weights"])
