"""The step-time curves fedlb ships (fedlb.training) and the pace of the measured clock."""

from __future__ import annotations

import json

import pytest

from fedlb.training import STEP_CURVES, EmulatedCurve, step_curve
from fedlb.training.curves import CURVE_HARDWARE, CURVES_FILE


def test_the_shipped_file_says_what_where_and_when():
    shipped = json.loads(CURVES_FILE.read_text())
    assert shipped["date"] == "2026-11-26"
    assert "H200" in shipped["where"]
    assert "SGD step" in shipped["what"]
    assert set(shipped["shapes"]) == {"mlp", "lenet5", "cnn"}


def test_every_series_is_one_named_curve_of_its_model_fitted_to_the_medians():
    rows = json.loads(CURVES_FILE.read_text())["rows"]
    assert set(STEP_CURVES) == {
        f"{hardware}/{model}" for hardware in CURVE_HARDWARE for model in ("mlp", "lenet5", "cnn")
    }
    for name, curve in STEP_CURVES.items():
        hardware, model = name.split("/")
        assert curve.name == name
        assert curve.model == model
        device, threads = {"h200": ("cuda", None), "cpu1": ("cpu", 1), "cpu4": ("cpu", 4)}[hardware]
        medians = {
            r["batch"]: r["step_s"]
            for r in rows
            if (r["device"], r["threads"], r["model"]) == (device, threads, model)
        }
        assert [b for b, _ in curve.points] == sorted(medians)
        # the isotonic fit moves points only within pooled dips: the total stays
        assert sum(s for _, s in curve.points) == pytest.approx(sum(medians.values()))
        # where the medians already grow, they are the curve
        if list(medians.values()) == sorted(medians.values()):
            assert dict(curve.points) == pytest.approx(medians)
    # the GPU note's figures (docs: 2.88 ms at 4096 on the H200, 155 ms at 1024 on a thread)
    assert STEP_CURVES["h200/lenet5"].seconds(4096) == pytest.approx(0.00288, abs=1e-5)
    assert STEP_CURVES["cpu1/lenet5"].seconds(1024) == pytest.approx(0.155, abs=1e-3)
    assert STEP_CURVES["cpu1/cnn"].points == tuple(sorted(medians_of(rows, "cpu", 1, "cnn")))


def medians_of(rows, device, threads, model):
    return [
        (r["batch"], r["step_s"])
        for r in rows
        if (r["device"], r["threads"], r["model"]) == (device, threads, model)
    ]


def test_a_setting_names_a_curve_or_a_slower_copy():
    assert step_curve("h200/cnn") is STEP_CURVES["h200/cnn"]
    slow = step_curve(" cpu4/lenet5*20 ")
    assert slow.name == "cpu4/lenet5*20"
    assert slow.model == "lenet5"
    assert slow.seconds(100) == pytest.approx(20 * STEP_CURVES["cpu4/lenet5"].seconds(100))
    with pytest.raises(ValueError, match="unknown step-time curve 'h100/cnn': fedlb ships h200"):
        step_curve("h100/cnn")
    for bad in ("h200/cnn*0", "h200/cnn*x", "h200/cnn*inf", "h200/cnn*"):
        with pytest.raises(ValueError, match="K of NAME\\*K must be a number > 0"):
            step_curve(bad)


def test_the_pace_is_the_curve_unless_real_compute_is_slower():
    pace = EmulatedCurve(STEP_CURVES["cpu1/cnn"])
    assert pace(0.0001, 32) == STEP_CURVES["cpu1/cnn"].seconds(32)
    assert pace(5.0, 32) == 5.0  # cannot keep up: not padded
