"""``gpattn compare``: every attention on the toy pointer task and scikit-learn's digits, under one training loop.

A run is a pure function :func:`train_and_evaluate` ``(config, task, attention, seed) -> RunRecord``: a small
:class:`~gpattn.models.Transformer` (the last ``gp_layers`` blocks use the attention under test, the others softmax,
as in the papers), or an ensemble of them (:func:`~gpattn.experiments.train_ensemble`), is trained with
:func:`~gpattn.experiments.train_model` and evaluated with :math:`T` Monte Carlo samples: accuracy, NLL, ECE/MCE,
Brier, AURC/E-AURC and misclassification AUROC/FPR95 on the test set; on digits also accuracy/NLL/ECE/Brier under
Gaussian noise, rotation and blur at severities 1-5, and OOD AUROC/AUPR/FPR95 against held-out digit classes and
structured noise images. Everything a figure needs goes into the run's :class:`~gpattn.experiments.RunRecord`.

The attentions, their order and the arguments each takes come from the registry (:mod:`gpattn.attention.registry`),
so a newly registered attention is compared like the built-in ones.
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..attention import attention_names, build_attention, kl_anneal_fraction, select_arguments
from ..models import Transformer
from ..validation import check_choice, check_device, check_float, check_int
from .ensembles import train_ensemble
from .evaluation import DEFAULT_ECE_BINS, evaluate_models, model_fidelity
from .records import RunRecord, TrainingSummary
from .statistics import paired_difference
from .tasks import DEFAULT_TASKS, PUBLISHED_ACCURACIES, TASKS, TaskData, load_task
from .training import DEVICE_TYPES, TrainConfig

__all__ = [
    "COMPARE_VARIANTS",
    "DEFAULT_ATTENTIONS",
    "CompareConfig",
    "compare_rows",
    "format_difference",
    "paired_table",
    "published_table",
    "with_temperature_scaled",
    "build_model",
    "flat_rows",
    "learned_spectra",
    "make_train_config",
    "markdown_table",
    "run_comparison",
    "table_text",
    "train_and_evaluate",
    "write_outputs",
]

#: the in-distribution columns of the table; "confidence" (mean top-label probability) next to the accuracy shows the
#: sign of the miscalibration: over-confident when above it, under-confident when below
TABLE_METRICS = ("accuracy", "confidence", "nll", "ece", "classwise_ece", "brier", "aurc", "auroc", "fpr95")
#: Rows of the comparison that are not registered attentions: name -> (the attention, what differs). The MC-dropout
#: row is the softmax Transformer trained with dropout ``CompareConfig.mc_dropout`` on the embeddings, every attention
#: output and the MLPs, and evaluated with dropout on, averaging ``eval_samples`` passes (Gal & Ghahramani 2016).
COMPARE_VARIANTS: dict[str, str] = {"softmax_mc_dropout": "softmax"}
#: The KSVD-fidelity summaries in the table (fields of :class:`~gpattn.features.KSVDFidelity`).
FIDELITY_COLUMNS = ("relative_objective", "left_cosine", "right_cosine", "energy")
#: The rows of the main job (``gpattn compare`` without ``--attentions``), each also with its ``+ts`` row: KEP-SVGP,
#: the GP baseline SGPA, softmax, MC dropout and Primal-Attention (the other KSVD layer, for the fidelity). The
#: symmetric SVGP, CGPT and the symmetric KEP ablation cost 2-3 times as much to evaluate and run on request.
DEFAULT_ATTENTIONS = ("kep_svgp", "sgpa", "softmax", "softmax_mc_dropout", "primal")
#: The reference row of the paired differences in the table.
REFERENCE_ROW = "kep_svgp"
#: The columns of the paired differences: (flat_rows column, header, percent).
PAIRED_COLUMNS = (
    ("test_accuracy", "accuracy", True),
    ("test_nll", "nll", False),
    ("test_ece", "ece", True),
    ("test_brier", "brier", True),
    ("shift_accuracy", "shift_accuracy", True),
    ("shift_ece", "shift_ece", True),
    ("ood_held_out_auroc", "ood_held_out_auroc", True),
    ("ood_noise_auroc", "ood_noise_auroc", True),
)
#: Fewest seeds from which the table forms a paired interval.
MIN_SEEDS_FOR_INTERVALS = 5


def compare_rows() -> list[str]:
    """Every name ``CompareConfig.attentions`` accepts: the registered attentions (registry order), then
    :data:`COMPARE_VARIANTS`."""
    return attention_names() + [name for name in COMPARE_VARIANTS if name not in attention_names()]


@dataclass
class CompareConfig:
    """Settings of :func:`run_comparison` (the defaults are the CPU-sized embedded comparison).

    :ivar attentions: Rows to compare: registry names and :data:`COMPARE_VARIANTS` (:func:`compare_rows`); default
        :data:`DEFAULT_ATTENTIONS`.
    :ivar tasks: ``"mnist1d"`` (MNIST-1D as 10 tokens of 4 values), ``"digits"`` (8x8 images as 2x2 patches) and/or
        ``"pointer"`` (directed toy sequences, solved by every attention: only in ``--quick`` and the tests);
        default :data:`~gpattn.experiments.tasks.DEFAULT_TASKS`.
    :ivar seeds: Model seeds (the data splits are fixed); paired intervals need at least 5.
    :ivar pointer_epochs: Training epochs per run on the pointer task (2048 sequences: 32 steps an epoch).
    :ivar digits_epochs: Training epochs per run on digits (866 images: 14 steps an epoch).
    :ivar mnist1d_epochs: Training epochs per run on MNIST-1D (3600 sequences: 57 steps an epoch).
    :ivar batch_size: Minibatch size.
    :ivar lr: Peak AdamW learning rate.
    :ivar embed_dim: Transformer width.
    :ivar depth: Encoder blocks.
    :ivar num_heads: Heads per block.
    :ivar gp_layers: Blocks (the last ones) using the attention under test.
    :ivar num_inducing: Size of the inducing set of every attention that has one (the KSVD rank :math:`s` of
        KEP-SVGP and Primal-Attention, the global inducing keys of SGPA, the inducing points of the symmetric SVGP);
        ``None``: each layer's own default (:math:`s = \\min(10, p)`, 16 for SGPA and the SVGP).
    :ivar eval_samples: Monte Carlo samples :math:`T` at evaluation.
    :ivar ensemble: Members per model (1: single models; K > 1: ensembles whose probabilities are averaged; member
        seeds follow :func:`~gpattn.experiments.member_seed`).
    :ivar beta: KL weight.
    :ivar ksvd_weight: :math:`\\eta` of the KSVD penalty :math:`\\eta J^2` of the KSVD attentions (a layer argument).
    :ivar device: ``"cpu"`` or ``"cuda"``.
    :ivar progress: Progress: one line per finished run on standard error, and a live bar on a terminal.
    :ivar ece_bins: Equal-width bins of the ECE/MCE (top-label and classwise) and reliability diagrams.
    :ivar temperature_scaling: Add the post-hoc ``+ts`` variant of every run (temperature fitted by NLL on the
        validation split; no retraining).
    :ivar mc_dropout: Dropout rate of the ``softmax_mc_dropout`` row (training and test time).
    :ivar fidelity_sequences: Test sequences on which the KSVD fidelity of every KEP/Primal layer is measured (0: none).
    :ivar threads: Torch threads per run (``torch.set_num_threads``). The default, 1, is the fastest for these small
        models when runs go in parallel (and on a machine with other work), and fixes the numbers: a run's results
        depend on the thread count, so they are reproducible at a given ``threads`` only.
    :ivar jobs: Runs trained at the same time, in worker processes (:mod:`gpattn.experiments.runner`); the records
        are identical for a given ``threads`` whatever ``jobs`` is. Use about (cores / threads).
    :ivar smoke_test: Set by :meth:`quick`: a smoke test, labelled as such in ``table.md``.
    """

    attentions: tuple[str, ...] = DEFAULT_ATTENTIONS
    tasks: tuple[str, ...] = DEFAULT_TASKS
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    pointer_epochs: int = 8
    digits_epochs: int = 40
    mnist1d_epochs: int = 20
    batch_size: int = 64
    lr: float = 3e-3
    embed_dim: int = 32
    depth: int = 2
    num_heads: int = 2
    gp_layers: int = 1
    num_inducing: int | None = None
    eval_samples: int = 10
    ensemble: int = 1
    beta: float = 1.0
    ksvd_weight: float = 1.0
    device: str = "cpu"
    progress: bool = True
    ece_bins: int = DEFAULT_ECE_BINS
    temperature_scaling: bool = True
    mc_dropout: float = 0.1
    fidelity_sequences: int = 256
    threads: int = 1
    jobs: int = 1
    smoke_test: bool = False

    def __post_init__(self) -> None:
        where = "CompareConfig"
        self.attentions, self.tasks, self.seeds = tuple(self.attentions), tuple(self.tasks), tuple(self.seeds)
        if not self.attentions:
            raise ValueError(f"{where}: expected attentions among {compare_rows()}, got none")
        for name in self.attentions:
            check_choice("attentions", name, compare_rows(), where=where)
        if not self.tasks:
            raise ValueError(f"{where}: expected tasks among {TASKS}, got none")
        for task in self.tasks:
            check_choice("tasks", task, TASKS, where=where)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"{where}: expected distinct seeds, got {list(self.seeds)}")
        for seed in self.seeds:
            check_int("seeds", seed, minimum=0, where=where)
        check_int("ensemble size", self.ensemble, where=where)
        for name in ("pointer_epochs", "digits_epochs", "mnist1d_epochs", "batch_size", "embed_dim", "depth"):
            check_int(name, getattr(self, name), where=where)
        check_int("num_heads", self.num_heads, where=where)
        check_int("ece_bins", self.ece_bins, where=where)
        check_int("fidelity_sequences", self.fidelity_sequences, minimum=0, where=where)
        check_float("mc_dropout", self.mc_dropout, 0.0, 1.0, strict_minimum=True, strict_maximum=True, where=where)
        check_int("eval_samples", self.eval_samples, where=where)
        if self.num_inducing is not None:
            check_int("num_inducing", self.num_inducing, where=where)
        check_int("gp_layers", self.gp_layers, 0, self.depth, where=where)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"{where}: embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})")
        check_float("lr", self.lr, 0.0, strict_minimum=True, where=where)
        check_float("beta", self.beta, 0.0, where=where)
        check_float("ksvd_weight", self.ksvd_weight, 0.0, where=where)
        check_device("device", self.device, where=where, types=DEVICE_TYPES)
        check_int("threads", self.threads, where=where)
        check_int("jobs", self.jobs, where=where)
        if self.num_inducing is not None:
            self._check_layers_accept_the_size()

    def _check_layers_accept_the_size(self) -> None:
        # every layer validates its own arguments (e.g. a KSVD rank above the head width, the rank of a cosine kernel):
        # build one of each before anything runs, without touching the caller's RNG
        head_width = self.embed_dim // self.num_heads
        for name in dict.fromkeys(COMPARE_VARIANTS.get(row, row) for row in self.attentions):
            with torch.random.fork_rng(devices=[]):
                try:
                    build_attention(name, self.embed_dim, self.num_heads, **self.attention_arguments(name))
                except ValueError as error:
                    raise ValueError(
                        f"CompareConfig: num_inducing ({self.num_inducing}) does not fit the attention {name!r} at the "
                        f"head width embed_dim / num_heads = {head_width}: {error}"
                    ) from error

    def attention_arguments(self, attention: str) -> dict[str, Any]:
        """The keyword arguments of the attention layer ``attention``: ``num_inducing`` and ``ksvd_weight`` where the
        layer takes them (:func:`~gpattn.attention.select_arguments`; ``num_inducing=None`` is the layer's default)."""
        attention = COMPARE_VARIANTS.get(attention, attention)
        return select_arguments(attention, num_inducing=self.num_inducing, ksvd_weight=self.ksvd_weight)

    @classmethod
    def quick(cls, **overrides: Any) -> CompareConfig:
        """A smoke test (``smoke_test=True``, labelled so in ``table.md``): the pointer task and digits, one seed, few
        epochs, fewer Monte Carlo samples. It checks that everything runs; the pointer task is not learned in 2 epochs
        (every attention stays near chance there), so its numbers compare nothing."""
        settings = {"tasks": ("pointer", "digits"), "seeds": (0,), "pointer_epochs": 2, "digits_epochs": 10}
        settings.update(mnist1d_epochs=4, eval_samples=4, smoke_test=True)
        return cls(**{**settings, **overrides})


def build_model(config: CompareConfig, attention: str, num_classes: int, model_kwargs: dict[str, Any]) -> Transformer:
    """The Transformer of one run; the attention's arguments come from ``config``
    (:meth:`CompareConfig.attention_arguments`). A row of :data:`COMPARE_VARIANTS` builds its attention
    (``softmax_mc_dropout``: softmax with dropout ``config.mc_dropout``)."""
    dropout = {"dropout": config.mc_dropout} if attention == "softmax_mc_dropout" else {}
    return Transformer(
        num_classes,
        embed_dim=config.embed_dim,
        depth=config.depth,
        num_heads=config.num_heads,
        attention=COMPARE_VARIANTS.get(attention, attention),
        gp_layers=config.gp_layers,
        **model_kwargs,
        **dropout,
        **config.attention_arguments(attention),
    )


def learned_spectra(model: Transformer) -> dict[str, list[list[float]]]:
    """The learned KSVD singular values of every attention layer that has them
    (:meth:`~gpattn.attention.AttentionLayer.learned_spectrum`): ``"layer_<l>"`` (from 1) -> one descending list per
    head."""
    spectra = {}
    for index, layer in enumerate(model.attention_layers(), start=1):
        spectrum = layer.learned_spectrum()
        if spectrum is not None:
            spectra[f"layer_{index}"] = spectrum.sort(dim=-1, descending=True).values.tolist()
    return spectra


def make_train_config(
    config: CompareConfig,
    task: str,
    seed: int,
    checkpoint_dir: str | Path | None = None,
    attention: str | None = None,
) -> TrainConfig:
    """The :class:`~gpattn.experiments.TrainConfig` of one run of the comparison; with ``attention``, its layer's KL
    annealing recipe (:func:`~gpattn.attention.kl_anneal_fraction` of the run's epochs: SGPA anneals)."""
    epochs = getattr(config, f"{task}_epochs")
    anneal = 0.0 if attention is None else kl_anneal_fraction(COMPARE_VARIANTS.get(attention, attention))
    return TrainConfig(
        epochs=epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        beta=config.beta,
        kl_anneal_epochs=anneal * epochs,
        eval_samples=config.eval_samples,
        seed=seed,
        device=config.device,
        progress=False,
        checkpoint_dir=checkpoint_dir,
    )


def train_and_evaluate(
    config: CompareConfig,
    task: str,
    attention: str,
    seed: int,
    data: TaskData | None = None,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
) -> RunRecord:
    """Train one model (``task``, ``attention``, ``seed``), or an ensemble of ``config.ensemble`` members (Deep
    Ensembles with softmax, KEP-SVGP ensembles with ``"kep_svgp"``, recorded as ``"<attention>_ens<K>"``), and return
    its record. The result depends on the arguments only (every random stream is seeded from ``seed``).

    The record holds the metrics of the model as trained, of its temperature-scaled variant (``+ts``:
    :func:`~gpattn.experiments.evaluate_models`, temperature fitted on the validation split, when
    ``config.temperature_scaling``) and the KSVD fidelity of its KSVD layers on ``config.fidelity_sequences`` test
    sequences (:func:`~gpattn.experiments.model_fidelity`; of the first member of an ensemble). ``attention`` may
    be a row of :data:`COMPARE_VARIANTS` (``softmax_mc_dropout``: evaluated with dropout on, ``eval_samples``
    passes).

    :param data: The task's data (:func:`~gpattn.experiments.tasks.load_task`), to share it between runs.
    :param checkpoint_dir: Where the run writes ``best.pt``/``last.pt`` (``member_<k>/`` for ensembles).
    :param resume: Continue an interrupted run from ``last.pt`` (bit-identical on CPU).
    :return: The :class:`~gpattn.experiments.RunRecord`.
    """
    data = load_task(task) if data is None else data
    if config.num_inducing is None and data.num_inducing is not None:  # the task's size (mnist1d: s = 5 < N = 10)
        config = dataclasses.replace(config, num_inducing=data.num_inducing)
    train_config = make_train_config(config, task, seed, checkpoint_dir, attention)

    def make_model(member: int) -> Transformer:
        return build_model(config, attention, data.num_classes, data.model_kwargs).to(config.device)

    start = time.perf_counter()
    members = train_ensemble(make_model, data.train, data.val, train_config, config.ensemble, resume=resume)
    seconds = time.perf_counter() - start
    models = [model for model, _ in members]
    torch.manual_seed(seed)  # Monte Carlo evaluation noise
    evaluation = evaluate_models(
        models,
        data,
        config.eval_samples,
        num_bins=config.ece_bins,
        mc_dropout=attention == "softmax_mc_dropout",
        temperature_scaling=config.temperature_scaling,
    )
    fidelity = model_fidelity(models[0], data.test, config.fidelity_sequences) if config.fidelity_sequences else {}
    return RunRecord(
        task=task,
        attention=attention if config.ensemble == 1 else f"{attention}_ens{config.ensemble}",
        seed=seed,
        metrics=evaluation.metrics,
        reliability=evaluation.reliability,
        ood_scores=evaluation.ood_scores,
        spectra=learned_spectra(models[0]),
        train=TrainingSummary(
            seconds=seconds,
            epochs=train_config.epochs,
            best_epoch=members[0][1].best_epoch,
            num_parameters=sum(parameter.numel() for model in models for parameter in model.parameters()),
            ensemble=config.ensemble,
        ),
        temperature_scaled=evaluation.temperature_scaled,
        fidelity=fidelity,
    )


def run_comparison(config: CompareConfig, out: str | Path | None = None, resume: bool = False) -> list[RunRecord]:
    """Train and evaluate every (task, attention, seed) and return one :class:`~gpattn.experiments.RunRecord` per
    run, in that nesting order (all numbers are fractions, not percent). ``config.jobs`` runs go at once in worker
    processes with ``config.threads`` torch threads each (:func:`~gpattn.experiments.runner.execute_runs`).

    :param out: Run folder: each finished run's record is written at once to
        ``out/runs/<task>-<attention>-<seed>.json``.
    :param resume: Read the runs already finished in ``out/runs`` (made with the same settings) instead of training
        them again.
    :raises ~gpattn.experiments.runner.RunsInterrupted: On Ctrl-C (the finished runs are kept in ``out/runs``).
    """
    from .runner import execute_runs

    runs = [(task, name, seed) for task in config.tasks for name in config.attentions for seed in config.seeds]
    return execute_runs(config, runs, out=out, resume=resume)


def with_temperature_scaled(records: list[RunRecord]) -> list[RunRecord]:
    """The records with, after each one that has a temperature-scaled variant, that variant as a record of its own
    (attention ``"<attention>+ts"``, the same seed and training; no spectra or fidelity): the rows of the table, and
    what the figures take to draw the ``+ts`` rows."""
    expanded = []
    for record in records:
        expanded.append(record)
        scaled = record.temperature_scaled
        if scaled is not None:
            expanded.append(
                RunRecord(
                    task=record.task,
                    attention=f"{record.attention}+ts",
                    seed=record.seed,
                    metrics=scaled.metrics,
                    reliability=scaled.reliability,
                    train=record.train,
                )
            )
    return expanded


def _mean_shift(record: RunRecord, key: str, shuffled: bool = False) -> float | None:
    values = [
        getattr(entry, key)
        for kind, levels in record.metrics.shift.items()
        if (kind == "shuffled") == shuffled
        for entry in levels.values()
    ]
    return statistics.fmean(values) if values else None


def _fidelity_means(record: RunRecord) -> dict[str, float]:
    # mean over layers and heads of every fidelity field
    values: dict[str, list[float]] = {}
    for fields_ in record.fidelity.values():
        for name, heads in fields_.items():
            values.setdefault(name, []).extend(heads)
    return {name: statistics.fmean(entries) for name, entries in values.items() if entries}


def flat_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    """One flat row per run and per temperature-scaled variant (:func:`with_temperature_scaled`): test metrics, shift
    means over kinds and severities (the shuffled MNIST-1D apart), OOD AUROC/AUPR-In/AUPR-Out/FPR95, the fitted
    temperature, the KSVD fidelity means over layers and heads (for CSV)."""
    rows = []
    for record in records:
        variants = [(record, None)]
        if record.temperature_scaled is not None:
            variants.append((with_temperature_scaled([record])[1], record.temperature_scaled.temperature))
        for variant, temperature in variants:
            row = {"task": variant.task, "attention": variant.attention, "seed": variant.seed}
            row.update({f"test_{key}": value for key, value in asdict(variant.metrics.test).items()})
            for key in ("accuracy", "nll", "ece", "brier"):
                row[f"shift_{key}"] = _mean_shift(variant, key)
            if "shuffled" in variant.metrics.shift:
                row["shuffled_accuracy"] = _mean_shift(variant, "accuracy", shuffled=True)
                row["shuffled_ece"] = _mean_shift(variant, "ece", shuffled=True)
            for name, values in variant.metrics.ood.items():
                row[f"ood_{name}_auroc"] = values.auroc_max_prob
                row[f"ood_{name}_aupr_in"] = values.aupr_max_prob
                row[f"ood_{name}_aupr_out"] = values.aupr_out_max_prob
                row[f"ood_{name}_fpr95"] = values.fpr95_max_prob
            row["temperature"] = temperature
            row.update({f"fidelity_{name}": value for name, value in _fidelity_means(variant).items()})
            row["train_seconds"] = None if variant.train is None else variant.train.seconds
            rows.append(row)
    return rows


def _finite(values: list[Any]) -> list[float]:
    return [float(value) for value in values if value is not None and value == value]


def _mean_std(values: list[float], percent: bool) -> str:
    # n with every cell: a metric may be defined on fewer seeds than the group has; one value has no spread
    scale = 100.0 if percent else 1.0
    mean = statistics.fmean(values) * scale
    if len(values) == 1:
        return f"{mean:.2f} (n=1)"
    return f"{mean:.2f} ± {statistics.stdev(values) * scale:.2f} (n={len(values)})"


def format_difference(reference: dict[int, float], other: dict[int, float], percent: bool) -> str:
    """``"+d [low, high] *"``: the paired difference ``reference - other`` over the seeds both have, with its 95 %
    paired-t interval (:func:`~gpattn.experiments.paired_difference`); ``*`` when the interval excludes 0.
    Fewer than :data:`MIN_SEEDS_FOR_INTERVALS` paired seeds: the mean difference and ``(n = k < 5, no interval)``."""
    scale = 100.0 if percent else 1.0
    paired = [seed for seed in reference if seed in other]
    if not paired:
        return "-"
    if len(paired) < MIN_SEEDS_FOR_INTERVALS:
        mean = statistics.fmean(reference[seed] - other[seed] for seed in paired) * scale
        return f"{mean:+.2f} (n = {len(paired)} < {MIN_SEEDS_FOR_INTERVALS}, no interval)"
    difference = paired_difference(reference, other, min_pairs=MIN_SEEDS_FOR_INTERVALS)
    mark = " *" if difference.significant else ""
    return f"{difference.mean * scale:+.2f} [{difference.low * scale:+.2f}, {difference.high * scale:+.2f}]{mark}"


def _is_percent(column: str) -> bool:
    return not (column.endswith("nll") or column in ("train_seconds", "temperature") or column.startswith("fidelity"))


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["attention"]), []).append(row)
    return groups


def paired_table(records: list[RunRecord], reference: str = REFERENCE_ROW) -> str:
    """The paired differences ``reference - row`` over seeds of every other row of each task (``+ts`` rows
    included), one column per :data:`PAIRED_COLUMNS` entry (:func:`format_difference`); ``""`` when no task has the
    reference row."""
    groups = _groups(flat_rows(records))
    lines = []
    for task in dict.fromkeys(task for task, _ in groups):
        if (task, reference) not in groups:
            continue
        columns = [c for c in PAIRED_COLUMNS if any(row.get(c[0]) is not None for row in groups[(task, reference)])]
        base = {row["seed"]: row for row in groups[(task, reference)]}
        header = ["task", f"{reference} − row", "n"] + [name for _, name, _ in columns]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for (row_task, attention), group in groups.items():
            if row_task != task or attention == reference:
                continue
            other = {row["seed"]: row for row in group}
            cells = [task, attention, str(len([seed for seed in base if seed in other]))]
            for column, _, percent in columns:
                left = {seed: row[column] for seed, row in base.items() if _finite([row.get(column)])}
                right = {seed: row[column] for seed, row in other.items() if _finite([row.get(column)])}
                cells.append(format_difference(left, right, percent))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def published_table(tasks: list[str]) -> str:
    """The published reference accuracies (:data:`~gpattn.experiments.tasks.PUBLISHED_ACCURACIES`) of the tasks that
    have them, as a markdown table; ``""`` for none."""
    lines = []
    for task in tasks:
        if task in PUBLISHED_ACCURACIES:
            if not lines:
                lines = ["| task | model (published, not run here) | test accuracy |", "|---|---|---|"]
            published = PUBLISHED_ACCURACIES[task].items()
            lines += [f"| {task} | {model} | {100 * value:.0f} |" for model, value in published]
    return "\n".join(lines)


def markdown_table(records: list[RunRecord]) -> str:
    """The comparison's report: mean ± std over seeds (n shown) per task and row (the ``+ts`` rows after their
    model), percent for the rates, plain numbers for NLL, temperature and fidelity; then the published reference
    accuracies, the paired differences of KEP-SVGP against every other row with 95 % paired-t intervals
    (:func:`paired_table`) and a legend."""
    rows = flat_rows(records)
    present = {key for row in rows for key in row if row[key] is not None}
    columns = [f"test_{key}" for key in TABLE_METRICS] + ["shift_accuracy", "shift_ece", "shift_nll"]
    columns += [c for c in ("shuffled_accuracy", "shuffled_ece") if c in present]
    columns += sorted(
        key for key in present if key.startswith("ood_") and key.endswith(("_auroc", "_aupr_in", "_aupr_out"))
    )
    columns += [c for c in ("temperature",) if c in present]
    columns += [f"fidelity_{name}" for name in FIDELITY_COLUMNS if f"fidelity_{name}" in present]
    columns += ["train_seconds"]
    header = ["task", "attention", "n"] + [column.replace("test_", "") for column in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (task, attention), group in _groups(rows).items():
        cells = [task, attention, str(len(group))]
        for column in columns:
            values = _finite([row.get(column) for row in group])
            cells.append(_mean_std(values, _is_percent(column)) if values else "-")
        lines.append("| " + " | ".join(cells) + " |")
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    legend = " ".join(
        [
            "\nRates (accuracy, confidence, ECE, classwise ECE, Brier, AURC, AUROC, AUPR, FPR95) in percent",
            "(Brier: sum over classes x 100), NLL in nats, train_seconds in seconds; mean ± std over the n seeds where",
            "the metric is defined (n=1: the value alone).",
            f"ECE: {_bins(records)} equal-width bins, top-label; classwise_ece: Kull et al. 2019.",
            "shift_*: mean over the shift kinds at severities 1-5 (digits: noise, rotation, blur; mnist1d: i.i.d.",
            "noise, correlated noise, shear, translation, scale); shuffled_*: the spatially shuffled MNIST-1D test",
            "split. ood_*: maximum-probability AUROC, AUPR-In (in-distribution positive) and AUPR-Out against",
            "held-out classes / noise. `+ts` rows: the same trained models, temperature-scaled (temperature fitted",
            "by NLL on the validation split; column temperature). softmax_mc_dropout: softmax trained with dropout,",
            "dropout on at test time. fidelity_*: KSVD fidelity of the KEP/Primal layers on test sequences (mean",
            "over sequences, layers and heads): relative_objective |J| over its terms (0 at a stationary point),",
            "left/right_cosine of the principal angles to the exact top-s singular subspaces (1: the same),",
            "energy the share of ||K||_F^2 in the top s exact singular values.",
        ]
    )
    text = "\n".join(lines) + "\n" + legend + "\n"
    published = published_table(tasks)
    if published:
        text += (
            "\nPublished reference numbers (MNIST-1D README, github.com/greydanus/mnist1d; other models, the same"
            " standard split of all ten classes; not measured here):\n\n" + published + "\n"
        )
    paired = paired_table(records)
    if paired:
        text += (
            f"\nPaired differences {REFERENCE_ROW} − row over seeds (same units as above; for accuracy and AUROC a"
            " positive difference favours kep_svgp, for NLL, ECE and Brier a negative one), mean [95 % paired-t"
            " interval]; * = the interval excludes 0. Intervals only from n >= "
            f"{MIN_SEEDS_FOR_INTERVALS} paired seeds.\n\n" + paired
        )
    return text


def _bins(records: list[RunRecord]) -> int:
    counts = {len(record.reliability.count) for record in records if record.reliability is not None}
    return counts.pop() if len(counts) == 1 else DEFAULT_ECE_BINS


def table_text(records: list[RunRecord], config: CompareConfig) -> str:
    """``table.md``: a title that says what was run (a smoke test for ``--quick``), then :func:`markdown_table`."""
    seeds = len(config.seeds)
    title = f"# gpattn compare: {len(records)} runs, {seeds} seed{'s' if seeds > 1 else ''}"
    if config.smoke_test:
        title += (
            "\n\n**Smoke test (`--quick`)**: one seed and a few epochs, to check that everything runs. The pointer task"
            " is not learned in this budget; these numbers compare nothing."
        )
    settings = f"threads {config.threads} per run, jobs {config.jobs}, device {config.device}"
    return f"{title}\n\n{settings}\n\n{markdown_table(records)}"


def write_outputs(records: list[RunRecord], config: CompareConfig, out: str | Path) -> list[Path]:
    """Write ``results.json`` (config + records, :meth:`~gpattn.experiments.RunRecord.to_dict`; strict JSON: an
    undefined metric is ``null`` with its reason), ``results.csv`` (:func:`flat_rows`) and ``table.md``
    (:func:`table_text`) into ``out`` (created if missing), each through a temporary file and an atomic rename. The
    figures are :func:`gpattn.plotting.write_comparison_figures`'s (``gpattn compare`` writes both).

    :return: The three paths.
    """
    import io
    import math

    from .runner import write_json_atomically, write_text_atomically

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.csv", out / "table.md"]
    content = {"config": asdict(config), "records": [record.to_dict() for record in records]}
    write_json_atomically(written[0], content)
    rows = flat_rows(records)
    fieldnames = list(dict.fromkeys(key for row in rows for key in row))
    handle = io.StringIO()
    writer = csv.DictWriter(handle, fieldnames=fieldnames)
    writer.writeheader()
    # an undefined value is an empty cell, as a missing one
    writer.writerows(
        {key: None if isinstance(value, float) and not math.isfinite(value) else value for key, value in row.items()}
        for row in rows
    )
    write_text_atomically(written[1], handle.getvalue())
    write_text_atomically(written[2], table_text(records, config))
    return written
