"""fedlb's ServerApp: LoadBalancedFedAvg on the run's settings, results to out-dir."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from rich.console import Console

from fedlb.balance import BatchSizeManager, StabilityGuard, make_estimator, make_tuner
from fedlb.flower import (
    RUN_FILES,
    Balancing,
    Checkpoint,
    CheckpointError,
    EncryptedAggregation,
    Joining,
    Keeping,
    LoadBalancedFedAvg,
    RoundReporter,
    check_resume,
    load_checkpoint,
    save_encrypted,
)
from fedlb.flower.protocol import LEARNING_RATE
from fedlb.security import write_digest
from fedlb.training import evaluate, tensor_dataset

from .run_config import ConfigError, RunConfig
from .task import check_partition, federation_data, model_for

log = logging.getLogger("fedlb.flower")

app = ServerApp()


def make_balancer(config: RunConfig) -> Callable[[Mapping[str, int]], BatchSizeManager]:
    """The run's balancer, from its tuner and estimator settings (with the defaults,
    exactly `BatchSizeManager(initial)`: what LoadBalancedFedAvg uses by default)."""
    return lambda initial: BatchSizeManager(
        initial,
        make_tuner(config.tuner, config.min_batch, config.max_batch or None, config.min_share),
        make_estimator(config.estimator),
    )


def build_strategy(
    config: RunConfig,
    reporter: RoundReporter,
    strategy_class: type[LoadBalancedFedAvg] = LoadBalancedFedAvg,
    **extra: Any,
) -> LoadBalancedFedAvg:
    """The run's strategy from its settings; `strategy_class` and `extra` arguments: an
    experiment's variant of LoadBalancedFedAvg (fedlb.experiments' policies)."""
    out_dir = Path(config.out_dir) if config.out_dir else None
    balancing = Balancing(
        batch_size=config.batch_size,
        local_steps=config.local_steps,
        balancer=make_balancer(config),
        guard=StabilityGuard(probe=config.guard_probe) if config.guard else False,
        profiles=bool(config.profiles),
        edge=config.guard_edge,
    )
    return strategy_class(
        min_available_nodes=config.num_silos,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        balancing=balancing,
        joining=Joining(
            expected_silos=config.num_silos,
            max_share=config.max_share or None,
            examples=config.declared_examples(),
        ),
        keeping=Keeping(
            reporter=reporter,
            checkpoint_dir=out_dir,
            run_settings=fresh_settings(config),
            audit_dir=out_dir / "updates" if config.keep_updates and out_dir else None,
        ),
        evaluate_every=config.evaluate_every,
        evaluate_with_train=config.evaluate_mode == "with-train",
        poll_interval=config.poll_interval or None,
        he=EncryptedAggregation.from_file(config.he_context) if config.he_context else None,
        **extra,
    )


def fresh_settings(config: RunConfig) -> dict[str, Any]:
    """The settings a checkpoint records: those of the run as if it had never stopped."""
    return {**config.to_mapping(), "resume": ""}


def checkpoint_to_resume(config: RunConfig) -> Checkpoint:
    """The checkpoint `config.resume` names, checked against this run's settings."""
    checkpoint = load_checkpoint(Path(config.resume))
    try:
        check_resume(checkpoint, fresh_settings(config), config.num_rounds, config.resume)
    except CheckpointError as error:
        raise ConfigError(str(error)) from error
    return checkpoint


def _log_fedlb() -> None:
    """fedlb's INFO lines (waiting for silos, joins, probe sizes) into the ServerApp log."""
    logger = logging.getLogger("fedlb")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("fedlb %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


@app.main()
def main(grid: Grid, context: Context) -> None:
    _log_fedlb()
    run_app(grid, RunConfig.from_mapping(context.run_config))


def run_app(
    grid: Grid,
    config: RunConfig,
    strategy_class: type[LoadBalancedFedAvg] = LoadBalancedFedAvg,
    strategy_args: Mapping[str, Any] | None = None,
) -> None:
    """fedlb's ServerApp body: the run `config` describes, results to its out-dir. An
    experiment's ServerApp calls it with its policy's strategy class and arguments."""
    check_partition(config)
    checkpoint = checkpoint_to_resume(config) if config.resume else None
    out_dir = Path(config.out_dir) if config.out_dir else None
    reporter = RoundReporter(
        out_dir,
        Console(),
        keep_before=checkpoint.first_unpublished_round if checkpoint else None,
        done=checkpoint.round if checkpoint else None,
        num_rounds=config.num_rounds,
        tensorboard=bool(config.tensorboard),
    )
    pool, server_test = federation_data(config)
    model = model_for(config, pool)
    test_set = tensor_dataset(server_test.x, server_test.y) if len(server_test) else None

    def server_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if test_set is None:
            return None
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(model, test_set)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    strategy = build_strategy(config, reporter, strategy_class, **(strategy_args or {}))
    strategy.balance.verdicts.app = config.training_settings()  # the guard's verdict is kept under
    if strategy.he is not None:
        log.info(
            "HE on: updates are averaged as CKKS ciphertexts (key %s); the server holds no "
            "secret key and evaluation is federated only",
            strategy.he.fingerprint,
        )
    initial = ArrayRecord(model.state_dict())
    if checkpoint is not None:
        initial = strategy.restore(checkpoint)
        story = checkpoint.story(config.num_rounds, Path(config.resume))
        log.info("resuming %s: %s", config.resume, story)
    # Flower's strategies sample silos with Python's random: the run's seed fixes it (a
    # resumed run's checkpoint put back the state it had reached)
    if checkpoint is None:
        random.seed(config.seed)
    started = time.monotonic()
    try:
        result = strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=config.num_rounds,
            timeout=config.round_timeout,
            train_config=ConfigRecord({LEARNING_RATE: config.learning_rate}),
            evaluate_fn=None if strategy.he is not None else server_evaluate,
        )
    finally:
        reporter.close()
    if out_dir is not None:
        if strategy.he is not None:  # still encrypted: `fedlb decrypt` at a silo opens it
            model_path = save_encrypted(result.arrays, out_dir / RUN_FILES.encrypted_model)
        else:
            import torch

            model_path = out_dir / RUN_FILES.model
            torch.save(result.arrays.to_torch_state_dict(), model_path)
        write_digest(model_path)
        summary = {
            **reporter.summary(),
            # the rounds' wall over the whole run: a resumed run's earlier rounds included
            "wall_s": sum(r.total_wall_s for r in reporter.records),
            "process_wall_s": time.monotonic() - started,  # this server process's share
            "resumed_after": checkpoint.round if checkpoint is not None else None,
            "final_sizes": strategy.sizes_by_silo(),
            "settings": config.to_mapping(),
        }
        (out_dir / RUN_FILES.summary).write_text(json.dumps(summary, indent=2))
        log.info("results written to %s", out_dir)
