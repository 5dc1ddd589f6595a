"""fedlb.experiments: emulated workers and clocks, what-if runs, policy comparisons."""

from .benchmarking import Section, markdown_table, run_benchmark
from .clocks import GpuLikeTime, LinearTime, TimeModel, ideal_split, round_time
from .cluster_run import launch
from .cluster_scenario import ClusterScenario, ClusterScenarioError
from .load import CompetingLoad, MachineProbe
from .plots import redraw_plots
from .profiles import EmulatedClock, SpeedProfile, preset
from .results import PolicyResult, load_results, summarise_results
from .runner import run_experiment, run_policy
from .scenario import POLICIES, Policy, Scenario, ScenarioError
from .whatif import CLOCK as WHATIF_CLOCK
from .whatif import what_if

__all__ = [
    "POLICIES",
    "WHATIF_CLOCK",
    "ClusterScenario",
    "ClusterScenarioError",
    "CompetingLoad",
    "EmulatedClock",
    "GpuLikeTime",
    "LinearTime",
    "MachineProbe",
    "Policy",
    "PolicyResult",
    "Scenario",
    "ScenarioError",
    "Section",
    "SpeedProfile",
    "TimeModel",
    "ideal_split",
    "launch",
    "load_results",
    "markdown_table",
    "preset",
    "redraw_plots",
    "round_time",
    "run_benchmark",
    "run_experiment",
    "run_policy",
    "summarise_results",
    "what_if",
]
