"""``gpattn compare``: the runs of the comparison, every attention on MNIST-1D, scikit-learn's digits and the toy
pointer task under one training loop (scheduling: :mod:`gpattn.experiments.runner`; tables and files:
:mod:`gpattn.experiments.report`).

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

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..attention import attention_names, build_attention, kl_anneal_fraction, select_arguments
from ..models import Transformer
from ..validation import check_choice, check_device, check_float, check_int
from .ensembles import train_ensemble
from .evaluation import DEFAULT_ECE_BINS, evaluate_models, model_fidelity
from .records import RunRecord, TrainingSummary
from .tasks import DEFAULT_TASKS, TASKS, TaskData, load_task
from .training import DEVICE_TYPES, TrainConfig

__all__ = [
    "COMPARE_VARIANTS",
    "DEFAULT_ATTENTIONS",
    "CompareConfig",
    "build_model",
    "compare_rows",
    "learned_spectra",
    "make_train_config",
    "train_and_evaluate",
]

#: Rows of the comparison that are not registered attentions: name -> (the attention, what differs). The MC-dropout
#: row is the softmax Transformer trained with dropout ``CompareConfig.mc_dropout`` on the embeddings, every attention
#: output and the MLPs, and evaluated with dropout on, averaging ``eval_samples`` passes (Gal & Ghahramani 2016).
COMPARE_VARIANTS: dict[str, str] = {"softmax_mc_dropout": "softmax"}
#: The rows of the main job (``gpattn compare`` without ``--attentions``), each also with its ``+ts`` row: KEP-SVGP,
#: the GP baseline SGPA, softmax, MC dropout and Primal-Attention (the other KSVD layer, for the fidelity). The
#: symmetric SVGP, CGPT and the symmetric KEP ablation cost 2-3 times as much to evaluate and run on request.
DEFAULT_ATTENTIONS = ("kep_svgp", "sgpa", "softmax", "softmax_mc_dropout", "primal")


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
