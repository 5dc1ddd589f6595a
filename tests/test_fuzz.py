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

from fedlb.balance import BatchSizeManager, WorkerReport
from fedlb.cluster import RequestError
from fedlb.cluster.service import ManagerService, _decode
from fedlb.deploy import ConfigError, RunConfig
from fedlb.deploy.silo_app import SiloConfigError, node_settings
from fedlb.experiments import Scenario, ScenarioError
from fedlb.flower import Balancing, Checkpoint, CheckpointError, LoadBalancedFedAvg, RoundRecord
from fedlb.flower.protocol import (
    BATCH_SIZE,
    CPU,
    EMULATED_SPEED,
    EVALUATE_FIRST,
    LOCAL_STEPS,
    MEM,
    MODEL_CLOCK,
    MOST_SPEED,
    PARTITION_ID,
    REPORT_KEYS,
    SERVER_ROUND,
    Orders,
    ProtocolError,
    SiloReport,
    read_report,
)
from fedlb.flower.replies import ReportCheck, UpdateCheck

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
REPORT_METRICS = [*REPORT_KEYS, CPU, MEM, PARTITION_ID, EMULATED_SPEED, MODEL_CLOCK]
GLOBAL = ArrayRecord({"w": Array(np.zeros((3, 4), dtype=np.float32))})


def update_check() -> UpdateCheck:
    check = UpdateCheck("num-examples", None)
    check.new_round(GLOBAL)
    return check


def reply(arrays: ArrayRecord, metrics: MetricRecord, node: int = 7) -> Message:
    """A train reply from `node` (to a train message sent to it)."""
    sent = Message(RecordDict(), dst_node_id=node, message_type="train")
    sent.metadata.__dict__["_message_id"] = f"sent-to-{node}"
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=sent)


@FUZZ
@given(
    data=st.binary(max_size=200),
    dtype=st.sampled_from(["float32", "float64", "int8", "<f4", "bogus", ""]),
    shape=st.lists(st.integers(-2, 5), max_size=3),
)
def test_random_array_payloads_are_rejected_not_fatal(data, dtype, shape):
    array = Array(dtype=dtype, shape=tuple(shape), stype="numpy.ndarray", data=data)
    problem = update_check().problem(
        reply(ArrayRecord({"w": array}), MetricRecord({"num-examples": 10}))
    )
    assert problem is not None  # never a valid (3, 4) float32 array by chance here


@FUZZ
@given(noise=st.binary(min_size=1, max_size=64), cut=st.integers(0, 200))
def test_a_damaged_real_array_is_rejected_not_fatal(noise, cut):
    good = Array(np.ones((3, 4), dtype=np.float32))
    damaged = Array(
        dtype=good.dtype, shape=good.shape, stype=good.stype, data=(good.data[:cut] + noise)
    )
    problem = update_check().problem(
        reply(ArrayRecord({"w": damaged}), MetricRecord({"num-examples": 10}))
    )
    if problem is None:  # the bytes still decode to a finite float32[3, 4]: a valid update
        assert np.all(np.isfinite(damaged.numpy()))
        assert damaged.numpy().shape == (3, 4)


@FUZZ
@given(st.dictionaries(st.sampled_from([*REPORT_METRICS, "num-examples"]), metric_values))
def test_random_reports_are_used_or_dropped_with_a_reason(metrics):
    """What a silo reports passes the server's two checks (the protocol and what it was
    sent, then the balancer's) or is dropped with a reason, never a crash."""
    report, why = ReportCheck("num-examples").read(7, MetricRecord(metrics), (16, 5))
    if report is None:
        assert why
        return
    assert (report.batch_size, report.local_steps) == (16, 5)
    manager = BatchSizeManager({"7": 16, "8": 16})
    sizes = manager.step([report.worker_report(7)])
    assert sum(sizes.values()) == 32
    if manager.last_rejected:
        assert manager.last_rejected[0][0] == "7"
        assert manager.last_rejected[0][1]
    else:
        worker = report.worker_report(7)
        assert worker.problems() == []
        assert math.isfinite(worker.speed)
        assert worker.speed > 0


def collect(
    strategy: LoadBalancedFedAvg, server_round: int, replies: list[Message]
) -> tuple[list[Message], RoundRecord]:
    """The strategy's reading of a round's replies, as its aggregate_train starts it."""
    return strategy.balance.collect(server_round, replies, {}, 0.0, {})


def strategy_in_round_two() -> LoadBalancedFedAvg:
    """A strategy whose balancer is running and that has sent round 2 to nodes 7 and 8."""
    strategy = LoadBalancedFedAvg(
        min_available_nodes=1, balancing=Balancing(batch_size=16, local_steps=5)
    )
    strategy.manager = BatchSizeManager({"7": 16, "8": 16})
    strategy.balance.sent = {7: (16, 5), 8: (16, 5)}
    strategy.updates.new_round(GLOBAL)
    return strategy


GOOD_REPORT = {
    "num-examples": 100,
    BATCH_SIZE: 16,
    LOCAL_STEPS: 5,
    "fedlb.compute-s": 1.0,
    "fedlb.overhead-s": 0.1,
}


@FUZZ
@given(st.dictionaries(st.sampled_from(REPORT_METRICS), metric_values))
@example({"fedlb.compute-s": -1.0})  # found by this test: round_record's ideal time raised
@example({"fedlb.compute-s": 0})
@example({"fedlb.overhead-s": 1.8e305})  # found by this test: the estimator overflowed
@example({"fedlb.compute-s": 1e-320})  # found by this test: an infinite speed, not rejected
def test_a_random_report_never_stops_the_round(changes):
    strategy = strategy_in_round_two()
    good = reply(GLOBAL, MetricRecord(GOOD_REPORT), node=8)
    fuzzed = reply(GLOBAL, MetricRecord({**GOOD_REPORT, **changes}), node=7)
    valid, record = collect(strategy, 2, [good, fuzzed])
    assert len(valid) == 2  # both updates are used either way
    by_node = {s.node: s for s in record.silos}
    assert math.isfinite(by_node[8].compute_s)
    if record.rejected:
        assert len(record.rejected) == 1  # node 7's, with the reason
        assert record.rejected[0].split(": ", 1)[1]
    else:
        assert math.isfinite(by_node[7].compute_s)
        assert by_node[7].compute_s > 0


def strategy_in_round_one() -> LoadBalancedFedAvg:
    """A strategy that has sent round 1 to nodes 7 and 8 with no orders: each silo runs
    its own loader's B0 for its own steps, and the balancer is made from their reports."""
    # the stability guard's floor would re-divide the sizes: the B0s are under test here
    strategy = LoadBalancedFedAvg(min_available_nodes=1, balancing=Balancing(guard=False))
    strategy.balance.sent = {7: (None, None), 8: (None, None)}
    strategy.updates.new_round(GLOBAL)
    return strategy


@FUZZ
@given(
    b0=st.integers(-(2**31), 2**31) | st.floats(-1e9, 1e9),
    steps=st.integers(-(2**31), 2**31) | st.floats(-1e9, 1e9),
)
@example(b0=0, steps=5)  # found by this test: BatchSizeManager(initial) raised
@example(b0=-16, steps=5)
@example(b0=16, steps=0)
def test_a_random_first_b0_is_taken_or_dropped_never_fatal(b0, steps):
    strategy = strategy_in_round_one()
    good = reply(GLOBAL, MetricRecord(GOOD_REPORT), node=8)
    said = {**GOOD_REPORT, BATCH_SIZE: b0, LOCAL_STEPS: steps}
    fuzzed = reply(GLOBAL, MetricRecord(said), node=7)
    valid, record = collect(strategy, 1, [good, fuzzed])
    assert len(valid) == 2  # both updates are used either way
    assert strategy.manager is not None
    sizes = strategy.manager.sizes
    assert sizes["8"] == 16
    if "7" in sizes:  # its report was taken: its B0 is the size it ran
        assert sizes["7"] == b0 >= 1
        assert strategy.manager.total == b0 + 16
    else:
        assert len(record.rejected) == 1
        assert strategy.manager.total == 16


@pytest.mark.timeout(5)  # it hung in round_to_total once (B0 = 1e40: X past 2**53)
def test_an_absurd_first_b0_does_not_hang_the_server():
    strategy = strategy_in_round_one()
    good = reply(GLOBAL, MetricRecord(GOOD_REPORT), node=8)
    fuzzed = reply(GLOBAL, MetricRecord({**GOOD_REPORT, BATCH_SIZE: 1e40}), node=7)
    valid, record = collect(strategy, 1, [good, fuzzed])
    assert len(valid) == 2  # its update is used, its report is not
    assert strategy.manager is not None
    assert strategy.manager.sizes == {"8": 16}
    assert [r for r in record.rejected if BATCH_SIZE in r]


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


def test_a_huge_fixed_cost_is_refused_or_taken():
    manager = BatchSizeManager({"7": 16, "8": 16})
    sizes = manager.step([WorkerReport("7", 16, 5, 1.0, 1.8e305)])
    assert sum(sizes.values()) == 32


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
@given(
    orders=st.dictionaries(
        st.sampled_from([BATCH_SIZE, LOCAL_STEPS, SERVER_ROUND, EVALUATE_FIRST, "learning-rate"]),
        values.filter(lambda v: not isinstance(v, (dict, type(None)))),
    )
)
@example(orders={BATCH_SIZE: math.inf})  # found by the old silo reader: int(inf) raised
@example(orders={BATCH_SIZE: 2.5})
@example(orders={LOCAL_STEPS: True})
def test_a_server_message_with_bad_orders_is_refused(orders):
    try:
        config = ConfigRecord(orders)
    except (TypeError, ValueError):
        return  # Flower itself refuses to carry it
    message = ""
    try:
        got = Orders.read(config)
    except ProtocolError as error:
        message = str(error)
    if message:
        assert any(key in message for key in orders), message  # the key is named
        return
    for key, value in ((BATCH_SIZE, got.batch_size), (LOCAL_STEPS, got.local_steps)):
        if key in orders:
            assert isinstance(value, int)
            assert not isinstance(value, bool)
            assert value >= 1
            assert value == orders[key]
        else:
            assert value is None
    assert got.evaluate_first is (orders.get(EVALUATE_FIRST) is True)


@FUZZ
@given(
    server_round=st.integers(1, 10**6),
    batch_size=st.none() | st.integers(1, 10**6),
    local_steps=st.none() | st.integers(1, 10**6),
    evaluate_first=st.booleans(),
)
def test_orders_read_back_as_they_were_written(
    server_round, batch_size, local_steps, evaluate_first
):
    orders = Orders(server_round, batch_size, local_steps, evaluate_first)
    app_config = ConfigRecord({"learning-rate": 0.1, "epochs": 2})
    config = orders.into(app_config)
    assert Orders.read(config) == orders
    assert config["learning-rate"] == 0.1  # the app's keys pass through
    assert BATCH_SIZE not in app_config  # and the app's record is not changed


@FUZZ
@given(st.dictionaries(st.sampled_from([*REPORT_METRICS, "num-examples"]), values))
@example({BATCH_SIZE: 16, LOCAL_STEPS: 5, "fedlb.compute-s": 1.0, "fedlb.overhead-s": math.inf})
@example({BATCH_SIZE: 16.5, LOCAL_STEPS: 5, "fedlb.compute-s": 1.0, "fedlb.overhead-s": 0.0})
def test_a_random_silo_report_is_read_or_refused(metrics):
    try:
        record = MetricRecord(metrics)
    except (TypeError, ValueError):
        return  # Flower itself refuses to carry it
    message = ""
    try:
        report = read_report(record)
    except ProtocolError as error:
        message = str(error) or "(empty)"
    if message:
        assert any(key in message for key in REPORT_KEYS), message  # the key is named
        return
    assert all(key in metrics for key in REPORT_KEYS)
    assert report.batch_size == metrics[BATCH_SIZE]
    assert report.local_steps == metrics[LOCAL_STEPS]
    assert isinstance(report.batch_size, int)
    assert isinstance(report.local_steps, int)
    for value in (report.compute_s, report.overhead_s, report.emulated_speed):
        assert math.isfinite(value)


@FUZZ
@given(
    st.builds(
        SiloReport,
        batch_size=st.integers(1, 10**6),
        local_steps=st.integers(1, 10**4),
        compute_s=st.floats(1e-6, 1e6),
        overhead_s=st.floats(0, 1e6),
        cpu=st.none() | st.floats(0, 1),
        mem=st.none() | st.floats(0, 1),
        partition_id=st.none() | st.integers(0, 10**4),
        emulated_speed=st.floats(0, 1e6),
        model_clock=st.booleans(),
        # a curve's name travels as UTF-8 bytes (<= 200 of them: 50 characters of <= 4)
        emulated_curve=st.text(
            st.characters(codec="utf-8", categories=("L", "N", "P", "S")), max_size=50
        ),
    )
)
def test_a_report_reads_back_as_it_was_sent(report):
    """... where its speed is a machine's; faster than MOST_SPEED it is refused."""
    if report.batch_size * report.local_steps > MOST_SPEED * report.compute_s:
        with pytest.raises(ProtocolError, match="which no machine trains"):
            read_report(MetricRecord(report.metrics()))
    else:
        assert read_report(MetricRecord(report.metrics())) == report


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
