"""Experiments: the training loop that single-process, ensemble and data-parallel training share; checkpoints;
evaluation; the comparison of every attention (``gpattn compare``) and its typed records; statistics over seeds (paired
differences with intervals); the toy regression fit (exact GP vs KEP-SVGP via VariationalELBO and Pyro SVI)."""

from .checkpoints import CHECKPOINT_KEYS, CheckpointError, load_checkpoint
from .compare import COMPARE_VARIANTS, DEFAULT_ATTENTIONS, CompareConfig, compare_rows, train_and_evaluate
from .ensembles import member_seed, train_ensemble
from .evaluation import Evaluation, ensemble_logits, ensemble_probabilities, evaluate, evaluate_models, model_fidelity
from .records import (
    ClassificationMetrics,
    OODMetrics,
    ReliabilityBins,
    RunMetrics,
    RunRecord,
    ShiftMetrics,
    TemperatureScaled,
    TrainingSummary,
    read_records,
)
from .report import markdown_table, with_temperature_scaled, write_outputs
from .runner import run_comparison
from .schedule import warmup_cosine_lr, warmup_cosine_schedule
from .statistics import (
    INTERVAL_METHODS,
    PairedDifference,
    SeedSummary,
    compare_to_reference,
    paired_difference,
    summarize_seeds,
)
from .tasks import DEFAULT_TASKS, PUBLISHED_ACCURACIES, TASKS, TaskData, load_task
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
    NonFiniteLossError,
    TrainConfig,
    TrainingDivergedError,
    TrainingStrategy,
    TrainResult,
    train_model,
)

__all__ = [
    "COMPARE_VARIANTS",
    "DEFAULT_ATTENTIONS",
    "CompareConfig",
    "compare_rows",
    "with_temperature_scaled",
    "markdown_table",
    "run_comparison",
    "train_and_evaluate",
    "write_outputs",
    "DEFAULT_TASKS",
    "PUBLISHED_ACCURACIES",
    "TASKS",
    "TaskData",
    "load_task",
    "ClassificationMetrics",
    "OODMetrics",
    "ReliabilityBins",
    "RunMetrics",
    "RunRecord",
    "ShiftMetrics",
    "TemperatureScaled",
    "TrainingSummary",
    "read_records",
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
    "TrainingDivergedError",
    "TrainingStrategy",
    "Evaluation",
    "ensemble_logits",
    "ensemble_probabilities",
    "evaluate",
    "evaluate_models",
    "model_fidelity",
    "load_checkpoint",
    "member_seed",
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
    "DataParallelStrategy",
    "parameter_checksum",
    "shard_indices",
    "train_distributed",
]

_DISTRIBUTED = ("DataParallelStrategy", "parameter_checksum", "shard_indices", "train_distributed")


def __getattr__(name: str):
    # imported lazily, so that ``python -m gpattn.experiments.distributed`` does not find the module already loaded
    if name in _DISTRIBUTED:
        from . import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
