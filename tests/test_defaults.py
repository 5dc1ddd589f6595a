""" "Default" means one controller everywhere (fedlb.balance.defaults): fedlb's run settings
and LoadBalancedFedAvg, experiments, `fedlb tune`, `fedlb cluster` and its LoadBalancer,
and the manager service all start from the same tuner and estimator, and say so."""

from __future__ import annotations

from typer.testing import CliRunner

from fedlb.balance import (
    BatchSizeManager,
    default_estimator,
    default_tuner,
    defaults,
    make_estimator,
    make_tuner,
)
from fedlb.cli import app
from fedlb.cluster import CLUSTER_POLICIES, DEFAULT_CLUSTER_POLICY
from fedlb.cluster.coordinator import Coordinator
from fedlb.cluster.service_requests import parse_register
from fedlb.deploy import RunConfig
from fedlb.experiments.scenario import Policy

DEFAULT = (defaults.TUNER, defaults.ESTIMATOR)


def kinds(tuner: object, estimator: object) -> tuple[type, type]:
    return type(tuner), type(estimator)


def test_the_library_entry_points_share_the_default_controller():
    expected = kinds(make_tuner(defaults.TUNER), make_estimator(defaults.ESTIMATOR)())
    assert kinds(default_tuner(), default_estimator()) == expected
    manager = BatchSizeManager({"a": 8, "b": 8})  # LoadBalancedFedAvg's, without settings
    assert kinds(manager.tuner, manager.estimator_factory()) == expected
    config = RunConfig()  # fedlb server / demo / experiment settings
    assert (config.tuner, config.estimator) == DEFAULT
    assert Policy("x").tuner == defaults.TUNER  # an experiment policy's
    cluster = CLUSTER_POLICIES[DEFAULT_CLUSTER_POLICY]  # fedlb cluster, scenarios
    assert (cluster.tuner, cluster.estimator) == DEFAULT
    service = parse_register({"job": "j", "workers": ["w0"], "batch_size": 8}, 4)
    assert service.policy == DEFAULT_CLUSTER_POLICY  # the manager, no policy given
    coordinator_defaults = Coordinator.__init__.__defaults__ or ()
    assert default_estimator in coordinator_defaults  # LoadBalancer's coordinator


def test_the_commands_report_the_default_controller():
    runner = CliRunner()
    said = defaults.controller()
    tune = runner.invoke(app, ["tune", "--speeds", "100,200", "--rounds", "2"])
    assert tune.exit_code == 0, tune.output
    assert said in " ".join(tune.output.split())
    assert f"{defaults.TUNER} (default)" in tune.output  # shown, and marked
    cluster = runner.invoke(app, ["cluster", "--help"], terminal_width=400)
    flat = " ".join(cluster.output.replace("│", " ").split())  # rich boxes and wraps help
    assert f"default bsp,{DEFAULT_CLUSTER_POLICY}" in flat
    assert said in flat
    help_text = runner.invoke(app, ["tune", "--help"], terminal_width=400).output
    assert f"{defaults.TUNER} (default)" in " ".join(help_text.split())
