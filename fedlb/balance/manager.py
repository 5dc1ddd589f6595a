"""BatchSizeManager: one estimator per worker plus one tuner, behind `step(reports)`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .estimators import SpeedEstimator
from .names import default_estimator, default_tuner
from .reports import WorkerReport
from .split import check_feasible, round_to_total, water_fill
from .tuners import Tuner, TuningInput, renamed

log = logging.getLogger("fedlb.balance")

STATE_VERSION = 1


class BatchSizeManager:
    """Decides every worker's batch size from their reports, keeping X = Σ B_i fixed.

    Args:
        initial: the starting size of every worker (usually B0 each); X is their sum.
        tuner: how sizes move. Default `default_tuner()`: the tuner `defaults.TUNER`
            names (`curve`: `CurvePooled`, which is `PooledProportional`, LB-BSP
            Algorithm 1 on estimates pooled across workers the reports cannot tell apart,
            moved onto measured step-time curves once one speed per worker is shown
            wrong).
        estimator: a factory making one speed estimator per worker. Default
            `default_estimator`: `ChangePointMean()`, the mean since the worker's last
            significant change. (`Proportional()` with `EMA`, α = 0.2, is the papers'.)
        overhead_alpha: EWMA weight of the newest fixed-cost measurement, for estimators
            that do not track fixed costs themselves (`ChangePointMean` does). Default 0.5:
            fixed costs (encryption, upload) are steady, but one stalled upload should not
            swing the split.

    `step(reports)` takes the reports of one boundary and returns the new sizes of all
    workers. A worker with no valid report keeps its size. A report is rejected (logged,
    listed in `last_rejected`, and otherwise ignored) when its times or use fractions are
    not finite and in range, when it names an unknown worker or a batch size the worker was
    not given, or when it repeats a worker within the step.

    Example:
        ```python
        from fedlb.balance import BatchSizeManager, WorkerReport

        manager = BatchSizeManager({"a": 32, "b": 32})        # X = 64, kept
        sizes = manager.step([
            WorkerReport(worker="a", batch_size=32, iterations=10, compute_s=1.0),
            WorkerReport(worker="b", batch_size=32, iterations=10, compute_s=3.0),
        ])                                                     # {"a": 48, "b": 16}
        ```
    """

    def __init__(
        self,
        initial: Mapping[str, int],
        tuner: Tuner | None = None,
        estimator: Callable[[], SpeedEstimator] = default_estimator,
        overhead_alpha: float = 0.5,
    ) -> None:
        if not initial:
            raise ValueError("initial is empty: give every worker a starting batch size")
        bad = {
            w: b
            for w, b in initial.items()
            if isinstance(b, bool) or not isinstance(b, int) or b < 1
        }
        if bad:
            raise ValueError(f"initial batch sizes must be integers >= 1, got {bad}")
        if not 0.0 < overhead_alpha <= 1.0:
            raise ValueError(f"overhead_alpha must be in (0, 1], got {overhead_alpha}")
        self.tuner = tuner if tuner is not None else default_tuner()
        self.estimator_factory = estimator
        self.overhead_alpha = overhead_alpha
        self._sizes: dict[str, int] = dict(initial)
        self.total = sum(self._sizes.values())
        self.tuner.set_population(self.total, len(self._sizes))
        lo, hi = zip(*(self.tuner.bounds(w) for w in self._sizes), strict=True)
        check_feasible(self.total, lo, hi)
        self._given: dict[str, list[int]] = {w: [b] for w, b in self._sizes.items()}
        self.estimators: dict[str, SpeedEstimator] = {w: estimator() for w in self._sizes}
        self._overheads: dict[str, float] = {}
        self._iterations: dict[str, int] = {}
        self.steps = 0
        self.last_rejected: list[tuple[str, str]] = []

    # ---- views -------------------------------------------------------------------------
    @property
    def sizes(self) -> dict[str, int]:
        """Every present worker's current batch size (a copy)."""
        return dict(self._sizes)

    @property
    def workers(self) -> list[str]:
        return list(self._sizes)

    def speeds(self) -> dict[str, float]:
        """Predicted samples/s of every worker that has an estimate."""
        return {w: e.predict() for w, e in self.estimators.items() if e.ready}

    @property
    def overheads(self) -> dict[str, float]:
        """Smoothed fixed seconds per round of every worker that reported one."""
        return dict(self._overheads)

    @property
    def removal_candidates(self) -> set[str]:
        """Workers the tuner found too slow to keep (see the tuner's docs)."""
        return set(self.tuner.removal_candidates)

    # ---- the step ----------------------------------------------------------------------
    def _problem(self, report: object, seen: Mapping[str, WorkerReport]) -> str | None:
        if not isinstance(report, WorkerReport):
            return f"expected a WorkerReport, got {type(report).__name__}"
        found = report.problems()
        if found:
            return "; ".join(found)
        if report.worker not in self._sizes:
            return (
                f"unknown worker (present: {', '.join(self._sizes)}); add it with "
                "add_worker() first"
            )
        if report.worker in seen:
            return "a second report from this worker in one step"
        if report.batch_size not in self._given[report.worker]:
            return (
                f"batch size {report.batch_size} was never given to it "
                f"(it was given {self._given[report.worker]})"
            )
        return None

    def step(
        self, reports: Iterable[WorkerReport], steps: Mapping[str, int] | None = None
    ) -> dict[str, int]:
        """Take one boundary's reports; return every worker's next batch size. `steps`:
        a worker's τ for the split where its next round runs other steps than it reported
        (a round whose steps were cut measures the speed; the next runs its own τ)."""
        accepted: dict[str, WorkerReport] = {}
        self.last_rejected = []
        for report in reports:
            problem = self._problem(report, accepted)
            if problem is not None:
                name = getattr(report, "worker", "?")
                log.warning(
                    "report from worker %s rejected, its batch size is kept: %s", name, problem
                )
                self.last_rejected.append((str(name), problem))
                continue
            accepted[report.worker] = report

        for name, report in accepted.items():
            estimator = self.estimators[name]
            estimator.update(report)
            own = estimator.overhead()
            previous = self._overheads.get(name)
            a = self.overhead_alpha
            if own is not None:
                self._overheads[name] = own
            elif previous is None:
                self._overheads[name] = report.overhead_s
            else:
                self._overheads[name] = a * report.overhead_s + (1 - a) * previous
            self._iterations[name] = (steps or {}).get(name, report.iterations)

        tuned: dict[str, float] = {}
        for name in self._sizes:
            if name not in accepted:
                continue
            speed = self.estimators[name].predict()
            if not (math.isfinite(speed) and speed > 0):
                log.warning(
                    "estimator of worker %s predicted %r samples/s; its batch size is kept",
                    name,
                    speed,
                )
                continue
            tuned[name] = speed

        if tuned:
            given = TuningInput(
                sizes={n: self._sizes[n] for n in tuned},
                speeds=tuned,
                overheads={n: self._overheads[n] for n in tuned},
                iterations={n: self._iterations[n] for n in tuned},
                reports={n: accepted[n] for n in tuned},
                evidence={n: e for n in tuned if (e := self.estimators[n].evidence()) is not None},
            )
            proposal = self.tuner.propose(given)
            self._check_proposal(given, proposal)
            self._sizes.update(proposal)
        self._note_given()
        self.steps += 1
        return self.sizes

    def _note_given(self) -> None:
        # Accept the newest size and the one before it: in non-blocking mode a report
        # arrives one iteration late, measured at the previous size.
        for name, size in self._sizes.items():
            given = self._given.setdefault(name, [size])
            if given[-1] != size:
                self._given[name] = [given[-1], size]

    def _check_proposal(self, given: TuningInput, proposal: Mapping[str, int]) -> None:
        # A tuner that breaks these is a bug: fail loudly rather than train on wrong sizes.
        if set(proposal) != set(given.sizes):
            raise RuntimeError(
                f"{self.tuner.kind} tuner proposed sizes for {sorted(proposal)}, "
                f"expected {sorted(given.sizes)}"
            )
        if sum(proposal.values()) != given.total:
            raise RuntimeError(
                f"{self.tuner.kind} tuner changed the total from {given.total} "
                f"to {sum(proposal.values())}"
            )
        for name, size in proposal.items():
            lo, hi = self.tuner.bounds(name)
            if not isinstance(size, int) or not lo <= size <= hi:
                raise RuntimeError(
                    f"{self.tuner.kind} tuner proposed {size!r} for {name}, outside [{lo}, {hi}]"
                )

    def set_min_share(self, share: float) -> dict[str, int]:
        """From now on every worker gets at least ⌈share·X/n⌉ samples (the tuner's floor:
        `PooledProportional(min_share=...)`); workers below it are raised to it now and
        the others give up samples in proportion. X is kept. Returns the new sizes.
        A tuner without a floor (Proportional, Static, ...) keeps its sizes (a warning)."""
        if not hasattr(self.tuner, "min_share"):
            log.warning(
                "the %s tuner has no min_share floor: sizes are not tightened", self.tuner.kind
            )
            return self.sizes
        if not (math.isfinite(share) and 0.0 <= share <= 1.0):
            raise ValueError(f"min_share must be in [0, 1], got {share}")
        self.tuner.min_share = share
        self.tuner.set_population(self.total, len(self._sizes), strict=False)
        self._sizes = self._redivide(self._sizes, self.total)
        self._note_given()
        return self.sizes

    # ---- membership --------------------------------------------------------------------
    def _redivide(self, sizes: Mapping[str, int], total: int) -> dict[str, int]:
        """Scale `sizes` to `total` keeping their proportions (they encode the balance)."""
        names = list(sizes)
        lo, hi = zip(*(self.tuner.bounds(n) for n in names), strict=True)
        _, real = water_fill([float(sizes[n]) for n in names], [0.0] * len(names), total, lo, hi)
        return dict(zip(names, round_to_total(real, total, list(lo), list(hi)), strict=True))

    def add_worker(self, name: str, size: int | None = None, grow: bool = False) -> dict[str, int]:
        """Add a worker between steps.

        By default X stays the same and is re-divided: the newcomer gets `size` (default a
        fair share X/n: nothing is known of its speed) and the others share the rest in
        their current proportions. With `grow`, the newcomer brings its `size` samples: X
        grows by it and the others keep theirs (a silo joining with its own batch size).
        Its estimator starts empty either way. Returns the new sizes.
        """
        if name in self._sizes:
            raise ValueError(f"worker {name!r} is already present")
        if grow and (size is None or isinstance(size, bool) or size < 1):
            raise ValueError(f"growing X needs the newcomer's size >= 1, got {size!r}")
        n = len(self._sizes) + 1
        total = self.total + size if grow and size is not None else self.total
        try:
            self.tuner.set_population(total, n)
        except ValueError as error:
            self.tuner.set_population(self.total, n - 1, strict=False)
            raise ValueError(f"cannot add worker {name!r}: {error}") from error
        lo, hi = self.tuner.bounds(name)
        share = size if size is not None else int(max(lo, min(hi, total // n)))
        if total - share < lo * (n - 1) or share < lo:
            self.tuner.set_population(self.total, n - 1, strict=False)
            raise ValueError(
                f"cannot add worker {name!r}: a total of {total} cannot give {n} workers "
                f"at least {lo} samples each"
            )
        others = self._redivide(self._sizes, total - share)
        self.total = total
        self._sizes = {**others, name: share}
        self.estimators[name] = self.estimator_factory()
        self._note_given()
        return self.sizes

    def remove_worker(self, name: str, shrink: int = 0) -> dict[str, int]:
        """Remove a worker between steps; X, less `shrink` samples (what the worker
        brought when it joined with `grow`; default 0: X is kept), is re-divided among the
        rest in their proportions. Returns the new sizes."""
        if name not in self._sizes:
            raise ValueError(f"worker {name!r} is not present")
        if len(self._sizes) == 1:
            raise ValueError(f"cannot remove {name!r}: it is the last worker")
        rest = {w: b for w, b in self._sizes.items() if w != name}
        total = self.total - shrink
        if shrink < 0 or total < len(rest):
            raise ValueError(f"cannot shrink X = {self.total} by {shrink} for {len(rest)} workers")
        self.total = total
        self.tuner.set_population(self.total, len(rest), strict=False)
        self._sizes = self._redivide(rest, self.total)
        del self.estimators[name], self._given[name]
        self._overheads.pop(name, None)
        self._iterations.pop(name, None)
        self.tuner.forget(name)
        self._note_given()
        return self.sizes

    def rename_workers(self, names: Mapping[str, str]) -> None:
        """Go on under new names (`names`: old -> new) for the same workers, everything
        known of each (size, estimator, the tuner's memory) following it: a server that
        restarted, whose silos rejoined under new node ids. Sizes are unchanged."""
        if unknown := sorted(set(names) - set(self._sizes)):
            raise ValueError(f"cannot rename {unknown}: not workers of this manager")
        kept = set(self._sizes) - set(names)
        new = list(names.values())
        if len(set(new)) < len(new) or kept & set(new):
            raise ValueError(f"renaming {dict(names)} would give two workers one name")
        self._sizes = renamed(self._sizes, names)
        self._given = renamed(self._given, names)
        self._overheads = renamed(self._overheads, names)
        self._iterations = renamed(self._iterations, names)
        self.estimators = renamed(self.estimators, names)
        self.tuner.rename_workers(names)

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly where this manager is (JSON-serialisable)."""
        return {
            "version": STATE_VERSION,
            "total": self.total,
            "sizes": dict(self._sizes),
            "given": {w: list(g) for w, g in self._given.items()},
            "overheads": dict(self._overheads),
            "iterations": dict(self._iterations),
            "steps": self.steps,
            "estimators": {w: e.state_dict() for w, e in self.estimators.items()},
            "tuner": self.tuner.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`. The tuner and estimator kinds must match this manager's."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"manager state version {state.get('version')!r} is not {STATE_VERSION}: it was "
                "written by an incompatible fedlb"
            )
        self.tuner.load_state_dict(dict(state["tuner"]))
        estimators: dict[str, SpeedEstimator] = {}
        for name, est_state in state["estimators"].items():
            estimators[name] = self.estimator_factory()
            estimators[name].load_state_dict(dict(est_state))
        self.estimators = estimators
        self.total = int(state["total"])
        self._sizes = {w: int(b) for w, b in state["sizes"].items()}
        self._given = {w: [int(x) for x in g] for w, g in state["given"].items()}
        self._overheads = {w: float(x) for w, x in state["overheads"].items()}
        self._iterations = {w: int(x) for w, x in state["iterations"].items()}
        self.steps = int(state["steps"])
        self.tuner.set_population(self.total, len(self._sizes), strict=False)
