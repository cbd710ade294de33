"""``gpattn compare``: every attention on the toy pointer task and scikit-learn's digits, under one training loop.

For every task, attention and seed a small :class:`~gpattn.models.Transformer` (the last ``gp_layers`` blocks use
the attention under test, the others softmax, as in the papers) is trained with :func:`~gpattn.experiments.train_model`
and evaluated with :math:`T` Monte Carlo samples: accuracy, NLL, ECE/MCE, Brier, AURC/E-AURC and misclassification
AUROC/FPR95 on the test set; on digits also accuracy/NLL/ECE/Brier under Gaussian noise, rotation and blur at
severities 1-5, and OOD AUROC/AUPR/FPR95 against held-out digit classes and structured noise images. Everything a
figure needs goes into one JSON-able record per run (see :func:`run_comparison`).
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .. import metrics
from ..attention import attention_arguments, attention_names
from ..data import load_digits_splits, make_noise_ood, make_pointer_task, make_shifted_test_sets
from ..models import Transformer
from ..validation import check_device, check_float, check_int
from .training import TrainConfig, ensemble_probabilities, train_model

TASKS = ("pointer", "digits")
#: the in-distribution columns of the table; "confidence" (mean top-label probability) next to the accuracy shows the
#: sign of the miscalibration: over-confident when above it, under-confident when below
TABLE_METRICS = ("accuracy", "confidence", "nll", "ece", "brier", "aurc", "auroc", "fpr95")


@dataclass
class CompareConfig:
    """Settings of :func:`run_comparison` (the defaults are the CPU-sized embedded comparison).

    :ivar attentions: Registry names to compare.
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
    :ivar ensemble: Members per model (1: single models; K > 1: ensembles whose probabilities are averaged).
    :ivar beta: KL weight.
    :ivar ksvd_weight: :math:`\\eta` of the KSVD penalty :math:`\\eta J^2` of the KSVD attentions (a layer argument).
    :ivar device: ``"cpu"`` or ``"cuda"``.
    :ivar progress: Progress bars.
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

    def __post_init__(self) -> None:
        self.attentions, self.tasks, self.seeds = tuple(self.attentions), tuple(self.tasks), tuple(self.seeds)
        known = attention_names()
        unknown = [name for name in self.attentions if name not in known]
        if unknown or not self.attentions:
            raise ValueError(f"expected attentions among {known}, got {list(self.attentions)}")
        if not self.tasks or any(task not in TASKS for task in self.tasks):
            raise ValueError(f"expected tasks among {TASKS}, got {list(self.tasks)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"expected distinct seeds, got {list(self.seeds)}")
        if isinstance(self.ensemble, bool) or not isinstance(self.ensemble, int) or self.ensemble < 1:
            raise ValueError(f"expected a positive integer ensemble size, got {self.ensemble!r}")
        where = "CompareConfig"
        for seed in self.seeds:
            check_int("seeds", seed, minimum=0, where=where)
        for name in ("pointer_epochs", "digits_epochs", "batch_size", "embed_dim", "depth", "num_heads"):
            check_int(name, getattr(self, name), where=where)
        check_int("eval_samples", self.eval_samples, where=where)
        if self.num_inducing is not None:
            check_int("num_inducing", self.num_inducing, where=where)
        check_int("gp_layers", self.gp_layers, 0, self.depth, where=where)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"{where}: embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})")
        head_width = self.embed_dim // self.num_heads
        with_rank = [name for name in self.attentions if "feature_dim" in attention_arguments(name)]
        if with_rank and self.num_inducing is not None and self.num_inducing > head_width:
            # the cosine kernel of a head has rank <= its feature width
            raise ValueError(
                f"{where}: num_inducing ({self.num_inducing}) must not exceed the head width embed_dim / num_heads = "
                f"{head_width} of the KSVD attentions {with_rank}"
            )
        check_float("lr", self.lr, 0.0, strict_minimum=True, where=where)
        check_float("beta", self.beta, 0.0, where=where)
        check_float("ksvd_weight", self.ksvd_weight, 0.0, where=where)
        if check_device("device", self.device, where=where).type not in ("cpu", "cuda"):
            raise ValueError(f"{where}: expected device 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}")

    @classmethod
    def quick(cls, **overrides: Any) -> CompareConfig:
        """The under-two-minutes first look: one seed, few epochs, fewer Monte Carlo samples."""
        return cls(**{"seeds": (0,), "pointer_epochs": 2, "digits_epochs": 10, "eval_samples": 4, **overrides})


def _task_data(task: str) -> dict[str, Any]:
    if task == "pointer":
        splits = make_pointer_task(2048, 256, 512, length=8, seed=0, vocab_size=8, min_length=4)
        model_kwargs = {"input": "tokens", "vocab_size": splits.train.vocab_size, "max_len": 8}
        return {"train": splits.train, "val": splits.val, "test": splits.test, "model": model_kwargs}
    splits = load_digits_splits(seed=0)
    model_kwargs = {"input": "patches", "image_size": 8, "patch_size": 2, "in_channels": 1}
    return {
        "train": splits.train,
        "val": splits.val,
        "test": splits.test,
        "model": model_kwargs,
        "shifted": make_shifted_test_sets(splits.test, seed=0),
        "ood": {"held_out": splits.ood_classes, "noise": make_noise_ood(len(splits.test), seed=0)},
    }


def build_model(config: CompareConfig, attention: str, num_classes: int, model_kwargs: dict[str, Any]) -> Transformer:
    """The Transformer of one run; the attention's size arguments come from ``config``."""
    accepted = attention_arguments(attention)
    attention_kwargs = {"ksvd_weight": config.ksvd_weight} if "ksvd_weight" in accepted else {}
    if config.num_inducing is not None and "num_inducing" in accepted:
        attention_kwargs["num_inducing"] = config.num_inducing
    return Transformer(
        num_classes,
        embed_dim=config.embed_dim,
        depth=config.depth,
        num_heads=config.num_heads,
        attention=attention,
        gp_layers=config.gp_layers,
        **model_kwargs,
        **attention_kwargs,
    )


def _labels(dataset: Any) -> torch.Tensor:
    return dataset.labels


def _classification_metrics(probabilities: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    return {
        "accuracy": metrics.accuracy(probabilities, labels),
        "confidence": float(probabilities.max(dim=-1).values.mean()),
        "nll": metrics.negative_log_likelihood(probabilities, labels),
        "ece": metrics.expected_calibration_error(probabilities, labels),
        "mce": metrics.maximum_calibration_error(probabilities, labels),
        "brier": metrics.brier_score(probabilities, labels),
        "aurc": metrics.aurc(probabilities, labels),
        "eaurc": metrics.eaurc(probabilities, labels),
        "auroc": metrics.misclassification_auroc(probabilities, labels),
        "fpr95": metrics.fpr_at_95_tpr(probabilities, labels),
    }


def _spectra(model: Transformer) -> dict[str, list[list[float]]]:
    # learned KSVD singular values per head of every GP layer that has them
    spectra = {}
    for index, layer in enumerate(model.attention_layers(), start=1):
        features = getattr(layer, "features", None)
        if features is None or getattr(features, "mode", "exact") == "exact":
            continue
        values = features.singular_values.detach().sort(dim=-1, descending=True).values
        spectra[f"layer_{index}"] = values.tolist()
    return spectra


def evaluate_run(models: Transformer | Sequence[Transformer], data: dict[str, Any], num_samples: int) -> dict[str, Any]:
    """Metrics and figure data of one trained model, or of an ensemble (a list of members: their predictive
    probabilities are averaged); see :func:`run_comparison` for the record layout."""
    members = [models] if isinstance(models, torch.nn.Module) else list(models)

    def predict(dataset: Any) -> torch.Tensor:
        return ensemble_probabilities(members, dataset, num_samples=num_samples)

    test_probabilities = predict(data["test"])
    test_labels = _labels(data["test"])
    reliability = metrics.reliability_diagram_data(test_probabilities, test_labels)
    record: dict[str, Any] = {
        "metrics": {"test": _classification_metrics(test_probabilities, test_labels), "shift": {}, "ood": {}},
        "reliability": {
            "confidence": [None if value != value else float(value) for value in reliability.confidence],
            "accuracy": [None if value != value else float(value) for value in reliability.accuracy],
            "count": [int(value) for value in reliability.count],
        },
        "ood_scores": {},
    }
    for (kind, severity), dataset in data.get("shifted", {}).items():
        probabilities = predict(dataset)
        labels = _labels(dataset)
        record["metrics"]["shift"].setdefault(kind, {})[str(severity)] = {
            "accuracy": metrics.accuracy(probabilities, labels),
            "nll": metrics.negative_log_likelihood(probabilities, labels),
            "ece": metrics.expected_calibration_error(probabilities, labels),
            "brier": metrics.brier_score(probabilities, labels),
        }
    if data.get("ood"):
        record["ood_scores"]["in"] = test_probabilities.max(dim=-1).values.tolist()
    for name, dataset in data.get("ood", {}).items():
        probabilities = predict(dataset)
        record["ood_scores"][name] = probabilities.max(dim=-1).values.tolist()
        record["metrics"]["ood"][name] = {
            "auroc_max_prob": metrics.ood_auroc(test_probabilities, probabilities, score="max_prob"),
            "auroc_entropy": metrics.ood_auroc(test_probabilities, probabilities, score="entropy"),
            "aupr_max_prob": metrics.ood_aupr(test_probabilities, probabilities, score="max_prob"),
            "fpr95_max_prob": metrics.ood_fpr_at_95_tpr(test_probabilities, probabilities, score="max_prob"),
        }
    return record


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
    data: dict[str, Any] | None = None,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Train one model (``task``, ``attention``, ``seed``), or an ensemble of ``config.ensemble`` members (Deep
    Ensembles with softmax, KEP-SVGP ensembles with ``"kep_svgp"``, recorded as ``"<attention>_ens<K>"``), and return
    its record (see :func:`run_comparison`).

    With ``checkpoint_dir`` the run writes ``best.pt``/``last.pt`` there (``member_<k>/`` for ensembles), and
    ``resume=True`` continues an interrupted run from ``last.pt`` (bit-identical on CPU).
    """
    data = _task_data(task) if data is None else data
    members, results, seconds = [], [], 0.0
    for member in range(config.ensemble):
        # members of one ensemble get seeds seed, seed + 1000, ... so that ensembles of different seeds never share one
        member_seed = seed + 1000 * member
        directory = None
        if checkpoint_dir is not None:
            directory = Path(checkpoint_dir) if config.ensemble == 1 else Path(checkpoint_dir) / f"member_{member}"
        torch.manual_seed(member_seed)
        model = build_model(config, attention, data["train"].num_classes, data["model"]).to(config.device)
        train_config = make_train_config(config, task, member_seed, directory)
        start = time.perf_counter()
        results.append(train_model(model, data["train"], data["val"], train_config, resume=resume))
        seconds += time.perf_counter() - start
        members.append(model)
    torch.manual_seed(seed)  # Monte Carlo evaluation noise
    name = attention if config.ensemble == 1 else f"{attention}_ens{config.ensemble}"
    record = {"task": task, "attention": name, "seed": seed}
    record.update(evaluate_run(members, data, config.eval_samples))
    record["spectra"] = _spectra(members[0])
    record["train"] = {
        "seconds": seconds,
        "epochs": train_config.epochs,
        "best_epoch": results[0].best_epoch,
        "num_parameters": sum(parameter.numel() for model in members for parameter in model.parameters()),
        "ensemble": config.ensemble,
    }
    return record


def run_comparison(config: CompareConfig) -> list[dict[str, Any]]:
    """Train and evaluate every (task, attention, seed); return one record per run.

    A record holds ``task``, ``attention``, ``seed``, ``metrics`` (``test``: accuracy, nll, ece, mce, brier, aurc,
    eaurc, auroc, fpr95; ``shift``: kind -> severity -> accuracy, nll, ece, brier; ``ood``: set -> auroc_max_prob,
    auroc_entropy, aupr_max_prob, fpr95_max_prob), ``reliability`` (15 test-set bins), ``ood_scores`` (max
    probabilities of the test and OOD sets), ``spectra`` (learned singular values per head of the GP layers) and
    ``train`` (seconds, epochs, best epoch, number of parameters). All numbers are fractions, not percent.
    """
    records = []
    runs = [(task, name, seed) for task in config.tasks for name in config.attentions for seed in config.seeds]
    cache: dict[str, dict[str, Any]] = {}
    bar = tqdm(runs, desc="compare", disable=None if config.progress else True)
    for task, name, seed in bar:
        bar.set_postfix(task=task, attention=name, seed=seed)
        if task not in cache:
            cache[task] = _task_data(task)
        record = train_and_evaluate(config, task, name, seed, data=cache[task])
        records.append(record)
    return records


def _mean_shift(record: dict[str, Any], key: str) -> float | None:
    values = [entry[key] for kind in record["metrics"]["shift"].values() for entry in kind.values()]
    return statistics.fmean(values) if values else None


def flat_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per run: test metrics, shift means over kinds and severities, OOD AUROCs (for CSV)."""
    rows = []
    for record in records:
        row = {"task": record["task"], "attention": record["attention"], "seed": record["seed"]}
        row.update({f"test_{key}": value for key, value in record["metrics"]["test"].items()})
        for key in ("accuracy", "nll", "ece", "brier"):
            row[f"shift_{key}"] = _mean_shift(record, key)
        for name, values in record["metrics"]["ood"].items():
            row[f"ood_{name}_auroc"] = values["auroc_max_prob"]
            row[f"ood_{name}_fpr95"] = values["fpr95_max_prob"]
        row["train_seconds"] = record["train"]["seconds"]
        rows.append(row)
    return rows


def _mean_std(values: list[float], percent: bool) -> str:
    scale = 100.0 if percent else 1.0
    mean = statistics.fmean(values) * scale
    spread = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:.2f} ± {spread:.2f}"


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
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
        " train_seconds in seconds; mean ± std over seeds. shift_*: mean over noise, rotation and blur at severities"
        " 1-5 (digits). ood_*_auroc: max-probability AUROC against held-out digits / structured noise."
    )
    return "\n".join(lines) + "\n" + legend + "\n"


def write_outputs(records: Sequence[dict[str, Any]], config: CompareConfig, out: str | Path) -> list[Path]:
    """Write ``results.json`` (config + records), ``results.csv``, ``table.md`` and the figures into ``out``."""
    from ..plotting import write_comparison_figures

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.csv", out / "table.md"]
    written[0].write_text(json.dumps({"config": asdict(config), "records": list(records)}, indent=1))
    rows = flat_rows(records)
    fieldnames = list(dict.fromkeys(key for row in rows for key in row))
    with written[1].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)
    written[2].write_text(markdown_table(records))
    written += write_comparison_figures(list(records), out)
    return written


__all__ = [
    "CompareConfig",
    "build_model",
    "evaluate_run",
    "flat_rows",
    "make_train_config",
    "markdown_table",
    "run_comparison",
    "train_and_evaluate",
    "write_outputs",
]
