"""fedlb.deploy: fedlb's deployment as a library, what `fedlb server`, `fedlb silo` and
`fedlb demo` parse options for.

    from fedlb.deploy import run_server, server_settings, silo_settings, start_silo

- `server_settings`, `silo_settings` (`ServerSettings`, `SiloSettings`, `RunConfig`),
  `local_silos`, `check_out_dir`: settings from TOML with the caller's values on top,
  checked (`ConfigError`); `read_toml`, `dataclass_arguments`: the same checks for other
  files (scenarios).
- `run_server`, `start_silo`, `resume_settings`, `check_run_folder` (`ServerReady`):
  run them; `Federation` (`RunOutcome`): Flower's processes on this machine, a simulation
  SuperLink included; `FlowerProcess`, `DeployError`, `JoinError`, `supernode_join`,
  `ClientAppFailures`: one process and what its log says; `start_ray_head`,
  `start_ray_node` (`RayNode`): Ray nodes here for a simulation SuperLink's runs.
- `run_app`, `train_reply`, `evaluate_reply`, `check_partition`: fedlb's own ServerApp
  body and silo handlers (modules `fedlb.deploy.server_app` / `client_app`; the app
  `flwr run` submits is `fedlb/deploy/app`). Silos start warm (`fedlb.deploy.warm`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlb._faces import lazy_face

if TYPE_CHECKING:
    from .errors import DeployError
    from .federation import Federation, RunOutcome
    from .join import ClientAppFailures, supernode_join
    from .operations import (
        ServerReady,
        check_run_folder,
        resume_settings,
        run_server,
        start_silo,
    )
    from .processes import FlowerProcess, JoinError
    from .ray_nodes import RayNode, start_ray_head, start_ray_node
    from .run_config import ConfigError, RunConfig, as_settings, dataclass_arguments, read_toml
    from .server_app import run_app
    from .settings import (
        ServerSettings,
        SiloSettings,
        check_out_dir,
        local_silos,
        server_settings,
        silo_settings,
    )
    from .silo_app import evaluate_reply, train_reply
    from .task import check_partition

__all__ = [
    "ClientAppFailures",
    "ConfigError",
    "DeployError",
    "Federation",
    "FlowerProcess",
    "JoinError",
    "RayNode",
    "RunConfig",
    "RunOutcome",
    "ServerReady",
    "ServerSettings",
    "SiloSettings",
    "as_settings",
    "check_out_dir",
    "check_partition",
    "check_run_folder",
    "dataclass_arguments",
    "evaluate_reply",
    "local_silos",
    "read_toml",
    "resume_settings",
    "run_app",
    "run_server",
    "server_settings",
    "silo_settings",
    "start_ray_head",
    "start_ray_node",
    "start_silo",
    "supernode_join",
    "train_reply",
]

__getattr__ = lazy_face(
    __name__,
    {
        ".run_config": [
            "ConfigError",
            "RunConfig",
            "as_settings",
            "dataclass_arguments",
            "read_toml",
        ],
        ".settings": [
            "ServerSettings",
            "SiloSettings",
            "check_out_dir",
            "local_silos",
            "server_settings",
            "silo_settings",
        ],
        ".operations": [
            "ServerReady",
            "check_run_folder",
            "resume_settings",
            "run_server",
            "start_silo",
        ],
        ".errors": ["DeployError"],
        ".processes": ["FlowerProcess", "JoinError"],
        ".ray_nodes": ["RayNode", "start_ray_head", "start_ray_node"],
        ".join": ["ClientAppFailures", "supernode_join"],
        ".federation": ["Federation", "RunOutcome"],
        ".server_app": ["run_app"],
        ".silo_app": ["evaluate_reply", "train_reply"],
        ".task": ["check_partition"],
    },
)
