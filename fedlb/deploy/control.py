"""The SuperLink's Control API, called from this process: submit a run, ask its status,
stream its log, stop runs, register silo keys.

Each `flwr` CLI call is a fresh Python process that imports flwr (~1.1 s of CPU here); a
deployed run took four of them (list, run, log --stream, ls) on its critical path, on the
same cores as the silos. Flower's CLI makes each call through `ControlHttpClient`; this
module makes the same calls with the same client and the same request builders, in the
process that already has flwr imported. The `flwr` CLI still works against the SuperLink
(FLWR_HOME/config.toml names it; see `processes.write_connection`).

Flower pieces relied on, each in fedlb._flower_internals (checked by name in
tests/test_flower_internals_*.py; tests/test_flower_deploy_*.py exercise them on real
processes, so a Flower upgrade that changes one fails a test, not a user's run):
`flwr.supercore.control.ControlHttpClient` (StartRun, ListRuns, StopRun, StreamLogs,
RegisterNode), `flwr.cli.config_utils.load_and_validate`, `flwr.cli.build.build_fab_from_disk`,
`flwr.common.config.parse_config_args`, `flwr.common.serde` (fab_to_proto,
user_config_to_proto, run_from_proto), `flwr.supercore.utils.simulation_config_from_json`.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fedlb import _flower_internals as flower

from .errors import DeployError
from .processes import node_config_text

ALREADY_REGISTERED = flower.ALREADY_REGISTERED  # a resumed server's SuperLink kept it


class Control:
    """A client of one SuperLink's Control API (`address`, TLS when `root_certificates`
    is the CA's PEM file). Close it (or use it as a context manager) when done."""

    def __init__(self, address: str, root_certificates: Path | None = None) -> None:
        self.address = address
        self.client: Any = flower.control_client(
            address, None if root_certificates is None else root_certificates.read_bytes()
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

        try:
            with flower.cli_errors():
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
        app = app.expanduser().resolve()
        try:
            fab_bytes = flower.build_fab(app)
        except (ValueError, OSError) as error:
            raise DeployError(f"the Flower app in {app} cannot be submitted: {error}") from error
        simulation = None
        if federation_config:
            # the same syntax as --run-config; proto fields spell `-` as `_`, as the CLI does
            parsed = flower.parse_config(node_config_text(federation_config))
            simulation = {key.replace("-", "_"): value for key, value in parsed.items()}
        request = flower.start_run_request(
            hashlib.sha256(fab_bytes).hexdigest(),
            fab_bytes,
            flower.parse_config(node_config_text(run_config)) if run_config else {},
            simulation,
        )
        with self._call(f"start a run of {app}"):
            reply = self.client.StartRun(request)
        if not reply.HasField("run_id"):
            raise DeployError(f"the SuperLink at {self.address} started no run: {reply}")
        return str(reply.run_id)

    def runs(self, run_id: str | None = None) -> dict[str, str]:
        """Each run's status as `flwr ls` writes it ('running', 'finished:completed',
        'finished:failed', ...), by run id; only `run_id`'s when given."""
        with self._call("list its runs"):
            reply = self.client.ListRuns(flower.list_runs_request(run_id))
        return flower.run_statuses(reply)

    def run_status(self, run_id: str) -> str:
        """The run's status ('unknown' when the SuperLink does not list it)."""
        return self.runs(run_id).get(run_id, "unknown")

    def stop_run(self, run_id: str) -> None:
        with self._call(f"stop run {run_id}"):
            self.client.StopRun(flower.stop_run_request(run_id))

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
        try:
            with self._call(f"register the silo key {public_key}"):
                request = flower.register_node_request(public_key.expanduser())
                self.client.RegisterNode(request)
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

    def __init__(self, client: Any, run_id: str, log_path: Path) -> None:
        self.client, self.run_id, self.log_path = client, run_id, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._copy, name=f"log-{run_id}", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        with self.log_path.open("a") as log:
            try:
                request = flower.stream_logs_request(self.run_id)
                for reply in self.client.StreamLogs(request):
                    log.write(reply.log_output)
                    log.flush()
            except Exception as error:
                log.write(f"\nfedlb: the run's log stream broke off here: {error!r}\n")

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` s for the stream to end (it ends soon after its run)."""
        self._thread.join(timeout)
