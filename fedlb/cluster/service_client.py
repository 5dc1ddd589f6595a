"""The manager service's client: what a worker of any framework calls (see service.py)."""

from __future__ import annotations

import json
from pathlib import Path

from .policies import DEFAULT_CLUSTER_POLICY
from .service_auth import call_metadata, client_channel, read_token
from .service_requests import encode

SERVICE = "fedlb.BatchSizeManager"


class ManagerClient:
    """A worker's side: `register` once, then `report` at every iteration boundary.

    `token`: sent with every call (default: $FEDLB_MANAGER_TOKEN if set).
    `root_certificates`: TLS, trusting this CA (a file such as the ca.crt of `fedlb certs`, or its
    PEM bytes); None: a plain channel."""

    def __init__(
        self,
        address: str,
        timeout: float = 120.0,
        *,
        token: str | None = None,
        root_certificates: Path | bytes | None = None,
    ) -> None:
        self.channel = client_channel(address, root_certificates)
        self.timeout = timeout
        self._metadata = call_metadata(token if token is not None else read_token())
        self._register = self.channel.unary_unary(
            f"/{SERVICE}/Register", request_serializer=encode, response_deserializer=json.loads
        )
        self._report = self.channel.unary_unary(
            f"/{SERVICE}/Report", request_serializer=encode, response_deserializer=json.loads
        )

    def register(
        self, job: str, workers: list[str], batch_size: int, policy: str = DEFAULT_CLUSTER_POLICY
    ) -> dict[str, int]:
        answer = self._register(
            {"job": job, "workers": workers, "batch_size": batch_size, "policy": policy},
            timeout=self.timeout,
            metadata=self._metadata,
        )
        return dict(answer["sizes"])

    def report(
        self,
        job: str,
        worker: str,
        iteration: int,
        batch_size: int,
        compute_s: float,
        *,
        cpu: float | None = None,
        mem: float | None = None,
        accel_mem: float | None = None,
        wait: bool = True,
    ) -> int:
        """This worker's next batch size."""
        request = {
            "job": job,
            "worker": worker,
            "iteration": iteration,
            "batch_size": batch_size,
            "compute_s": compute_s,
            "cpu": cpu,
            "mem": mem,
            "accel_mem": accel_mem,
            "wait": wait,
        }
        answer = self._report(request, timeout=self.timeout, metadata=self._metadata)
        return int(answer["batch_size"])

    def close(self) -> None:
        self.channel.close()
