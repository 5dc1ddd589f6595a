"""Experiments on Flower's simulation, the supported way: `flwr run` of a Flower app on a
simulation SuperLink (fedlb/experiments/app).

The app's ServerApp is fedlb's own (`run_app`) with the policy's strategy; its ClientApp
is fedlb's silo handler behind `balance_mod`, as in a deployment. What makes it an
experiment travels as run config: the scenario's keys (speeds, overheads, traces, clock,
...), the policy, where results go, and under HE the key files. Each silo rebuilds its
emulated clock from them and its partition-id.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedlb.data import use_profile_dir
from fedlb.deploy import RunConfig, evaluate_reply, run_app, train_reply
from fedlb.flower import balance_mod, he_mod

from .profiles import EmulatedClock
from .scenario import POLICIES, Scenario

if TYPE_CHECKING:
    from collections.abc import Callable

    # A ClientApp's call chain, as the public `ClientApp(mods=...)` spells it
    ClientAppCallable = Callable[[Message, Context], Message]

# Run config keys of the experiment app besides the scenario's own
POLICY = "policy"
OUT_DIR = "out-dir"
HE_PUBLIC = "he-public"  # the server's public CKKS context ('' : no HE)
HE_SECRET = "he-secret"  # the silos' secret context
# where a second run's speed profiles and guard verdicts are kept ('': none, as in every
# first run: a seed's run must not depend on the runs before it)
PROFILE_DIR = "profile-dir"


def app_dir() -> Path:
    """The Flower app `flwr run` submits for an experiment."""
    return Path(str(files("fedlb.experiments").joinpath("app")))


def app_defaults() -> dict[str, Any]:
    """[tool.flwr.app.config] of the app: Flower only takes run config keys declared
    there (a test keeps the file equal to this)."""
    return {
        **Scenario().to_mapping(),
        POLICY: "lb",
        OUT_DIR: "",
        PROFILE_DIR: "",
        HE_PUBLIC: "",
        HE_SECRET: "",
    }


def run_config(
    scenario: Scenario,
    policy: str,
    out_dir: Path,
    he: tuple[Path, Path] | None = None,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """The run config of one policy's run; `he`: (public, secret) key files;
    `profile_dir`: the folder of stored profiles and verdicts (a second run's)."""
    return {
        **scenario.to_mapping(),
        POLICY: policy,
        OUT_DIR: str(out_dir),
        PROFILE_DIR: str(profile_dir) if profile_dir else "",
        HE_PUBLIC: str(he[0]) if he else "",
        HE_SECRET: str(he[1]) if he else "",
    }


@functools.lru_cache(maxsize=2)
def _read(items: tuple[tuple[str, Any], ...]) -> tuple[Scenario, RunConfig]:
    values = dict(items)
    scenario = Scenario.from_mapping({k: v for k, v in values.items() if k not in _OWN})
    config = scenario.run_config(str(values[OUT_DIR]), str(values[POLICY]))
    if values[HE_PUBLIC]:
        config = dataclasses.replace(config, he_context=str(values[HE_PUBLIC]))
    return scenario, config


_OWN = (POLICY, OUT_DIR, PROFILE_DIR, HE_PUBLIC, HE_SECRET)


def experiment(run_config: Mapping[str, Any]) -> tuple[Scenario, RunConfig]:
    """The scenario and the run settings the run config describes (parsed once per process)."""
    return _read(tuple(sorted(run_config.items())))


server = ServerApp()


@server.main()
def _server(grid: Grid, context: Context) -> None:
    _, config = experiment(context.run_config)
    policy = POLICIES[str(context.run_config[POLICY])]
    folder = run_profile_dir(context)
    config = dataclasses.replace(
        config,
        profiles=int(bool(folder)),
        guard=int(policy.guard and bool(config.guard)),
        guard_probe=config.guard_probe if policy.guard_probe is None else policy.guard_probe,
    )
    run_app(grid, config, policy.strategy_class, policy.strategy_args())


def run_profile_dir(context: Context) -> str:
    """Point this process's stored profiles and verdicts at the run config's folder, or
    turn them off (a Ray worker serves every run of an experiment); the folder."""
    folder = str(context.run_config.get(PROFILE_DIR, ""))
    use_profile_dir(folder)
    return folder


def run_config_profiles(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A silo's profiles where its run config says (a second run), before balance_mod
    reads or stores one."""
    run_profile_dir(context)
    return call_next(msg, context)


def scenario_clock(context: Context) -> EmulatedClock:
    """A silo's emulated clock: its profile in the scenario, by its partition-id."""
    scenario, _ = experiment(context.run_config)
    return EmulatedClock(
        scenario.clock, scenario.profiles()[int(context.node_config["partition-id"])]
    )


def run_config_he(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """fedlb's HE mod with the secret key the run config names (a simulated silo has no
    node config of its own to name it)."""
    path = str(context.run_config.get(HE_SECRET, ""))
    if not path:
        return call_next(msg, context)
    reply: Message = _he_mod(path)(msg, context, call_next)
    return reply


@functools.lru_cache(maxsize=1)
def _he_mod(path: str) -> Any:
    from fedlb.he import load_context  # TenSEAL only where HE is on: it is slow to import

    return he_mod(load_context(Path(path), "silo"))


# The HE mod outside the balancing mod: its seconds join the silo's fixed cost (under
# the model clock the balancing mod reports the profile's times, plus these).
client = ClientApp(mods=[run_config_profiles, run_config_he, balance_mod(scenario_clock)])


@client.train()
def _train(msg: Message, context: Context) -> Message:
    return train_reply(msg, context, experiment(context.run_config)[1])


@client.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return evaluate_reply(msg, context, experiment(context.run_config)[1])
