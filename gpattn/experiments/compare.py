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
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..attention import attention_names, build_attention, select_arguments
from ..models import Transformer
from ..validation import check_choice, check_device, check_float, check_int
from .ensembles import train_ensemble
from .evaluation import evaluate_run
from .records import RunRecord, TrainingSummary
from .tasks import TASKS, TaskData, load_task
from .training import DEVICE_TYPES, TrainConfig

__all__ = [
    "CompareConfig",
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
TABLE_METRICS = ("accuracy", "confidence", "nll", "ece", "brier", "aurc", "auroc", "fpr95")


@dataclass
class CompareConfig:
    """Settings of :func:`run_comparison` (the defaults are the CPU-sized embedded comparison).

    :ivar attentions: Registry names to compare (default: every registered attention, in registry order).
    :ivar tasks: ``"pointer"`` (directed toy sequences) and/or ``"digits"`` (8x8 images as 2x2 patches).
    :ivar seeds: Model seeds (the data splits are fixed).
    :ivar pointer_epochs: Training epochs per run on the pointer task (2048 sequences: 32 steps an epoch).
    :ivar digits_epochs: Training epochs per run on digits (866 images: 14 steps an epoch).
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
    :ivar threads: Torch threads per run (``torch.set_num_threads``). The default, 1, is the fastest for these small
        models when runs go in parallel (and on a machine with other work), and fixes the numbers: a run's results
        depend on the thread count, so they are reproducible at a given ``threads`` only.
    :ivar jobs: Runs trained at the same time, in worker processes (:mod:`gpattn.experiments.runner`); the records
        are identical for a given ``threads`` whatever ``jobs`` is. Use about (cores / threads).
    :ivar smoke_test: Set by :meth:`quick`: a smoke test, labelled as such in ``table.md``.
    """

    attentions: tuple[str, ...] = field(default_factory=lambda: tuple(attention_names()))
    tasks: tuple[str, ...] = TASKS
    seeds: tuple[int, ...] = (0, 1, 2)
    pointer_epochs: int = 8
    digits_epochs: int = 40
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
    threads: int = 1
    jobs: int = 1
    smoke_test: bool = False

    def __post_init__(self) -> None:
        where = "CompareConfig"
        self.attentions, self.tasks, self.seeds = tuple(self.attentions), tuple(self.tasks), tuple(self.seeds)
        if not self.attentions:
            raise ValueError(f"{where}: expected attentions among {attention_names()}, got none")
        for name in self.attentions:
            check_choice("attentions", name, attention_names(), where=where)
        if not self.tasks:
            raise ValueError(f"{where}: expected tasks among {TASKS}, got none")
        for task in self.tasks:
            check_choice("tasks", task, TASKS, where=where)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"{where}: expected distinct seeds, got {list(self.seeds)}")
        for seed in self.seeds:
            check_int("seeds", seed, minimum=0, where=where)
        check_int("ensemble size", self.ensemble, where=where)
        for name in ("pointer_epochs", "digits_epochs", "batch_size", "embed_dim", "depth", "num_heads"):
            check_int(name, getattr(self, name), where=where)
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
        for name in self.attentions:
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
        return select_arguments(attention, num_inducing=self.num_inducing, ksvd_weight=self.ksvd_weight)

    @classmethod
    def quick(cls, **overrides: Any) -> CompareConfig:
        """A smoke test (``smoke_test=True``, labelled so in ``table.md``): one seed, few epochs, fewer Monte Carlo
        samples. It checks that everything runs; the pointer task is not learned in 2 epochs (every attention stays
        near chance there), so its numbers compare nothing."""
        settings = {"seeds": (0,), "pointer_epochs": 2, "digits_epochs": 10, "eval_samples": 4, "smoke_test": True}
        return cls(**{**settings, **overrides})


def build_model(config: CompareConfig, attention: str, num_classes: int, model_kwargs: dict[str, Any]) -> Transformer:
    """The Transformer of one run; the attention's arguments come from ``config``
    (:meth:`CompareConfig.attention_arguments`)."""
    return Transformer(
        num_classes,
        embed_dim=config.embed_dim,
        depth=config.depth,
        num_heads=config.num_heads,
        attention=attention,
        gp_layers=config.gp_layers,
        **model_kwargs,
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
    config: CompareConfig, task: str, seed: int, checkpoint_dir: str | Path | None = None
) -> TrainConfig:
    """The :class:`~gpattn.experiments.TrainConfig` of one run of the comparison."""
    return TrainConfig(
        epochs=config.pointer_epochs if task == "pointer" else config.digits_epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        beta=config.beta,
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

    :param data: The task's data (:func:`~gpattn.experiments.tasks.load_task`), to share it between runs.
    :param checkpoint_dir: Where the run writes ``best.pt``/``last.pt`` (``member_<k>/`` for ensembles).
    :param resume: Continue an interrupted run from ``last.pt`` (bit-identical on CPU).
    :return: The :class:`~gpattn.experiments.RunRecord`.
    """
    data = load_task(task) if data is None else data
    train_config = make_train_config(config, task, seed, checkpoint_dir)

    def make_model(member: int) -> Transformer:
        return build_model(config, attention, data.num_classes, data.model_kwargs).to(config.device)

    start = time.perf_counter()
    members = train_ensemble(make_model, data.train, data.val, train_config, config.ensemble, resume=resume)
    seconds = time.perf_counter() - start
    models = [model for model, _ in members]
    torch.manual_seed(seed)  # Monte Carlo evaluation noise
    metrics, reliability, ood_scores = evaluate_run(models, data, config.eval_samples)
    return RunRecord(
        task=task,
        attention=attention if config.ensemble == 1 else f"{attention}_ens{config.ensemble}",
        seed=seed,
        metrics=metrics,
        reliability=reliability,
        ood_scores=ood_scores,
        spectra=learned_spectra(models[0]),
        train=TrainingSummary(
            seconds=seconds,
            epochs=train_config.epochs,
            best_epoch=members[0][1].best_epoch,
            num_parameters=sum(parameter.numel() for model in models for parameter in model.parameters()),
            ensemble=config.ensemble,
        ),
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


def _mean_shift(record: RunRecord, key: str) -> float | None:
    values = [getattr(entry, key) for kind in record.metrics.shift.values() for entry in kind.values()]
    return statistics.fmean(values) if values else None


def flat_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    """One flat row per run: test metrics, shift means over kinds and severities, OOD AUROCs (for CSV)."""
    rows = []
    for record in records:
        row = {"task": record.task, "attention": record.attention, "seed": record.seed}
        row.update({f"test_{key}": value for key, value in asdict(record.metrics.test).items()})
        for key in ("accuracy", "nll", "ece", "brier"):
            row[f"shift_{key}"] = _mean_shift(record, key)
        for name, values in record.metrics.ood.items():
            row[f"ood_{name}_auroc"] = values.auroc_max_prob
            row[f"ood_{name}_fpr95"] = values.fpr95_max_prob
        row["train_seconds"] = None if record.train is None else record.train.seconds
        rows.append(row)
    return rows


def _mean_std(values: list[float], percent: bool) -> str:
    # n with every cell: a metric may be defined on fewer seeds than the group has; one value has no spread
    scale = 100.0 if percent else 1.0
    mean = statistics.fmean(values) * scale
    if len(values) == 1:
        return f"{mean:.2f} (n=1)"
    return f"{mean:.2f} ± {statistics.stdev(values) * scale:.2f} (n={len(values)})"


def markdown_table(records: list[RunRecord]) -> str:
    """Mean ± std over seeds per task and attention. Percent for the rates, plain numbers for NLL."""
    rows = flat_rows(records)
    columns = [f"test_{key}" for key in TABLE_METRICS] + ["shift_accuracy", "shift_ece", "shift_nll"]
    ood_columns = sorted({key for row in rows for key in row if key.startswith("ood_") and key.endswith("_auroc")})
    columns += ood_columns + ["train_seconds"]
    header = ["task", "attention"] + [column.replace("test_", "") for column in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["attention"]), []).append(row)
    for (task, attention), group in groups.items():
        cells = [task, attention]
        for column in columns:
            values = [row[column] for row in group if row.get(column) is not None and row[column] == row[column]]
            percent = not (column.endswith("nll") or column == "train_seconds")
            cells.append(_mean_std(values, percent) if values else "-")
        lines.append("| " + " | ".join(cells) + " |")
    legend = (
        "\nRates (accuracy, ECE, Brier, AURC, AUROC, FPR95) in percent (Brier: sum over classes x 100), NLL in nats,"
        " train_seconds in seconds; mean ± std over the n seeds where the metric is defined (n=1: the value alone)."
        " shift_*: mean over noise, rotation and blur at severities 1-5 (digits). ood_*_auroc: max-probability AUROC"
        " against held-out digits / structured noise."
    )
    return "\n".join(lines) + "\n" + legend + "\n"


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
