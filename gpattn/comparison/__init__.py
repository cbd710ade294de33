"""The comparison (``gpattn compare``): its tasks, settings and runs, their evaluation (with separate random streams)
and typed records (JSON/CSV), statistics over seeds (paired differences with intervals), the report, the scheduling
of the runs (in local processes, or as Ray tasks with the ``ray`` extra), the tuned configurations and the settings
and search space of ``gpattn tune`` (its Optuna studies: :mod:`gpattn.comparison.tuning`, which needs the ``tune``
extra), and the toy regression fit (exact GP vs KEP-SVGP via VariationalELBO and Pyro SVI).

Data flows one way: the comparison resolves each row once (:mod:`gpattn.methods`) and trains it with the loop of
:mod:`gpattn.training`, which never imports this package.
"""

from .config import DEFAULT_ATTENTIONS, MAIN_SEEDS, MAIN_TABLE_ROWS, PRIMARY_ROWS, CompareConfig
from .evaluation import (
    DEFAULT_ECE_BINS,
    POOLED_OOD,
    Evaluation,
    classification_metrics,
    ensemble_logits,
    evaluate_models,
    evaluate_run,
    per_example_predictions,
)
from .fidelity import model_fidelity
from .local_executor import LocalExecutor
from .ray_executor import RayExecutor
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
from .report import markdown_table, table_text, with_temperature_scaled, write_outputs
from .runner import RunFailedError, RunsInterrupted, execute_runs, run_comparison
from .runs import build_model, layer_arguments, learned_spectra, make_train_config, plan_runs, train_and_evaluate
from .statistics import (
    INTERVAL_METHODS,
    PairedDifference,
    SeedSummary,
    compare_to_reference,
    hierarchical_difference,
    holm_adjusted,
    paired_difference,
    paired_p_value,
    summarize_seeds,
)
from .streams import random_stream, stream_seed
from .tasks import DEFAULT_TASKS, PUBLISHED_ACCURACIES, TASK_DEFAULTS, TASKS, TaskData, load_task
from .toy_regression import (
    ToyRegressionConfig,
    ToyRegressionResult,
    fit_exact_gp,
    fit_pair_svgp,
    fit_pair_svgp_pyro,
    format_result,
    run_toy_regression,
)
from .tune_config import DEFAULT_TRIALS, TuneConfig
from .tuned_configuration import TunedRow, read_tuned, write_tuned
from .tuning_space import ARCHITECTURES, TUNED_ROWS, TUNING_SEED, SearchParameter, search_space

__all__ = [
    "LocalExecutor",
    "RayExecutor",
    "ARCHITECTURES",
    "DEFAULT_ATTENTIONS",
    "MAIN_SEEDS",
    "MAIN_TABLE_ROWS",
    "PRIMARY_ROWS",
    "DEFAULT_ECE_BINS",
    "DEFAULT_TASKS",
    "DEFAULT_TRIALS",
    "INTERVAL_METHODS",
    "POOLED_OOD",
    "PUBLISHED_ACCURACIES",
    "TASKS",
    "TASK_DEFAULTS",
    "TUNED_ROWS",
    "TUNING_SEED",
    "ClassificationMetrics",
    "CompareConfig",
    "Evaluation",
    "OODMetrics",
    "PairedDifference",
    "ReliabilityBins",
    "RunFailedError",
    "RunMetrics",
    "RunRecord",
    "RunsInterrupted",
    "SearchParameter",
    "SeedSummary",
    "ShiftMetrics",
    "TaskData",
    "TemperatureScaled",
    "ToyRegressionConfig",
    "ToyRegressionResult",
    "TuneConfig",
    "TunedRow",
    "TrainingSummary",
    "build_model",
    "classification_metrics",
    "compare_to_reference",
    "ensemble_logits",
    "evaluate_models",
    "evaluate_run",
    "execute_runs",
    "fit_exact_gp",
    "fit_pair_svgp",
    "fit_pair_svgp_pyro",
    "format_result",
    "hierarchical_difference",
    "holm_adjusted",
    "layer_arguments",
    "learned_spectra",
    "load_task",
    "make_train_config",
    "markdown_table",
    "model_fidelity",
    "paired_difference",
    "paired_p_value",
    "per_example_predictions",
    "plan_runs",
    "random_stream",
    "read_records",
    "read_tuned",
    "run_comparison",
    "run_toy_regression",
    "stream_seed",
    "search_space",
    "summarize_seeds",
    "table_text",
    "train_and_evaluate",
    "with_temperature_scaled",
    "write_tuned",
    "write_outputs",
]
