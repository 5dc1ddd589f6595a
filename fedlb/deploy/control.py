"""The SuperLink's Control API, called from this process: submit a run, ask its status,
stream its log, stop runs, register silo keys.

Each `flwr` CLI call is a fresh Python process that imports flwr (~1.1 s of CPU here); a
deployed run took four of them (list, run, log --stream, ls) on its critical path, on the
same cores as the silos. Flower's CLI makes each call through `ControlHttpClient`; this
module makes the same calls with the same client and the same request builders, in the
process that already has flwr imported. The `flwr` CLI still works against the SuperLink
(FLWR_HOME/config.toml names it; see `processes.write_connection`).

Flower pieces relied on (tests/test_flower_deploy.py exercises each on real processes, so
a Flower upgrade that changes one fails a test, not a user's run):
`flwr.supercore.control.ControlHttpClient` (StartRun, ListRuns, StopRun, StreamLogs,
RegisterNode), `flwr.cli.config_utils.load_and_validate`, `flwr.cli.build.build_fab_from_disk`,
`flwr.common.config.parse_config_args`, `flwr.common.serde` (fab_to_proto,
user_config_to_proto, run_from_proto), `flwr.supercore.utils.simulation_config_from_json`.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import DeployError
from .processes import node_config_text

if TYPE_CHECKING:
    from flwr.supercore.control import ControlHttpClient

ALREADY_REGISTERED = "Public key already in use"  # a resumed server's SuperLink kept it


class Control:
    """A client of one SuperLink's Control API (`address`, TLS when `root_certificates`
    is the CA's PEM file). Close it (or use it as a context manager) when done."""

    def __init__(self, address: str, root_certificates: Path | None = None) -> None:
        from flwr.cli.cli_client_interceptor import CliClientHttpInterceptor
        from flwr.supercore.control import ControlHttpClient
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

        self.address = address
        self.client: ControlHttpClient = ControlHttpClient.from_server_address(
            server_address=address,
            insecure=root_certificates is None,
            root_certificates=None if root_certificates is None else root_certificates.read_bytes(),
            interceptors=[
                CliClientHttpInterceptor(),  # the SuperLink serves these calls to the CLI
                RuntimeVersionHttpInterceptor(component_name="flwr CLI"),
            ],
        )

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    @contextlib.contextmanager
    def _call(self, what: str) -> Iterator[None]:
        """A failed call as a DeployError that says which call failed, where, and why in
        Flower's own words (its CLI's translation of the SuperLink's error)."""
        import click
        from flwr.cli.utils import flwr_cli_exc_handler

        try:
            with flwr_cli_exc_handler():
                yield
        except DeployError:
            raise
        except click.ClickException as error:
            raise DeployError(
                f"the SuperLink at {self.address} refused or failed to {what}: "
                f"{error.format_message()}"
            ) from error
        except Exception as error:
            raise DeployError(
                f"the SuperLink at {self.address} refused or failed to {what}: "
                f"{type(error).__name__}: {error}"
            ) from error

    def submit_run(
        self,
        app: Path,
        run_config: Mapping[str, Any],
        federation_config: Mapping[str, Any] | None = None,
    ) -> str:
        """Submit the Flower app in `app` with these run settings, as `flwr run` does;
        returns the run id (no waiting). `federation_config`: a simulation SuperLink's
        (num-supernodes, client resources)."""
        from flwr.cli.build import build_fab_from_disk
        from flwr.cli.config_utils import load_and_validate
        from flwr.common.config import parse_config_args
        from flwr.common.serde import fab_to_proto, user_config_to_proto
        from flwr.proto.control_pb2 import StartRunRequest
        from flwr.supercore.fab import Fab
        from flwr.supercore.utils import simulation_config_from_json

        app = app.expanduser().resolve()
        try:
            with warnings.catch_warnings():  # deprecations inside Flower's dependencies
                warnings.simplefilter("ignore", DeprecationWarning)
                load_and_validate(app / "pyproject.toml")
                fab_bytes = build_fab_from_disk(app)
        except (ValueError, OSError) as error:
            raise DeployError(f"the Flower app in {app} cannot be submitted: {error}") from error
        simulation = None
        if federation_config:
            # the same syntax as --run-config; proto fields spell `-` as `_`, as the CLI does
            parsed = parse_config_args([node_config_text(federation_config)])
            simulation = simulation_config_from_json(
                {key.replace("-", "_"): value for key, value in parsed.items()}
            )
        request = StartRunRequest(
            fab=fab_to_proto(Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})),
            override_config=user_config_to_proto(
                parse_config_args([node_config_text(run_config)]) if run_config else {}
            ),
            federation="",
            override_federation_config=simulation,
            app_spec="",
        )
        with self._call(f"start a run of {app}"):
            reply = self.client.StartRun(request)
        if not reply.HasField("run_id"):
            raise DeployError(f"the SuperLink at {self.address} started no run: {reply}")
        return str(reply.run_id)

    def runs(self, run_id: str | None = None) -> dict[str, str]:
        """Each run's status as `flwr ls` writes it ('running', 'finished:completed',
        'finished:failed', ...), by run id; only `run_id`'s when given."""
        from flwr.common.serde import run_from_proto
        from flwr.proto.control_pb2 import ListRunsRequest

        request = ListRunsRequest(run_id=int(run_id)) if run_id else ListRunsRequest()
        with self._call("list its runs"):
            reply = self.client.ListRuns(request)
        statuses = {}
        for proto in reply.run_dict.values():
            run = run_from_proto(proto)
            sub = run.status.sub_status
            statuses[str(run.run_id)] = f"{run.status.status}:{sub}" if sub else run.status.status
        return statuses

    def run_status(self, run_id: str) -> str:
        """The run's status ('unknown' when the SuperLink does not list it)."""
        return self.runs(run_id).get(run_id, "unknown")

    def stop_run(self, run_id: str) -> None:
        from flwr.proto.control_pb2 import StopRunRequest

        with self._call(f"stop run {run_id}"):
            self.client.StopRun(StopRunRequest(run_id=int(run_id)))

    def stop_unfinished_runs(self) -> list[str]:
        """Stop every run the SuperLink does not list as finished (a persistent SuperLink
        keeps the run of a server that died, and that run's ServerApp may still be about);
        returns their ids."""
        stopped = []
        for run_id, status in self.runs().items():
            if not status.startswith("finished"):
                with contextlib.suppress(DeployError):  # it may finish meanwhile
                    self.stop_run(run_id)
                    stopped.append(run_id)
        return stopped

    def register_supernode(self, public_key: Path) -> None:
        """Register a silo's public key with a SuperLink running --enable-supernode-auth:
        only SuperNodes holding a registered key can join. A key the SuperLink knows
        already (its state file kept it: a resumed server) counts as registered."""
        from flwr.cli.supernode.register import try_load_public_key
        from flwr.proto.control_pb2 import RegisterNodeRequest

        try:
            with self._call(f"register the silo key {public_key}"):
                key = try_load_public_key(public_key.expanduser())
                self.client.RegisterNode(RegisterNodeRequest(public_key=key))
        except DeployError as error:
            if ALREADY_REGISTERED not in str(error):
                raise

    def stream_log(self, run_id: str, log_path: Path) -> LogStream:
        """The run's log (the ServerApp's own output) appended to `log_path` as it comes,
        in the background, until the run ends."""
        return LogStream(self.client, run_id, log_path)


class LogStream:
    """A run's log streamed into a file by a daemon thread, as `flwr log RUN --stream`
    does, until the SuperLink has sent all of it (the run ended). A stream that breaks off
    (the SuperLink gone, the client closed) says so at the end of the file: the run's
    status, not the stream, tells whether the run ended."""

    def __init__(self, client: ControlHttpClient, run_id: str, log_path: Path) -> None:
        self.client, self.run_id, self.log_path = client, run_id, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._copy, name=f"log-{run_id}", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        from flwr.proto.control_pb2 import StreamLogsRequest

        with self.log_path.open("a") as log:
            try:
                request = StreamLogsRequest(run_id=int(self.run_id), after_timestamp=0.0)
                for reply in self.client.StreamLogs(request):
                    log.write(reply.log_output)
                    log.flush()
            except Exception as error:
                log.write(f"\nfedlb: the run's log stream broke off here: {error!r}\n")

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` s for the stream to end (it ends soon after its run)."""
        self._thread.join(timeout)
