"""The former home of the training loop and the comparison, kept so that code written against it keeps working:
every name it exported is re-exported here from its new home, :mod:`gpattn.training` (the loop, its settings,
checkpoints, schedule, ensembles, data-parallel training) or :mod:`gpattn.comparison` (tasks, runs, evaluation,
records, statistics, report, the toy regression); the rows of the comparison are :mod:`gpattn.methods`. New code
imports from those packages.
"""

from ..comparison import (
    DEFAULT_ATTENTIONS,
    DEFAULT_TASKS,
    INTERVAL_METHODS,
    PUBLISHED_ACCURACIES,
    TASKS,
    ClassificationMetrics,
    CompareConfig,
    Evaluation,
    OODMetrics,
    PairedDifference,
    ReliabilityBins,
    RunMetrics,
    RunRecord,
    SeedSummary,
    ShiftMetrics,
    TaskData,
    TemperatureScaled,
    ToyRegressionConfig,
    ToyRegressionResult,
    TrainingSummary,
    compare_to_reference,
    ensemble_logits,
    evaluate_models,
    fit_exact_gp,
    fit_pair_svgp,
    fit_pair_svgp_pyro,
    format_result,
    load_task,
    markdown_table,
    model_fidelity,
    paired_difference,
    read_records,
    run_comparison,
    run_toy_regression,
    summarize_seeds,
    train_and_evaluate,
    with_temperature_scaled,
    write_outputs,
)
from ..methods import get_method, method_names
from ..training import (
    CHECKPOINT_KEYS,
    CheckpointError,
    NonFiniteLossError,
    TrainConfig,
    TrainingDivergedError,
    TrainingStrategy,
    TrainResult,
    ensemble_probabilities,
    evaluate,
    load_checkpoint,
    member_seed,
    train_ensemble,
    train_model,
    warmup_cosine_lr,
    warmup_cosine_schedule,
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

#: The rows of the comparison that are not registered attentions, row -> its attention, as registered when this
#: module was imported (the former table of such rows; :func:`~gpattn.methods.get_method` gives each row's spec).
COMPARE_VARIANTS: dict[str, str] = {
    name: get_method(name).attention for name in method_names() if get_method(name).attention != name
}


def compare_rows() -> list[str]:
    """Every row ``CompareConfig.attentions`` accepts: the former name of :func:`~gpattn.methods.method_names`."""
    return method_names()


#: Names of :mod:`gpattn.training.distributed`, which :mod:`gpattn.training` imports on first use.
_DISTRIBUTED = ("DataParallelStrategy", "parameter_checksum", "shard_indices", "train_distributed")


def __getattr__(name: str):
    if name in _DISTRIBUTED:
        from .. import training

        return getattr(training, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
