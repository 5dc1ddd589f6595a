"""Speed estimators: EMA, memoryless, NARX (the paper's Table 3 ordering), model reuse."""

from __future__ import annotations

import json

import pytest

from fedlb.balance import (
    EMA,
    NARX,
    BatchSizeManager,
    Memoryless,
    Proportional,
    WorkerReport,
    competing_load_trace,
)
from fedlb.balance.estimators import NotReadyError
from fedlb.balance.traces import prediction_rmse


def report(speed, batch=10, **kw):
    return WorkerReport("w", batch, 1, batch / speed, **kw)


def test_estimators_refuse_to_predict_before_any_report():
    for estimator in (Memoryless(), EMA(), NARX(warmup=10, history=20)):
        assert not estimator.ready
        with pytest.raises(NotReadyError):
            estimator.predict()


def test_ema_follows_the_paper_formula():
    ema = EMA(alpha=0.2)
    ema.update(report(100.0))
    assert ema.predict() == pytest.approx(100.0)
    ema.update(report(50.0))
    assert ema.predict() == pytest.approx(0.2 * 50 + 0.8 * 100)
    memoryless = Memoryless()
    for s in (100.0, 50.0):
        memoryless.update(report(s))
    assert memoryless.predict() == pytest.approx(50.0)


def test_ema_with_restart_recovers_from_a_step_change_in_two_reports():
    plain, restarting = EMA(), EMA(restart_threshold=0.25, restart_after=2)
    for _ in range(10):
        for e in (plain, restarting):
            e.update(report(100.0))
    for _ in range(2):
        for e in (plain, restarting):
            e.update(report(40.0))
    assert restarting.predict() == pytest.approx(40.0)
    assert plain.predict() > 70.0  # 1/α rounds to forget
    # a single outlier is not a change
    restarting.update(report(100.0))
    restarting.update(report(40.0))
    assert restarting.predict() < 60.0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"alpha": 0.0}, "alpha must be in"),
        ({"alpha": 1.5}, "alpha must be in"),
        ({"restart_threshold": -1.0}, "restart_threshold must be > 0"),
    ],
)
def test_ema_refuses_bad_parameters(bad, message):
    with pytest.raises(ValueError, match=message):
        EMA(**bad)


def test_narx_beats_ema_on_a_resource_driven_trace():
    """LB-BSP Table 3: NARX 4.78 vs EMA 7.85 RMSE. Ours must be at least 25% lower."""
    trace = competing_load_trace(1800, seed=3)
    warmup = 500
    scores = {
        name: prediction_rmse(est, trace, skip=warmup)
        for name, est in {
            "memoryless": Memoryless(),
            "ema": EMA(),
            "narx": NARX(warmup=warmup),
        }.items()
    }
    assert scores["narx"] <= 0.75 * scores["ema"], scores
    assert scores["narx"] < scores["memoryless"], scores


def test_narx_uses_ema_until_warmup_then_its_model():
    trace = competing_load_trace(140, seed=1)
    narx, ema = NARX(warmup=100, history=200), EMA()
    for k, r in enumerate(trace.reports()):
        narx.update(r)
        ema.update(r)
        if k + 1 < 100:
            assert not narx.using_model
            assert narx.predict() == pytest.approx(ema.predict())
    assert narx.using_model
    assert narx.trained_at == 100


def test_narx_model_reuse_predicts_from_the_start_on_another_worker():
    donor = NARX(warmup=400)
    for r in competing_load_trace(600, seed=11).reports():
        donor.update(r)
    weights = json.loads(json.dumps(donor.weights()))
    # Another worker, twice as fast, other load pattern.
    trace = competing_load_trace(200, seed=12, base_speed=200.0)
    reused, ema = NARX(warmup=400, weights=weights), EMA()
    errors = {"reused": [], "ema": []}
    for k, r in enumerate(trace.reports()):
        reused.update(r)
        ema.update(r)
        if k >= 3:
            assert reused.using_model
            truth = float(trace.speed[k + 1])
            errors["reused"].append((reused.predict() - truth) ** 2)
            errors["ema"].append((ema.predict() - truth) ** 2)
    assert sum(errors["reused"]) < 0.8 * sum(errors["ema"])


def test_narx_without_resource_readings_falls_back_to_ema(caplog):
    narx = NARX(warmup=10, history=20)
    with caplog.at_level("WARNING", logger="fedlb.balance"):
        for s in (100.0, 50.0, 80.0):
            narx.update(report(s))
    ema = EMA()
    for s in (100.0, 50.0, 80.0):
        ema.update(report(s))
    assert narx.predict() == pytest.approx(ema.predict())
    assert "falls back to EMA" in caplog.text


def test_narx_rejects_weights_of_the_wrong_shape():
    with pytest.raises(ValueError, match="do not fit"):
        NARX(weights={"w1": [[0.0] * 3], "b1": [0.0], "w2": [0.0], "b2": [0.0]})
    with pytest.raises(ValueError, match="not been trained"):
        NARX().weights()


def test_narx_state_round_trips_inside_the_manager():
    """A NARX-driven manager restored from JSON continues exactly like the original."""
    speeds = competing_load_trace(160, seed=5).speed

    def factory():
        return NARX(warmup=60, retrain_every=30, history=200)

    def feed(manager, ks):
        sizes = []
        for k in ks:  # worker w follows the trace, worker v runs at a steady 100 samples/s
            w, v = manager.sizes["w"], manager.sizes["v"]
            sizes.append(
                manager.step(
                    [
                        WorkerReport(
                            "w", w, 1, w / float(speeds[k]), cpu=0.2 + k % 7 / 10, mem=0.4
                        ),
                        WorkerReport("v", v, 1, v / 100.0, cpu=0.2, mem=0.3),
                    ]
                )
            )
        return sizes

    original = BatchSizeManager({"w": 10, "v": 10}, Proportional(), factory)
    feed(original, range(100))
    assert original.estimators["w"].using_model
    restored = BatchSizeManager({"w": 10, "v": 10}, Proportional(), factory)
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert feed(original, range(100, 159)) == feed(restored, range(100, 159))
    assert original.estimators["w"].predict() == pytest.approx(restored.estimators["w"].predict())
