"""Random input at every place fedlb reads what others wrote: update arrays, silo reports,
run settings, scenario files, the server's message to a silo, a checkpoint's strategy state,
the manager service's requests. Each must answer with its own clear error (or accept the
input), never crash with something else. (Ciphertexts: tests/test_he.py; checkpoint files:
tests/test_flower_resume.py.)"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fedlb.balance import WorkerReport
from fedlb.cluster import RequestError
from fedlb.cluster.service import ManagerService, _decode
from fedlb.experiments import Scenario, ScenarioError
from fedlb.flower import (
    Checkpoint,
    CheckpointError,
    ConfigError,
    LoadBalancedFedAvg,
    RunConfig,
    node_settings,
)
from fedlb.flower.silo import SiloConfigError, _config_value
from fedlb.flower.strategy import REPORT_KEYS

pytestmark = pytest.mark.usefixtures("task_identity")

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# JSON-like values: what arrives from a file, a message or a request
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)
metric_values = st.integers(-(2**40), 2**40) | st.floats(allow_nan=True, allow_infinity=True)


def strategy_with_a_round_sent() -> LoadBalancedFedAvg:
    strategy = LoadBalancedFedAvg(batch_size=16, local_steps=5, min_available_nodes=1)
    strategy._sent = {7: (16, 5)}
    strategy._template = {"w": ((3, 4), "float32")}
    return strategy


def reply(arrays: ArrayRecord, metrics: MetricRecord) -> Message:
    return Message(
        RecordDict({"arrays": arrays, "metrics": metrics}),
        dst_node_id=7,
        message_type="train",
    )


@FUZZ
@given(
    data=st.binary(max_size=200),
    dtype=st.sampled_from(["float32", "float64", "int8", "<f4", "bogus", ""]),
    shape=st.lists(st.integers(-2, 5), max_size=3),
)
def test_random_array_payloads_are_rejected_not_fatal(data, dtype, shape):
    strategy = strategy_with_a_round_sent()
    array = Array(dtype=dtype, shape=tuple(shape), stype="numpy.ndarray", data=data)
    problem = strategy._reply_problem(
        reply(ArrayRecord({"w": array}), MetricRecord({"num-examples": 10}))
    )
    assert problem is not None  # never a valid (3, 4) float32 array by chance here


@FUZZ
@given(noise=st.binary(min_size=1, max_size=64), cut=st.integers(0, 200))
def test_a_damaged_real_array_is_rejected_not_fatal(noise, cut):
    strategy = strategy_with_a_round_sent()
    good = Array(np.ones((3, 4), dtype=np.float32))
    damaged = Array(
        dtype=good.dtype, shape=good.shape, stype=good.stype, data=(good.data[:cut] + noise)
    )
    problem = strategy._reply_problem(
        reply(ArrayRecord({"w": damaged}), MetricRecord({"num-examples": 10}))
    )
    if problem is None:  # the bytes still decode to a finite float32[3, 4]: a valid update
        assert np.all(np.isfinite(damaged.numpy()))
        assert damaged.numpy().shape == (3, 4)


@FUZZ
@given(
    st.dictionaries(st.sampled_from([*REPORT_KEYS, "cpu", "mem", "num-examples"]), metric_values)
)
def test_random_reports_are_used_or_dropped_with_a_reason(metrics):
    strategy = strategy_with_a_round_sent()
    report, why = strategy._report(7, MetricRecord(metrics))
    if report is None:
        assert why
    else:
        assert report.problems() == []
        assert math.isfinite(report.speed)
        assert report.speed > 0


@FUZZ
@given(
    st.builds(
        WorkerReport,
        worker=st.text(max_size=4),
        batch_size=st.integers(-3, 10**6) | st.booleans(),
        iterations=st.integers(-3, 100),
        compute_s=st.floats(allow_nan=True, allow_infinity=True),
        overhead_s=st.floats(allow_nan=True, allow_infinity=True),
        cpu=st.none() | st.floats(allow_nan=True),
        mem=st.none() | st.floats(allow_nan=True),
    )
)
def test_the_manager_takes_or_refuses_any_report(report):
    from fedlb.balance import BatchSizeManager

    manager = BatchSizeManager({report.worker or "w": 8, "other": 8})
    sizes = manager.step([report])
    assert sum(sizes.values()) == 16
    assert (len(manager.last_rejected) == 1) == bool(
        report.problems() or report.worker == "" or report.batch_size != 8
    )


run_keys = [f.replace("_", "-") for f in RunConfig.__dataclass_fields__]


@FUZZ
@given(st.dictionaries(st.sampled_from([*run_keys, "bogus-key"]), values, max_size=6))
def test_random_run_settings_are_accepted_or_refused_with_the_key_named(mapping):
    message = ""
    try:
        RunConfig.from_mapping(mapping)
    except ConfigError as error:
        message = str(error)
    assert not message or any(key in message for key in [*run_keys, "bogus-key"])


@FUZZ
@given(st.text(max_size=300))
def test_a_random_scenario_file_is_refused_with_a_scenario_error(tmp_path, text):
    path = tmp_path / "fuzz.toml"
    path.write_text(text)
    with contextlib.suppress(ScenarioError):
        Scenario.from_file(path)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            ["partition-id", "num-partitions", "data-path", "emulated-speed", "threads", "other"]
        ),
        values,
    )
)
def test_random_node_config_is_refused_with_a_silo_config_error(node_config):
    with contextlib.suppress(SiloConfigError):
        node_settings(node_config)


@FUZZ
@given(value=values.filter(lambda v: not isinstance(v, (dict, type(None)))))
@example(value=math.inf)  # found by this test: int(inf) raised OverflowError
@example(value=2.5)
def test_a_server_message_with_a_bad_value_is_refused(value):
    try:
        config = ConfigRecord({"batch-size": value})
    except (TypeError, ValueError):
        return  # Flower itself refuses to carry it
    msg = Message(RecordDict({"config": config}), dst_node_id=1, message_type="train")
    try:
        got = _config_value(msg, "batch-size", int)
    except SiloConfigError:
        return
    assert isinstance(got, int)
    assert not isinstance(got, bool)
    assert got == value


@FUZZ
@given(
    state=st.dictionaries(
        st.sampled_from(["manager", "rng", "labels", "benched", "too_slow", "pending"]), values
    )
)
def test_a_random_strategy_state_is_refused_as_a_checkpoint_error(state):
    strategy = LoadBalancedFedAvg(min_available_nodes=1)
    with contextlib.suppress(CheckpointError):
        strategy.restore(Checkpoint(1, 2, ArrayRecord(), state, {}))


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_to_the_manager_service_are_a_request_error(data):
    with contextlib.suppress(RequestError):
        _decode(data)


@FUZZ
@given(
    register=st.dictionaries(st.sampled_from(["job", "workers", "batch_size", "policy"]), values),
    report=st.dictionaries(
        st.sampled_from(["job", "worker", "iteration", "compute_s", "batch_size", "cpu", "mem"]),
        values,
    ),
)
@example(  # found by this test: a null batch_size compared None < 1
    register={"job": [None], "workers": [None], "batch_size": None}, report={}
)
def test_random_requests_to_the_manager_service_are_a_request_error(register, report):
    service = ManagerService(wait_timeout=0.01)
    service.register({"job": "j", "workers": ["a", "b"], "batch_size": 8})
    for method, request in ((service.register, register), (service.report, report)):
        with contextlib.suppress(RequestError):
            method({**request, "wait": False})
