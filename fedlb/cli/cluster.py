"""`fedlb cluster`: a load-balanced data-parallel job on this machine under torchrun."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from fedlb._markup import plain
from fedlb.balance import defaults
from fedlb.cluster import CLUSTER_POLICIES, DEFAULT_CLUSTER_POLICY
from fedlb.experiments import ClusterScenario, ClusterScenarioError, launch
from fedlb.models import MODELS
from fedlb.training import STEP_CURVES

from .common import UsageError, app, console, holding


def _failure(log_path: Path) -> str:
    """The job's own reason from its log: a rank killed by a signal (in torchrun's failure
    list, which names the root cause as the first rank to report, often a survivor that
    lost its peer) before the survivors' reports, else fedlb's message, else torchrun's
    root cause. SIGTERM is torchrun stopping the rest, not a cause."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    # torchrun's entries: "  rank      : 2 (local_rank: 2)" then "  exitcode  : -9 (pid: ...)"
    failures = re.findall(r"^\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", text, re.M)
    killed = [(rank, -int(code)) for rank, code in failures if int(code) < 0 and code != "-15"]
    if killed:
        rank, signal_number = killed[0]
        return f"rank {rank} was killed by signal {signal_number}; the job stopped"
    ours = [line for line in text.splitlines() if line.startswith("fedlb cluster:")]
    if ours:
        return ours[0].removeprefix("fedlb cluster: ")
    # a rank's own exception (a dataset not installed, say): its last line says what to do
    raised = re.findall(r"^(?:\[rank\d+\]:)?\s*(\w+(?:Error|Exception): .+)$", text, re.M)
    raised = [line for line in raised if not line.startswith("ChildFailedError")]
    if raised:
        return f"a rank stopped with {raised[0]}"
    cause = re.search(
        r"Root Cause.*?^\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", text, re.S | re.M
    )
    if cause:
        rank, code = cause.groups()
        how = f"was killed by signal {-int(code)}" if int(code) < 0 else f"exited with {code}"
        return f"rank {rank} {how}; the job stopped"
    return "see the log"


@app.command()
def cluster(
    scenario: Annotated[Path | None, typer.Argument(help="Cluster scenario TOML.")] = None,
    nproc: Annotated[int | None, typer.Option(help="Ranks (processes) on this machine.")] = None,
    policies: Annotated[
        str | None,
        typer.Option(
            help=f"Comma list (default bsp,{DEFAULT_CLUSTER_POLICY}) of: "
            + "; ".join(
                f"{name}{'' if p.parameter is None else f'[:{p.parameter}]'} ({p.description})"
                for name, p in CLUSTER_POLICIES.items()
            )
        ),
    ] = None,
    iterations: Annotated[int | None, typer.Option(help="Iterations per policy.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="B0 per rank; X = nproc x B0.")] = None,
    speeds: Annotated[
        str | None,
        typer.Option(
            help="Relative speed per rank (bigger is faster), e.g. 1,1,2,4; an entry "
            "curve:NAME follows a measured step-time curve of the job's model (NAME*K: its "
            "times x K): " + ", ".join(STEP_CURVES) + "."
        ),
    ] = None,
    base_speed: Annotated[float | None, typer.Option(help="Samples/s of speed 1.")] = None,
    traces: Annotated[
        str | None, typer.Option(help="static, step:I:F, periodic:P:F, walk:S (per rank).")
    ] = None,
    load: Annotated[
        float | None,
        typer.Option(help="Competing load per rank: chance per 0.1 s it starts or stops."),
    ] = None,
    dataset: Annotated[str | None, typer.Option(help="Dataset (fedlb's table).")] = None,
    model: Annotated[str | None, typer.Option(help="Model: " + ", ".join(MODELS) + ".")] = None,
    target_accuracy: Annotated[
        float | None, typer.Option(help="Report time and updates to this test accuracy.")
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(help="Each rank's device: auto (cuda:LOCAL_RANK if any), cpu, cuda."),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            help="Gradients' backend: auto (nccl with a GPU per rank, else gloo), gloo, nccl."
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="Results folder.")] = Path("runs/cluster"),
    timeout: Annotated[float, typer.Option(help="Seconds before a job is stopped.")] = 600.0,
) -> None:
    """Run one data-parallel job per policy with torchrun (loopback; gloo, or NCCL with a
    GPU per rank), each rank emulating its own speed or measured step-time curve (clock:
    measured, sleep-padded), and compare them with BSP."""
    from fedlb.deploy import as_settings, read_toml

    values: dict[str, Any] = read_toml(scenario, "cluster scenario") if scenario else {}
    # a list of jobs, not a job setting: BSP beside fedlb's default controller
    file_policies = values.pop("policies", f"bsp,{DEFAULT_CLUSTER_POLICY}")
    chosen_policies = policies or str(file_policies)
    flags = as_settings(
        nproc=nproc,
        iterations=iterations,
        batch_size=batch_size,
        speeds=speeds,
        base_speed=base_speed,
        traces=traces,
        load=load,
        dataset=dataset,
        model=model,
        target_accuracy=target_accuracy,
        device=device,
        backend=backend,
    )
    values.update(flags)
    names = [p.strip() for p in chosen_policies.split(",") if p.strip()]
    try:
        jobs = {p: ClusterScenario.from_mapping({**values, "policy": p}) for p in names}
    except ClusterScenarioError as error:
        raise UsageError(str(error)) from error
    first = next(iter(jobs.values()))
    with holding(out, "--out"):  # one fedlb cluster at a time per results folder
        on_curves = all(e.strip().startswith("curve:") for e in first.speeds.split(","))
        console.print(
            f"[bold]fedlb cluster[/]: {first.nproc} ranks, speeds {plain(first.speeds)}"
            f"{'' if on_curves else f' x {first.base_speed:g} samples/s'}, "
            f"X = {first.nproc * first.batch_size}, {first.iterations} iterations; devices "
            f"{plain(first.device)}, backend {first.placement()[1]}; clock: "
            f"{plain(first.clock_label())}, "
            "sleep-padded"
        )
        summaries = _run_jobs(jobs, out, timeout)
    table = Table(
        title=f"time per update and accuracy, clock: {plain(first.clock_label())}",
        caption=f"ceiling these speeds allow over BSP: {first.ceiling():.2f}x (compute only)",
        title_justify="left",
        caption_justify="left",
    )
    target = first.target_accuracy
    columns = ["policy", "ms / update", "speedup vs bsp", "E (steady)", "final acc"]
    if target:
        columns += [f"s to {target:g}", f"updates to {target:g}"]
    columns.append("final sizes")
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    base = summaries.get("bsp", {}).get("mean_update_s")
    for name, summary in summaries.items():
        speedup = base / summary["mean_update_s"] if base else None
        steady = summary.get("steady_efficiency")
        row = [
            plain(name),
            f"{summary['mean_update_s'] * 1000:.1f}",
            "–" if speedup is None else f"{speedup:.2f}x",
            "–" if steady is None else f"{steady:.3f}",
            f"{summary['final_accuracy']:.3f}",
        ]
        if target:
            seconds, updates = summary["time_to_target_s"], summary["updates_to_target"]
            row += [
                "–" if seconds is None else f"{seconds:.1f}",
                "–" if updates is None else str(updates),
            ]
        row.append(plain(summary.get("final_sizes", "–")))  # read back from its file
        table.add_row(*row)
    console.print(table)
    console.print(f"results: {plain(out)}/<policy>/iterations.jsonl, summary.json, torchrun.log")


def _run_jobs(
    jobs: dict[str, ClusterScenario], out: Path, timeout: float
) -> dict[str, dict[str, Any]]:
    """Each policy's job in out/<policy>, said as it ends; their summaries (exit 1 at the
    first that fails)."""
    summaries: dict[str, dict[str, Any]] = {}
    for name, job in jobs.items():
        folder = out / name.replace(":", "-")
        code = launch(job, folder, timeout)
        if code != 0:
            # gloo's messages hold [file:line] parts that rich would read as markup
            reason = plain(_failure(folder / "torchrun.log"))
            console.print(f"[red]{plain(name)}: the job failed[/]: {reason}")
            console.print(f"log: {plain(folder / 'torchrun.log')}")
            raise typer.Exit(1)
        summaries[name] = json.loads((folder / "summary.json").read_text())
        summary = summaries[name]
        accuracy = summary["final_accuracy"]
        console.print(
            f"  {plain(name)}: {summary['mean_update_s'] * 1000:.1f} ms per update, "
            f"{summary['updates']} updates in {summary['wall_s']:.1f} s"
            + ("" if accuracy is None else f", accuracy {accuracy:.3f}")
        )
    return summaries


@app.command()
def manager(
    port: Annotated[int, typer.Option(help="Port to listen on; 0: a free one (printed).")] = 50071,
    host: Annotated[
        str, typer.Option(help="Address to listen on (no token or TLS: loopback only).")
    ] = "127.0.0.1",
    max_workers: Annotated[
        int,
        typer.Option(help="Threads; waiting reports may hold all but an eighth of them."),
    ] = 64,
    wait_timeout: Annotated[
        float, typer.Option(help="Seconds a waiting report waits for the other workers.")
    ] = 60.0,
    max_jobs: Annotated[int, typer.Option(help="Jobs held at once.")] = 64,
    max_job_workers: Annotated[int, typer.Option(help="Workers of one job.")] = 1024,
    job_idle_timeout: Annotated[
        float, typer.Option(help="Seconds without a call after which a job is forgotten.")
    ] = 3600.0,
    token_file: Annotated[
        Path | None,
        typer.Option(help="A file holding the token calls must carry (else $FEDLB_MANAGER_TOKEN)."),
    ] = None,
    certs: Annotated[
        Path | None, typer.Option(help="TLS: the folder of `fedlb certs` (server.crt, server.key).")
    ] = None,
) -> None:
    """Serve the BatchSizeManager over gRPC for workers of any framework (the docs:
    Explanation, Cluster mode): each worker reports its iteration and gets its next batch size."""
    import math
    import signal
    import threading

    from fedlb.cluster import ManagerSetupError, ServiceLimits, start_manager

    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535 (0: a free port), got {port}")
    for flag, count in (
        ("--max-workers", max_workers),
        ("--max-jobs", max_jobs),
        ("--max-job-workers", max_job_workers),
    ):
        if count < 1:
            raise UsageError(f"{flag} must be >= 1, got {count}")
    for flag, seconds in (
        ("--wait-timeout", wait_timeout),
        ("--job-idle-timeout", job_idle_timeout),
    ):
        if not math.isfinite(seconds) or seconds <= 0:
            raise UsageError(f"{flag} must be a number of seconds > 0, got {seconds}")
    limits = ServiceLimits(max_jobs, max_job_workers, job_idle_timeout)
    try:
        server, bound, service, token_on = start_manager(
            port, host, max_workers, wait_timeout, limits, token_file, certs
        )
    except ManagerSetupError as error:
        raise UsageError(str(error)) from error
    shown = plain(host)  # an IPv6 address in brackets is no markup
    console.print(f"[bold]fedlb manager[/] on {shown}:{bound} (gRPC, fedlb.BatchSizeManager)")
    guards = [f"token {'on' if token_on else 'off'}", f"TLS {'on' if certs else 'off'}"]
    console.print(
        f"  {', '.join(guards)}; at most {max_jobs} jobs of {max_job_workers} workers, "
        f"{service.limits.max_waiting} waiting reports"
    )
    console.print(
        f"  a job registered without a policy gets {DEFAULT_CLUSTER_POLICY}: "
        f"{defaults.controller()} (fedlb's default controller)"
    )
    if not token_on and host not in ("127.0.0.1", "localhost", "::1"):
        console.print(
            f"[yellow]warning[/]: no token on {shown}: anyone who reaches this port can "
            "register jobs and report (see --token-file)"
        )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    service.close()  # waiting reports end now, not at their timeout
    server.stop(grace=1.0).wait()
    console.print("fedlb manager stopped")
