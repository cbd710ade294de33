"""The runs of ``gpattn compare``: every row on MNIST-1D, scikit-learn's digits and the toy pointer task under one
training loop (settings: :mod:`gpattn.comparison.config`; scheduling: :mod:`gpattn.comparison.runner`; tables and
files: :mod:`gpattn.comparison.report`).

A run is a pure function :func:`train_and_evaluate` ``(config, task, row, seed) -> RunRecord``. It resolves its row
once into a :class:`~gpattn.methods.MethodSpec` (:func:`~gpattn.methods.resolve_method`) and its numbers into
:class:`~gpattn.methods.Hyperparameters` (:meth:`~gpattn.comparison.CompareConfig.hyperparameters`), and everything
below reads those two: a small :class:`~gpattn.models.Transformer` (the last ``gp_layers`` blocks use the row's
attention, the others softmax, as in the papers), or the row's ensemble of them
(:func:`~gpattn.training.train_ensemble`), is trained with :func:`~gpattn.training.train_model` under the row's
recipe and evaluated as the row predicts (:attr:`~gpattn.methods.Predictive.kind`: its own Monte Carlo samples, MC
dropout, or a last-layer Laplace approximation fitted on the training split after training,
:class:`~gpattn.models.LastLayerLaplace`) with :math:`T` Monte Carlo samples: accuracy, NLL, ECE/MCE, debiased and
sweep calibration errors, Brier, AURC/E-AURC and misclassification AUROC/FPR95 on the test set, and every test
example's prediction; under shift and against OOD sets where the task has them. Everything a figure or a statistic
needs goes into the run's :class:`~gpattn.comparison.RunRecord`, with the hyperparameters it used.

The attentions, their order and the arguments each takes come from the attention registry
(:mod:`gpattn.attention.registry`), the rows from the row registry (:mod:`gpattn.methods.registry`), so a newly
registered attention or row is compared like the built-in ones.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .._torch_compat import recompile_limit_name
from ..attention import accepts_argument, attention_arguments, build_attention
from ..methods import Hyperparameters, MethodSpec, get_method, resolve_method
from ..models import LastLayerLaplace, Transformer
from ..training import Callback, TrainConfig, dataset_inputs, dataset_labels, member_seed, train_ensemble
from ..training.graphs import CapturedForward, capture_refusals
from ..validation import keyword_arguments
from .config import CompareConfig
from .evaluation import evaluate_models
from .fidelity import model_fidelity
from .records import RunRecord, TrainingSummary
from .table_rows import ensemble_row
from .tasks import TASK_DEFAULTS, TaskData, load_task

__all__ = [
    "build_model",
    "check_model_arguments",
    "compile_model",
    "layer_arguments",
    "learned_spectra",
    "make_train_config",
    "plan_runs",
    "train_and_evaluate",
]


#: The hyperparameters every run offers its attention layer (:func:`layer_arguments`), where the layer takes them.
SHARED_LAYER_SETTINGS = ("num_inducing", "ksvd_weight")


def layer_arguments(method: MethodSpec, hyperparameters: Hyperparameters) -> dict[str, Any]:
    """The keyword arguments of the row's attention layer in a run: ``SHARED_LAYER_SETTINGS`` (``num_inducing``
    and ``ksvd_weight``) of ``hyperparameters`` where the layer takes them (``num_inducing=None`` is the layer's
    default), then the row's own (:meth:`~gpattn.methods.MethodSpec.layer_arguments`)."""
    return method.layer_arguments(**{name: getattr(hyperparameters, name) for name in SHARED_LAYER_SETTINGS})


#: Dynamo's limit of compiled graphs per function that :func:`compile_model` sets (at least): the comparison's rows
#: run in one process compile a few graphs each into the cache of the one forward function they share.
RECOMPILE_LIMIT = 64


def build_model(
    method: MethodSpec, hyperparameters: Hyperparameters, num_classes: int, model_kwargs: dict[str, Any]
) -> Transformer:
    """The Transformer of one run of the row ``method``: its size and dropout from ``hyperparameters``, its input from
    the task's ``model_kwargs`` (:attr:`~gpattn.comparison.TaskData.model_kwargs`), the row's model arguments and its
    attention with :func:`layer_arguments`."""
    hp = hyperparameters
    sizes = {"embed_dim": hp.embed_dim, "depth": hp.depth, "num_heads": hp.num_heads, "gp_layers": hp.gp_layers}
    arguments = {**sizes, "dropout": hp.dropout, **model_kwargs, **method.model_arguments}
    return Transformer(num_classes, attention=method.attention, **arguments, **layer_arguments(method, hp))


def check_model_arguments(method: MethodSpec) -> None:
    """Check that the row's :attr:`~gpattn.methods.MethodSpec.model_arguments` are keyword arguments the
    :class:`~gpattn.models.Transformer` takes (read from its signature): its own but ``num_classes`` and ``attention``
    (:func:`build_model` passes them), or the row's attention's, which it forwards to the layer.

    :raises ValueError: A name it does not take (e.g. ``"dept"`` for ``"depth"``; the message names the row, the
        unknown names and the accepted ones), or a layer argument that the run passes to the layer itself (the shared
        ``num_inducing`` / ``ksvd_weight`` where the layer takes them, or one of the row's ``attention_arguments``):
        given twice, it would fail in :func:`build_model` with Python's "multiple values for keyword argument".
    """
    own = keyword_arguments(Transformer, ("num_classes", "attention"))
    layer = attention_arguments(method.attention)
    unknown = sorted(
        name
        for name in method.model_arguments
        if name in ("num_classes", "attention") or (name not in own and not accepts_argument(method.attention, name))
    )
    if unknown:
        raise ValueError(
            f"the row {method.name!r} passes the model arguments {unknown}, which the Transformer does not take (or "
            f"the run sets: num_classes, attention); it takes {own} and the arguments of the attention "
            f"{method.attention!r}: {layer}"
        )
    # the names layer_arguments gives the layer in every run (which ones does not depend on the values, but for None)
    passed = method.layer_arguments(**dict.fromkeys(SHARED_LAYER_SETTINGS, 1))
    twice = sorted(name for name in method.model_arguments if name in passed)
    if twice:
        raise ValueError(
            f"the row {method.name!r} passes {twice} as model arguments, but the run gives them to its attention "
            f"layer itself (the shared settings num_inducing and ksvd_weight, and the row's attention_arguments "
            f"{dict(method.attention_arguments)}); set a layer argument in attention_arguments only"
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
    method: MethodSpec,
    hyperparameters: Hyperparameters,
    seed: int,
    checkpoint_dir: str | Path | None = None,
) -> TrainConfig:
    """The :class:`~gpattn.training.TrainConfig` of one run: the optimisation settings of ``hyperparameters``, its
    early stopping (:attr:`~gpattn.methods.Hyperparameters.patience`: a tuned configuration trains as its trials did),
    the KL annealing length (:meth:`~gpattn.methods.Hyperparameters.kl_anneal_epochs`: a tuned fraction, else the
    row's recipe: SGPA anneals), the row's validation predictive (MC dropout for an MC-dropout row: it is selected,
    stopped early and tuned on the predictive it is tested with), and ``config``'s evaluation samples and device."""
    return TrainConfig(
        epochs=hyperparameters.epochs,
        batch_size=hyperparameters.batch_size,
        lr=hyperparameters.lr,
        weight_decay=hyperparameters.weight_decay,
        beta=hyperparameters.beta,
        patience=hyperparameters.patience,
        kl_anneal_epochs=hyperparameters.kl_anneal_epochs(method.recipe),
        cuda_graphs=config.cuda_graphs,
        eval_samples=config.eval_samples,
        mc_dropout=method.predictive.mc_dropout,
        seed=seed,
        device=config.device,
        progress=False,
        checkpoint_dir=checkpoint_dir,
    )


def compile_model(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """The model's forward pass compiled by ``torch.compile``, in place (the module, its parameters and its state dict
    unchanged): with the options of mode ``"reduce-overhead"`` on CUDA (``triton.cudagraphs``: CUDA graphs replay a
    step's many small kernels as one launch), of the default mode elsewhere (on CPU the compiler fuses the elementwise
    passes), and ``fallback_random`` (eager's random numbers: dropout masks, joint draws). Shapes are static
    (``dynamic=False``): each input shape and mode (training, evaluation) compiles its own graph at its first call,
    as CUDA graphs need anyway.

    The compiled function is set as the instance's ``forward``, which both ``torch.nn.Module.__call__`` and
    ``gpytorch.Module.__call__`` (the :class:`~gpattn.models.Transformer`'s) call. ``Module.compile`` would install it
    where only torch's ``__call__`` looks (``_compiled_call_impl``), so a GPyTorch module would run eagerly, silently.
    On CUDA every call returns copies of the tensors it returns (in tuples, lists and dicts): a CUDA graph writes its
    outputs into buffers that its next replay overwrites, and an evaluation keeps the logits of all its Monte Carlo
    passes. Dynamo's limit of graphs per function is raised to :data:`RECOMPILE_LIMIT`: the models of one process
    share the compiled forward's cache (models of the same row reuse its graphs; each row adds some: training, the
    epoch's last batch, evaluation with and without sampling at each batch size), and past the limit a model would run
    eagerly with only a log line.

    .. warning:: A compiled model cannot be pickled, and a ``copy.deepcopy`` of it still calls the original's compiled
        forward (its own parameters unused): copy the model before compiling it, or rebuild it from a state dict.

    :return: ``model``.
    """
    cuda = torch.device(device).type == "cuda"
    options = {"fallback_random": True, **({"triton.cudagraphs": True} if cuda else {})}
    limit = recompile_limit_name()
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), RECOMPILE_LIMIT))
    compiled = torch.compile(model.forward, dynamic=False, options=options)
    if not cuda:
        model.forward = compiled
        return model

    def forward(*args: Any, **kwargs: Any) -> Any:
        return tree_map(lambda value: value.clone() if torch.is_tensor(value) else value, compiled(*args, **kwargs))

    model.forward = forward
    return model


def plan_runs(config: CompareConfig) -> list[tuple[str, str, int]]:
    """The ``(task, row, seed)`` runs of ``config`` in the nesting order of the tables, after checking once, before
    any training, that every row's model arguments are the Transformer's (:func:`check_model_arguments`) and that
    the attention layer of every (task, row) accepts its arguments (one layer of each distinct kind is built, without
    touching the caller's RNG).

    :raises ValueError: A row's model arguments name one the Transformer does not take, or a layer refuses its
        arguments (e.g. a ``num_inducing`` above the head width); the message names the row, the arguments and the
        reason.
    """
    for row in config.attentions:
        check_model_arguments(get_method(row))
    checked = set()
    for task in config.tasks:
        for row in config.attentions:
            method = get_method(row)
            hyperparameters = config.hyperparameters(task, method, TASK_DEFAULTS[task])
            arguments = layer_arguments(method, hyperparameters)
            key = (method.attention, hyperparameters.embed_dim, hyperparameters.num_heads, repr(sorted(arguments)))
            if key in checked:
                continue
            checked.add(key)
            with torch.random.fork_rng(devices=[]):
                try:
                    build_attention(method.attention, hyperparameters.embed_dim, hyperparameters.num_heads, **arguments)
                except (ValueError, TypeError) as error:
                    head_width = hyperparameters.embed_dim // hyperparameters.num_heads
                    given = ", ".join(f"{name} ({value})" for name, value in arguments.items()) or "its defaults"
                    raise ValueError(
                        f"the row {row!r}: the attention {method.attention!r} with {given} does not fit the head "
                        f"width embed_dim / num_heads = {head_width}: {error}"
                    ) from error
    return [(task, row, seed) for task in config.tasks for row in config.attentions for seed in config.row_seeds(row)]


def train_and_evaluate(
    config: CompareConfig,
    task: str,
    method: str | MethodSpec,
    seed: int,
    data: TaskData | None = None,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    *,
    callbacks: Iterable[Callback] = (),
) -> RunRecord:
    """Train one row on ``task`` with ``seed`` (one model, or the row's ensemble, or an ensemble of
    ``config.ensemble`` members recorded as ``"<row>_ens<K>"``) and return its record. The result depends on the
    arguments only (every random stream is seeded from ``seed``: the validation split's draw, the training, and each
    evaluated set's Monte Carlo draws, :func:`~gpattn.comparison.random_stream`).

    The record holds the metrics of the model as trained, of its temperature-scaled variant (``+ts``:
    :func:`~gpattn.comparison.evaluate_models`, temperature fitted on the validation split, when
    ``config.temperature_scaling`` and the row has one) and the KSVD fidelity of its KSVD layers on
    ``config.fidelity_sequences`` test sequences (:func:`~gpattn.comparison.model_fidelity`; of the first member of
    an ensemble).

    :param method: The row: a name of :func:`~gpattn.methods.method_names` or a :class:`~gpattn.methods.MethodSpec`.
    :param data: The task's data for ``seed`` (:func:`~gpattn.comparison.load_task` ``(task, seed)``), to share the
        loading between runs.
    :param checkpoint_dir: Where the run writes ``best.pt``/``last.pt`` (``member_<k>/`` for ensembles).
    :param resume: Continue an interrupted run from ``last.pt`` (bit-identical on CPU).
    :param callbacks: :class:`~gpattn.training.Callback` s told about the training of every member (e.g.
        :class:`~gpattn.training.EpochLog`, the lines of ``gpattn train``).
    :return: The :class:`~gpattn.comparison.RunRecord`.
    """
    method = resolve_method(method)
    data = load_task(task, seed) if data is None else data
    if data.name != task or data.seed != seed:
        raise ValueError(
            f"train_and_evaluate: the data are those of task {data.name!r} with validation seed {data.seed}, but the "
            f"run is {task!r} with seed {seed}; load them with load_task({task!r}, {seed})"
        )
    hyperparameters = config.hyperparameters(task, method, data.defaults)
    train_config = make_train_config(config, method, hyperparameters, seed, checkpoint_dir)
    if config.cuda_graphs:  # the rows whose layers read values on the host (SGPA) train eagerly
        with torch.random.fork_rng(devices=[]):  # a model to ask, built without touching the runs' random numbers
            probe = build_model(method, hyperparameters, data.num_classes, data.model_kwargs)
        train_config = dataclasses.replace(train_config, cuda_graphs=not capture_refusals(probe))
    size = method.predictive.members if config.ensemble == 1 else config.ensemble

    def make_model(member: int) -> Transformer:
        model = build_model(method, hyperparameters, data.num_classes, data.model_kwargs).to(config.device)
        return compile_model(model, config.device) if config.compile else model

    start = time.perf_counter()
    members = train_ensemble(make_model, data.train, data.val, train_config, size, resume, callbacks=callbacks)
    seconds = time.perf_counter() - start
    models = [model for model, _ in members]
    predictors = models
    if method.predictive.laplace:  # post hoc, on the trained weights: deterministic given them
        inputs, mask = dataset_inputs(data.train)
        labels = dataset_labels(data.train)
        mask = None if mask is None else mask.to(config.device)
        predictors = [LastLayerLaplace(model).fit(inputs.to(config.device), labels, mask) for model in models]
    elif train_config.cuda_graphs:  # the evaluation's passes replayed from CUDA graphs, as the validation's were
        predictors = [CapturedForward(model, config.device) for model in models]
    evaluation = evaluate_models(
        predictors,
        data,
        config.eval_samples,
        num_bins=config.ece_bins,
        mc_dropout=method.predictive.mc_dropout,
        temperature_scaling=config.temperature_scaling and method.temperature_scaled,
        seed=seed,
    )
    for predictor in predictors:
        if isinstance(predictor, CapturedForward):
            predictor.release()  # the graphs' memory back to the allocator before the next run
    fidelity = {}
    if config.fidelity_sequences:  # the first member against itself as train_ensemble built it, before training
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(member_seed(train_config.seed, 0, size))
            initial = make_model(0)
        fidelity = model_fidelity(models[0], data.test, config.fidelity_sequences, initial)
    return RunRecord(
        task=task,
        attention=ensemble_row(method.name, config.ensemble),
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
            ensemble=size,
            epochs_trained=statistics.fmean(len(result.history) for _, result in members),
            cuda_graphs=train_config.cuda_graphs,  # False for a row refused the graphs
        ),
        temperature_scaled=evaluation.temperature_scaled,
        fidelity=fidelity,
        per_example=evaluation.per_example,
        hyperparameters=hyperparameters.to_dict(),
        tuned=config.is_tuned(task, method),
    )
