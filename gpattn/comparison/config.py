"""The settings of ``gpattn compare`` (:class:`CompareConfig`) and the hyperparameters each run reads from them: the
shared settings, replaced for a (task, row) by its tuned configuration (:mod:`gpattn.comparison.tuned_configuration`)
when there is one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._torch_compat import SETS_STANCE
from ..methods import Hyperparameters, MethodSpec, get_method, method_names
from ..training import TrainConfig, member_seed
from ..training.config import DEVICE_TYPES
from ..validation import InputTypeError, check_choice, check_device, check_float, check_int, check_seed
from .endpoints import DECLARED_PRIMARY_SEEDS, PRIMARY_ENDPOINT
from .evaluation import DEFAULT_ECE_BINS
from .tasks import DEFAULT_TASKS, TASK_DEFAULTS, TASKS
from .tuned_configuration import TunedRow, read_tuned, tuned_path, tuned_source

__all__ = ["DEFAULT_ATTENTIONS", "MAIN_SEEDS", "MAIN_TABLE_ROWS", "PRIMARY_ROWS", "CompareConfig"]

#: The rows of the main job (``gpattn compare`` without ``--attentions``), each also with its ``+ts`` row: KEP-SVGP,
#: the GP baseline SGPA, softmax, MC dropout and Primal-Attention (the other KSVD layer, for the fidelity). The
#: symmetric SVGP, CGPT, the symmetric KEP ablation and Deep Ensembles cost 2-5 times as much and run on request.
DEFAULT_ATTENTIONS = ("kep_svgp", "sgpa", "softmax", "softmax_mc_dropout", "primal")
#: The rows of the primary endpoint (:data:`~gpattn.comparison.endpoints.PRIMARY_ENDPOINT`, without its ``+ts``
#: suffix): the protocol runs them with 10 seeds, ``make main`` runs only them.
PRIMARY_ROWS = tuple(row.removesuffix("+ts") for row in (PRIMARY_ENDPOINT.reference, PRIMARY_ENDPOINT.other))
#: The seeds of ``make main`` (:meth:`CompareConfig.main`): a subset of the primary endpoint's 10 that trains within
#: 15 minutes on an idle 2-core machine (the 10 took 1063 s); ``gpattn compare --full`` runs all 10.
MAIN_SEEDS = tuple(range(7))
#: Every row of the protocol's main table (:meth:`CompareConfig.full`), each with its ``+ts`` row where it has one.
MAIN_TABLE_ROWS = (
    "kep_svgp", "kep_svgp_paper", "sgpa", "primal", "primal_paper",
    "softmax", "softmax_mc_dropout", "deep_ensemble", "laplace",
)  # fmt: skip

#: The settings of :class:`CompareConfig` that must be bools (a string such as ``"no"`` is truthy).
_BOOLEANS = ("progress", "temperature_scaling", "smoke_test", "compile", "cuda_graphs", "tuned")


def _sequence(name: str, value: Any, items: str, where: str = "CompareConfig") -> tuple:
    # a tuple of the items of a sequence or other iterable; a bare string (a sequence of characters) and a
    # non-iterable are refused by name
    if isinstance(value, (str, bytes)):
        raise InputTypeError(f"{where}: expected {name} to be a sequence of {items}, got the string {value!r}")
    try:
        return tuple(value)
    except TypeError:
        raise InputTypeError(f"{where}: expected {name} to be a sequence of {items}, got {value!r}") from None


def _names(name: str, value: Any, where: str = "CompareConfig") -> tuple[str, ...]:
    return _sequence(name, value, "names", where)


def _seeds(name: str, value: Any) -> tuple[int, ...]:
    # stored as Python ints (numpy's integers are accepted and converted)
    return tuple(check_seed(name, seed, where="CompareConfig") for seed in _sequence(name, value, "integers"))


@dataclass
class CompareConfig:
    """Settings of :func:`~gpattn.comparison.run_comparison` (the defaults are the CPU-sized embedded comparison).

    Validated on construction against the row registry (:func:`~gpattn.methods.method_names`), without building any
    layer: what needs a layer (e.g. a ``num_inducing`` above a head width) is checked once before any training, by
    :func:`~gpattn.comparison.plan_runs`.

    :ivar attentions: Rows to compare (:func:`~gpattn.methods.method_names`: every registered attention,
        ``softmax_mc_dropout``, ``deep_ensemble``, ...); default :data:`DEFAULT_ATTENTIONS`.
    :ivar tasks: ``"mnist1d"`` (MNIST-1D's 40-value signals through a convolutional stem: 20 tokens), ``"digits"``
        (8x8 images as 2x2 patches) and/or
        ``"pointer"`` (directed toy sequences, solved by every attention: only in ``--quick`` and the tests);
        default :data:`~gpattn.comparison.tasks.DEFAULT_TASKS`.
    :ivar seeds: Model seeds of every row (a seed also draws the run's validation split); paired intervals need at
        least 5.
    :ivar primary_seeds: Further seeds of the :data:`PRIMARY_ROWS` only (the protocol runs the primary pair with 10
        seeds and every other row with 5: :meth:`full`); default none.
    :ivar pointer_epochs: Training epochs per run on the pointer task (2048 sequences: 32 steps an epoch).
    :ivar digits_epochs: Training epochs per run on digits (866 images: 14 steps an epoch).
    :ivar mnist1d_epochs: Training epochs per run on MNIST-1D (3601 sequences: 57 steps an epoch; 60, the protocol's
        base model).
    :ivar batch_size: Minibatch size.
    :ivar lr: Peak AdamW learning rate.
    :ivar embed_dim: Transformer width.
    :ivar depth: Encoder blocks.
    :ivar num_heads: Heads per block.
    :ivar gp_layers: Blocks (the last ones) using the attention under test, from 1 to ``depth`` (0, a softmax model
        whatever the row, is refused).
    :ivar num_inducing: Size of the inducing set of every attention that has one (the KSVD rank :math:`s` of
        KEP-SVGP and Primal-Attention, the global inducing keys of SGPA, the inducing points of the symmetric SVGP);
        ``None``: the task's size, else each layer's own default (:math:`s = \\min(10, p)`, 16 for SGPA and the SVGP).
    :ivar eval_samples: Monte Carlo samples :math:`T` at evaluation.
    :ivar ensemble: Members per model of the single-model rows (1: single models; K > 1: ensembles whose
        probabilities are averaged, recorded as ``<row>_ens<K>``; member seeds follow
        :func:`~gpattn.training.member_seed`). A row that is an ensemble already (``deep_ensemble``) needs 1.
    :ivar beta: KL weight.
    :ivar ksvd_weight: :math:`\\eta` of the KSVD penalty :math:`\\eta J^2` of the KSVD attentions (a layer argument).
    :ivar device: ``"cpu"`` or ``"cuda"``.
    :ivar progress: Progress: one line per finished run on standard error, and a live bar on a terminal.
    :ivar ece_bins: Equal-width bins of the ECE/MCE (top-label and classwise) and reliability diagrams.
    :ivar temperature_scaling: Add the post-hoc ``+ts`` variant of every run whose row has one
        (:attr:`~gpattn.methods.MethodSpec.temperature_scaled`; temperature fitted by NLL on the validation split; no
        retraining).
    :ivar mc_dropout: Dropout rate of the MC-dropout rows (``softmax_mc_dropout``; training and test time).
    :ivar fidelity_sequences: Test sequences on which the KSVD fidelity of every KEP/Primal layer is measured (0: none).
    :ivar threads: Torch threads per run (``torch.set_num_threads``). The default, 1, is the fastest for these small
        models when runs go in parallel (and on a machine with other work), and fixes the numbers: a run's results
        depend on the thread count, so they are reproducible at a given ``threads`` only.
    :ivar jobs: Runs trained at the same time, in worker processes (:mod:`gpattn.comparison.runner`); the records
        are identical for a given ``threads`` whatever ``jobs`` is. Use about (cores / threads).
    :ivar smoke_test: Set by :meth:`quick`: a smoke test, labelled as such in ``table.md``.
    :ivar compile: ``torch.compile`` every model's forward pass (``gpattn.comparison.runs.compile_model``: CUDA
        graphs on CUDA, eager's random numbers); with torch 2.13 its numbers equal eager's up to float rounding (torch
        2.11 draws other dropout masks) (a field of the records' settings).
    :ivar cuda_graphs: Capture every full-size training step of a row whose layers support it as a CUDA graph
        (:attr:`~gpattn.training.TrainConfig.cuda_graphs`; needs ``device="cuda"``), and its validation and final
        evaluation passes too (:class:`~gpattn.training.graphs.CapturedForward`); the other rows (SGPA) train and
        evaluate eagerly. Reproducible, but other random draws than the eager runs' (a field of the records'
        settings when set).
    :ivar tuned: Use the tuned configuration of every (task, row) that has one (``gpattn tune``; the files
        ``<tuned_dir>/<task>.json``) in place of the shared settings above (:meth:`hyperparameters`); ``False``
        (``gpattn compare --untuned``): the shared settings for every row.
    :ivar tuned_dir: The folder of the tuned files (e.g. ``<out>/tuned`` of a ``gpattn tune`` run); ``None``: the
        package's (:data:`~gpattn.comparison.tuned_configuration.TUNED_DIRECTORY`).
    """

    attentions: tuple[str, ...] = DEFAULT_ATTENTIONS
    tasks: tuple[str, ...] = DEFAULT_TASKS
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    primary_seeds: tuple[int, ...] = ()
    pointer_epochs: int = 8
    digits_epochs: int = 40
    mnist1d_epochs: int = 60
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
    compile: bool = False
    cuda_graphs: bool = False
    tuned: bool = True
    tuned_dir: str | None = None

    def __post_init__(self) -> None:
        where = "CompareConfig"
        self.attentions, self.tasks = _names("attentions", self.attentions), _names("tasks", self.tasks)
        self.seeds, self.primary_seeds = _seeds("seeds", self.seeds), _seeds("primary_seeds", self.primary_seeds)
        if not self.attentions:
            raise ValueError(f"{where}: expected attentions among {method_names()}, got none")
        for name in self.attentions:
            check_choice("attentions", name, method_names(), where=where)
        if not self.tasks:
            raise ValueError(f"{where}: expected tasks among {TASKS}, got none")
        for task in self.tasks:
            check_choice("tasks", task, TASKS, where=where)
        for name in ("attentions", "tasks"):  # a repeated name would train its runs twice and count them twice
            values = getattr(self, name)
            repeated = list(dict.fromkeys(value for value in values if values.count(value) > 1))
            if repeated:
                raise ValueError(
                    f"{where}: expected distinct {name}, got {list(values)} ({', '.join(repeated)} more than once)"
                )
        for name in _BOOLEANS:  # a truthy string or number would switch the setting on
            if not isinstance(getattr(self, name), bool):
                raise InputTypeError(f"{where}: expected {name} to be a bool, got {getattr(self, name)!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"{where}: expected distinct seeds, got {list(self.seeds)}")
        if len(set(self.primary_seeds)) != len(self.primary_seeds) or set(self.primary_seeds) & set(self.seeds):
            raise ValueError(
                f"{where}: expected distinct primary_seeds, none of them among seeds {list(self.seeds)}, got "
                f"{list(self.primary_seeds)}"
            )
        self.ensemble = check_int("ensemble size", self.ensemble, where=where)
        ensembles = [name for name in self.attentions if get_method(name).predictive.members > 1]
        if self.ensemble > 1 and ensembles:
            raise ValueError(
                f"{where}: ensemble={self.ensemble} makes ensembles of single-model rows, but {ensembles} are "
                f"ensembles already; compare them with ensemble=1"
            )
        for name in self.attentions:  # every member seed within torch's range, refused here rather than mid-grid
            members = max(self.ensemble, get_method(name).predictive.members)
            for seed in self.row_seeds(name):
                try:
                    member_seed(seed, members - 1, members)
                except ValueError as error:
                    raise ValueError(f"{where}: row {name!r}: {error}") from None
        for name in ("pointer_epochs", "digits_epochs", "mnist1d_epochs", "batch_size", "embed_dim", "depth"):
            setattr(self, name, check_int(name, getattr(self, name), where=where))  # stored as Python ints
        self.num_heads = check_int("num_heads", self.num_heads, where=where)
        self.ece_bins = check_int("ece_bins", self.ece_bins, where=where)
        self.fidelity_sequences = check_int("fidelity_sequences", self.fidelity_sequences, minimum=0, where=where)
        # the floats stored as Python floats too (a NumPy float32 would reach the records' JSON, which refuses it)
        self.mc_dropout = check_float(
            "mc_dropout", self.mc_dropout, 0.0, 1.0, strict_minimum=True, strict_maximum=True, where=where
        )
        self.eval_samples = check_int("eval_samples", self.eval_samples, where=where)
        if self.num_inducing is not None:
            self.num_inducing = check_int("num_inducing", self.num_inducing, where=where)
        # at least 1: with 0 every block is softmax attention, and a GP row would train a softmax model under its name
        self.gp_layers = check_int("gp_layers", self.gp_layers, 1, self.depth, where=where)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"{where}: embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})")
        self.lr = check_float("lr", self.lr, 0.0, strict_minimum=True, where=where)
        self.beta = check_float("beta", self.beta, 0.0, where=where)
        self.ksvd_weight = check_float("ksvd_weight", self.ksvd_weight, 0.0, where=where)
        check_device("device", self.device, where=where, types=DEVICE_TYPES)
        self.threads = check_int("threads", self.threads, where=where)
        self.jobs = check_int("jobs", self.jobs, where=where)
        if self.compile and not SETS_STANCE:  # the hooked passes (Laplace features, KSVD fidelity) run eagerly by it
            raise ValueError(
                f"{where}: compile=True needs torch 2.6 or later (torch.compiler.set_stance), got torch "
                f"{torch.__version__}"
            )
        if self.cuda_graphs and torch.device(self.device).type != "cuda":
            raise ValueError(f"{where}: cuda_graphs=True needs device='cuda', got {self.device!r}")
        if self.cuda_graphs and self.compile:  # the compiled model's own CUDA graphs cannot run inside a capture
            raise ValueError(f"{where}: choose compile=True or cuda_graphs=True, not both")
        if self.tuned_dir is not None:
            self.tuned_dir = str(self.tuned_dir)
            if not Path(self.tuned_dir).is_dir():
                raise ValueError(f"{where}: expected tuned_dir to be a folder of tuned files, got {self.tuned_dir!r}")
        # read once (not a field: the settings stay the options given); a malformed file fails here, before any run
        self._tuned = {task: read_tuned(task, self.tuned_dir) for task in self.tasks} if self.tuned else {}
        for task in self.tasks:
            for row in self.attentions:
                if self.tuned_entry(task, row) is not None:
                    try:
                        self.hyperparameters(task, get_method(row), TASK_DEFAULTS[task])
                    except ValueError as error:
                        raise ValueError(f"{tuned_path(task, self.tuned_dir)}, row {row!r}: {error}") from None

    def hyperparameters(
        self, task: str, method: MethodSpec | str, defaults: Mapping[str, Any] | None = None
    ) -> Hyperparameters:
        """The :class:`~gpattn.methods.Hyperparameters` of a run of the row ``method`` on ``task``: these settings,
        the same for every row (the task's epochs; the MC-dropout rate for the rows that predict with dropout, the
        task's dropout for the others; AdamW's weight decay of :class:`~gpattn.training.TrainConfig`), with the values
        of the row's tuned configuration (:meth:`tuned_entry`) in their place when :attr:`tuned` and there is one.

        :param task: One of :data:`~gpattn.comparison.tasks.TASKS`.
        :param method: The row, or its name.
        :param defaults: The task's own values (:attr:`~gpattn.comparison.TaskData.defaults`): ``num_inducing``, used
            where :attr:`num_inducing` is ``None``, and ``dropout`` (default 0), the dropout of the rows that do not
            predict with dropout.
        """
        check_choice("task", task, TASKS, where="CompareConfig.hyperparameters")
        method = get_method(method) if isinstance(method, str) else method
        defaults = {} if defaults is None else defaults
        shared = Hyperparameters(
            epochs=getattr(self, f"{task}_epochs"),
            lr=self.lr,
            weight_decay=TrainConfig.weight_decay,
            batch_size=self.batch_size,
            embed_dim=self.embed_dim,
            depth=self.depth,
            num_heads=self.num_heads,
            gp_layers=self.gp_layers,
            num_inducing=defaults.get("num_inducing") if self.num_inducing is None else self.num_inducing,
            beta=self.beta,
            ksvd_weight=self.ksvd_weight,
            dropout=self.mc_dropout if method.predictive.mc_dropout else defaults.get("dropout", 0.0),
        )
        entry = self.tuned_entry(task, method.name)
        hyperparameters = shared if entry is None else shared.updated(entry.hyperparameters)
        if hyperparameters.gp_layers < 1:  # a tuned configuration's own: the row's attention would be in no block
            raise ValueError(
                f"CompareConfig: expected gp_layers >= 1 for the row {method.name!r} on {task} (with 0 every block is "
                f"softmax attention, whatever the row), got {hyperparameters.gp_layers}"
            )
        return hyperparameters

    def tuned_entry(self, task: str, row: str) -> TunedRow | None:
        """The tuned configuration the row ``row`` uses on ``task`` (its own, or the one it inherits:
        :meth:`tuned_source`), or ``None``: the shared settings (no entry, or :attr:`tuned` is ``False``)."""
        source = self.tuned_source(task, row)
        return None if source is None else self._tuned[task][source]

    def tuned_source(self, task: str, row: str) -> str | None:
        """The row whose tuned configuration the row ``row`` uses on ``task``: ``row`` itself, the row it inherits
        from (``deep_ensemble`` and the Laplace row: ``"softmax"``), or ``None`` for the shared settings
        (:func:`~gpattn.comparison.tuned_configuration.tuned_source`)."""
        return tuned_source(row, self._tuned[task]) if task in self._tuned else None

    def is_tuned(self, task: str, method: MethodSpec | str) -> bool:
        """Whether :meth:`hyperparameters` of ``(task, method)`` come from a tuned configuration, the row's own or an
        inherited one (recorded as :attr:`~gpattn.comparison.RunRecord.tuned`).

        :param task: One of :data:`~gpattn.comparison.tasks.TASKS`.
        :param method: The row, or its name.

        Example:
            >>> CompareConfig(tasks=("pointer",)).is_tuned("pointer", "softmax")  # no tuned file for the pointer task
            False
        """
        check_choice("task", task, TASKS, where="CompareConfig.is_tuned")
        return self.tuned_source(task, method if isinstance(method, str) else method.name) is not None

    def attention_arguments(self, row: str) -> dict[str, Any]:
        """The keyword arguments of the attention layer of the row ``row`` under these settings: ``num_inducing`` and
        ``ksvd_weight`` where the layer takes them (``num_inducing=None``: the layer's default; a run uses the task's
        size then), then the row's own (:meth:`~gpattn.methods.MethodSpec.layer_arguments`).

        Example:
            >>> CompareConfig(num_inducing=8).attention_arguments("sgpa")
            {'num_inducing': 8}
        """
        return get_method(row).layer_arguments(num_inducing=self.num_inducing, ksvd_weight=self.ksvd_weight)

    def row_seeds(self, row: str) -> tuple[int, ...]:
        """The seeds of ``row``: :attr:`seeds`, and :attr:`primary_seeds` too for a row of :data:`PRIMARY_ROWS`.

        Example:
            >>> config = CompareConfig.full()
            >>> config.row_seeds("kep_svgp"), config.row_seeds("sgpa")
            ((0, 1, 2, 3, 4, 5, 6, 7, 8, 9), (0, 1, 2, 3, 4))
        """
        return self.seeds + (self.primary_seeds if row in PRIMARY_ROWS else ())

    @classmethod
    def main(cls, **overrides: Any) -> CompareConfig:
        """The protocol's main job (``make main``): the primary pair (:data:`PRIMARY_ROWS`, each with its ``+ts``
        row) on MNIST-1D with the seeds :data:`MAIN_SEEDS` (0-6, a subset of the endpoint's 10 that fits 15 minutes
        on 2 cores; :meth:`full` runs all 10), in the tuned configurations."""
        settings = {"attentions": PRIMARY_ROWS, "tasks": ("mnist1d",), "seeds": MAIN_SEEDS}
        return cls(**{**settings, **overrides})

    @classmethod
    def full(cls, **overrides: Any) -> CompareConfig:
        """The protocol's full grid (``gpattn compare --full``): every row of :data:`MAIN_TABLE_ROWS` on MNIST-1D and
        digits, seeds 0-4, and seeds 5-9 too for the primary pair, in the tuned configurations. ``seeds`` given
        without ``primary_seeds`` (``--full --seeds ...``) are the seeds of every row, the primary pair's included:
        the preset's further seeds 5-9 are dropped (they could repeat the given ones).

        Example:
            >>> CompareConfig.full(seeds=(5,)).row_seeds("kep_svgp")
            (5,)
        """
        settings = {"attentions": MAIN_TABLE_ROWS, "tasks": ("mnist1d", "digits"), "seeds": tuple(range(5))}
        settings["primary_seeds"] = () if "seeds" in overrides else tuple(range(5, DECLARED_PRIMARY_SEEDS))
        return cls(**{**settings, **overrides})

    @classmethod
    def quick(cls, **overrides: Any) -> CompareConfig:
        """A smoke test (``smoke_test=True``, labelled so in ``table.md``): the pointer task and digits, one seed, few
        epochs (the shared settings: ``tuned=False``), fewer Monte Carlo samples. It checks that everything runs; the
        pointer task is not learned in 2 epochs (every attention stays near chance there), so its numbers compare
        nothing."""
        settings = {"tasks": ("pointer", "digits"), "seeds": (0,), "pointer_epochs": 2, "digits_epochs": 10}
        settings.update(mnist1d_epochs=4, eval_samples=4, smoke_test=True, tuned=False)
        return cls(**{**settings, **overrides})
