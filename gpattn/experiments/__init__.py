"""Experiments: the toy regression fit (exact GP vs KEP-SVGP via VariationalELBO and Pyro SVI); the training loop;
the comparison of every attention (``gpattn compare``); statistics over seeds (paired differences with intervals)."""

from .compare import CompareConfig, markdown_table, run_comparison, write_outputs
from .statistics import (
    INTERVAL_METHODS,
    PairedDifference,
    SeedSummary,
    compare_to_reference,
    paired_difference,
    summarize_seeds,
)
from .toy_regression import (
    ToyRegressionConfig,
    ToyRegressionResult,
    fit_exact_gp,
    fit_pair_svgp,
    fit_pair_svgp_pyro,
    format_result,
    run_toy_regression,
)
from .training import (
    CHECKPOINT_KEYS,
    CheckpointError,
    NonFiniteLossError,
    TrainConfig,
    TrainResult,
    ensemble_probabilities,
    evaluate,
    load_checkpoint,
    train_ensemble,
    train_model,
    warmup_cosine_lr,
    warmup_cosine_schedule,
)

__all__ = [
    "CompareConfig",
    "markdown_table",
    "run_comparison",
    "write_outputs",
    "INTERVAL_METHODS",
    "PairedDifference",
    "SeedSummary",
    "compare_to_reference",
    "paired_difference",
    "summarize_seeds",
    "CHECKPOINT_KEYS",
    "CheckpointError",
    "NonFiniteLossError",
    "TrainConfig",
    "TrainResult",
    "ensemble_probabilities",
    "evaluate",
    "load_checkpoint",
    "train_ensemble",
    "train_model",
    "warmup_cosine_lr",
    "warmup_cosine_schedule",
    "ToyRegressionConfig",
    "ToyRegressionResult",
    "fit_exact_gp",
    "fit_pair_svgp",
    "fit_pair_svgp_pyro",
    "format_result",
    "run_toy_regression",
    "parameter_checksum",
    "shard_indices",
    "train_distributed",
]

_DISTRIBUTED = ("parameter_checksum", "shard_indices", "train_distributed")


def __getattr__(name: str):
    # imported lazily, so that ``python -m gpattn.experiments.distributed`` does not find the module already loaded
    if name in _DISTRIBUTED:
        from . import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
