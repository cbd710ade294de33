r"""The training loop: AdamW, warm-up + cosine schedule, clipping, model selection on the validation NLL, checkpoints
and resume, callbacks. Single-process, ensemble (:func:`~gpattn.training.train_ensemble`) and data-parallel
(:func:`~gpattn.training.distributed.train_distributed`) training all run this one loop.

:func:`train_model` minimises :class:`~gpattn.mlls.AttentionELBO` with AdamW. The learning rate rises linearly
during the warm-up and then follows a cosine down to ``min_lr`` (:func:`~gpattn.training.warmup_cosine_lr`,
updated every optimiser step); gradients are clipped by their global norm. After every epoch the model is evaluated on
the validation set with :math:`T` Monte Carlo samples (:func:`~gpattn.training.evaluate`), and the state with the
lowest validation NLL (:func:`~gpattn.metrics.negative_log_likelihood`, the NLL the comparison reports) is kept (in
memory and, with ``checkpoint_dir``, in ``best.pt``); it is loaded into the model at the end. With
``config.patience``, training stops early once that many epochs have passed without a lower validation NLL.

The loop is a few helpers, one per level: a step (forward, loss, backward, clip, optimiser and schedule steps, with
the divergence checks), an epoch (the steps over one permutation of the training set), the validation and the
checkpoint of an epoch. What watches a run (a progress bar, per-epoch lines) is a :class:`~gpattn.training.Callback`.
How the processes of a run cooperate is a :class:`~gpattn.training.TrainingStrategy`: the default is one process;
data-parallel training passes one that shards the batches, all-reduces the gradients and the epoch's loss sums,
validates on rank 0 and broadcasts its best state. The loop itself is the same.

Determinism: a run is a function of ``config.seed`` and the model's initial parameters. The global torch RNG
(reparameterisation noise, dropout, Monte Carlo evaluation) is seeded with ``config.seed + rank`` (``config.seed`` in
a single process) and the batch order comes from a local ``torch.Generator`` seeded with ``config.seed``; NumPy's
global RNG is never used. Every epoch ends with a checkpoint ``last.pt`` holding both RNG states, so a run resumed
from it (``resume=True``) reproduces the uninterrupted run bit for bit on the CPU.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..mlls import AttentionELBO
from ..models import dropout_modules
from ..validation import all_finite, non_finite_parameters
from .batches import batch_to_device, check_finite_inputs, check_label_range, dataset_inputs, dataset_labels
from .callbacks import Callback, CallbackList, TrainingContext, check_callbacks
from .checkpoint_files import save_run_checkpoints
from .checkpoints import model_description, restore_run, rng_state
from .config import TrainConfig, TrainResult
from .errors import TrainingDivergedError
from .graphs import CapturedForward, CapturedStep, capture_refusals
from .predictions import evaluate, validation_metrics
from .progress import ProgressBar
from .schedule import warmup_cosine_schedule
from .strategy import TrainingStrategy

__all__ = ["LOSS_PARTS", "train_model"]

#: The per-epoch training averages of :attr:`~gpattn.training.TrainResult.history`.
LOSS_PARTS = ("loss", "nll", "kl", "ksvd", "prior", "grad_norm")
#: the loss parts in the order of :class:`~gpattn.mlls.AttentionELBO`'s dict, as the divergence messages list them
ELBO_PARTS = ("nll", "kl", "ksvd", "prior", "loss")


def train_model(
    model: torch.nn.Module,
    train: Any,
    val: Any,
    config: TrainConfig,
    resume: bool = False,
    *,
    strategy: TrainingStrategy | None = None,
    callbacks: Iterable[Callback] = (),
) -> TrainResult:
    """Train ``model`` on ``train`` with :class:`~gpattn.mlls.AttentionELBO` and AdamW, selecting on ``val``.

    Each epoch visits the training set in a random order (``ceil(n / batch_size)`` steps) and ends with an
    evaluation on ``val`` (:func:`~gpattn.training.evaluate` with ``config.eval_samples`` samples: accuracy and
    NLL), then the checkpoint ``last.pt`` (and ``best.pt`` when the validation NLL is the lowest so far; ties keep the
    earlier epoch). At the end the best state is loaded into the model, which is left in eval mode.

    :param model: Maps ``(inputs, mask=mask)`` to logits ``(B, C)`` and has ``kl_divergence()``
        (e.g. :class:`~gpattn.models.Transformer`). Moved to the strategy's device (``config.device``).
    :param train: Training set with ``.labels`` (class indices of any integer dtype, used as ``int64``) and
        ``.tokens`` (and ``.mask``), ``.images`` or ``.inputs``.
    :param val: Validation set of the same kind.
    :param config: The settings.
    :param resume: Continue from ``config.checkpoint_dir / "last.pt"`` (model, optimiser, schedule, RNG states and
        history), training up to ``config.epochs`` in total. On the CPU the result equals the uninterrupted run's
        bit for bit, provided the settings (and the schedule horizon) are unchanged.
    :param strategy: How the processes of the run cooperate (default: one process,
        :class:`~gpattn.training.TrainingStrategy`).
    :param callbacks: A list (any iterable) of :class:`~gpattn.training.Callback` s told about the run in the main
        process (after a :class:`~gpattn.training.ProgressBar`, which ``config.progress`` adds).
    :return: The :class:`~gpattn.training.TrainResult` (on processes other than the main one: an empty history).
    :raises TrainingDivergedError: At the step where the loss, the gradient norm, a parameter after the optimiser step
        or the forward pass (a ``NaN or Inf`` error of a layer on finite inputs) becomes NaN or infinite, or when the
        validation's forward pass or predictions do; the message names the epoch and step. The model then holds the
        best state so far (the initial one before the first evaluation; with several processes the main process's,
        on every process) and the checkpoints on disk stay those of the last completed epoch.
    :raises TypeError: ``model`` is not a ``torch.nn.Module``, ``callbacks`` not a list of callbacks (e.g. one
        :class:`~gpattn.training.Callback` not in a list), or a data set without a tensor of inputs, with a mask that
        is not a tensor or labels that are not a vector of an integer dtype (:func:`~gpattn.training.dataset_labels`;
        the message names the data set).
    :raises ValueError: An empty data set, a mask or labels of another row count than its inputs, or training or
        validation labels outside ``[0, num_classes - 1]`` of a model with an integer ``num_classes`` attribute (as
        :class:`~gpattn.models.Transformer`), floating-point inputs holding NaN or Inf, ``config.mc_dropout`` for a
        model without dropout, or float16 parameters (AdamW's eps = 1e-8 is 0 in float16; float32
        parameters under ``torch.autocast`` or bfloat16 parameters train), before anything trains.
    :raises KeyboardInterrupt: Ctrl-C, passed on as it came: the model then holds the parameters of the last step
        taken (in training mode), not the best state, and the checkpoints on disk stay those of the last completed
        epoch, from which ``resume=True`` continues as if uninterrupted (on the CPU).
    :raises FileNotFoundError: ``resume=True`` without ``last.pt``.
    :raises CheckpointError: ``resume=True`` with a checkpoint that cannot be read, is damaged or inconsistent, does
        not pair with ``best.pt``, was written for another model (other parameter names, shapes or dtypes, or another
        configuration of the same shapes: e.g. another number of heads or dropout rate) or by a run with other settings
        (seed, learning rate, ..., a schedule horizon, ``epochs`` below the epoch already trained, or a training or
        validation set of another size; see
        :func:`~gpattn.training.checkpoints.check_resumable`) (the message names the file and what differs). The
        model is then left untouched.

    Example:
        >>> from gpattn.data import make_pointer_task
        >>> from gpattn.models import Transformer
        >>> from gpattn.training import TrainConfig, train_model
        >>> import torch
        >>> data = make_pointer_task(256, 64, 64, length=8, seed=0, vocab_size=8)
        >>> _ = torch.manual_seed(0)  # the model's initial parameters (the loop seeds everything after)
        >>> model = Transformer(2, embed_dim=16, depth=1, num_heads=2, vocab_size=8, max_len=8)
        >>> result = train_model(model, data.train, data.val, TrainConfig(epochs=2, seed=0, progress=False))
        >>> len(result.history), result.best_epoch  # epochs trained; the one of the lowest validation NLL
        (2, 1)
        >>> sorted(result.history[0])  # what each epoch records
        ['epoch', 'grad_norm', 'kl', 'ksvd', 'loss', 'lr', 'nll', 'prior', 'seconds', 'val_accuracy', 'val_nll']

    .. note:: Per epoch one forward and backward pass over the training set and ``eval_samples`` forward passes over
        the validation set; the checkpoints add two state copies (model, AdamW moments) written to disk with a
        SHA-256 each. AdamW runs its multi-tensor implementation (``foreach=True``) on every device, a fixed number of
        operators per step whatever the number of parameter tensors (torch's CPU default loops over them, with the
        same numbers). The divergence guard adds one fused max-norm pass over the parameters per step
        (``torch._foreach_norm``). A step reads the device twice (two host synchronisations on a GPU): the loss parts
        after the forward pass, then the gradient norm with the largest parameter entry after the optimiser step (a
        non-finite gradient norm is reported as such; the model is restored either way).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"train_model: expected model to be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"expected a TrainConfig, got {type(config).__name__}")
    callbacks = check_callbacks(callbacks, "train_model")
    if resume and config.checkpoint_dir is None:
        raise ValueError("resume=True needs config.checkpoint_dir (the directory holding last.pt), got None")
    # (the trained ones: a frozen float16 part, which AdamW never steps, is fine)
    half = [name for name, p in model.named_parameters() if p.dtype == torch.float16 and p.requires_grad]
    if half:
        # AdamW's eps = 1e-8 is 0 in float16: a gradient entry of exactly zero makes its step 0/0 = NaN at step one
        shown = ", ".join(half[:3]) + (f" and {len(half) - 3} more" if len(half) > 3 else "")
        raise ValueError(
            f"train_model: the model has float16 parameters ({shown}), which AdamW cannot train (its eps = 1e-8 is 0 "
            "in float16, so the first step divides zero by zero); keep the parameters in float32 and compute in "
            "float16 under torch.autocast, or use bfloat16 parameters"
        )
    loop = _Loop(model, train, val, config, TrainingStrategy() if strategy is None else strategy, callbacks)
    return loop.run(resume)


def _state_copy(model: torch.nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _describe(values: dict[str, float], order: Iterable[str]) -> str:
    # the loss parts' values, in the order of the loss function's parts
    return ", ".join(f"{name}={values[name]:.6g}" for name in order)


def _activations_overflowed(error: ValueError, inputs: Tensor) -> bool:
    """Whether ``error``, raised by a forward pass on ``inputs``, means that training diverged: a layer found NaN or
    Inf in its input although the inputs are finite (and the parameters too: checked after every step), so the
    activations overflowed."""
    return "NaN or Inf" in str(error) and all_finite(inputs)


class _Loop:
    """The state of one call of :func:`train_model` and its helpers: a step, an epoch, its validation and checkpoint."""

    def __init__(
        self,
        model: torch.nn.Module,
        train: Any,
        val: Any,
        config: TrainConfig,
        strategy: TrainingStrategy,
        callbacks: Iterable[Callback],
    ) -> None:
        self.model, self.val, self.config, self.strategy = model, val, config, strategy
        self.device = strategy.device(config)
        self.train_inputs, self.train_mask = dataset_inputs(train, "training")
        self.train_labels = dataset_labels(train, "training")  # int64, whatever integer dtype they came in
        self.val_labels = dataset_labels(val, "validation")
        check_label_range(model, {"training": self.train_labels, "validation": self.val_labels})
        check_finite_inputs({"training": self.train_inputs, "validation": dataset_inputs(val, "validation")[0]})
        if config.mc_dropout and not dropout_modules(model):  # the first validation would refuse it, after an epoch
            raise ValueError(
                f"train_model: TrainConfig(mc_dropout=True) validates on the MC-dropout predictive, but the "
                f"{type(model).__name__} has no dropout module with a rate above 0, so every pass would be identical; "
                "build it with dropout > 0 (e.g. Transformer(..., dropout=0.1)) or set mc_dropout=False"
            )
        self.directory = None if config.checkpoint_dir is None else Path(config.checkpoint_dir)
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as error:  # a file in its place, or above it; no permission
                reason = error.strerror or str(error)
                raise OSError(error.errno, f"cannot create the checkpoint folder {self.directory} ({reason})") from None
        # the model as built, before training changes anything: what the checkpoints record, and a resumed run compares
        self.model_description = model_description(model)
        model.to(self.device)
        self.forward = strategy.wrap(model)
        self.num_data = self.train_labels.shape[0]
        self.steps_per_epoch = math.ceil(math.ceil(self.num_data / strategy.world_size) / config.batch_size)
        total_steps, warmup_steps = config.schedule_steps(self.steps_per_epoch)
        # A: kl_anneal_epochs epochs of steps, rounded up; to 9 decimals first, so that a product that is a whole number
        # but for the float error (2.2 * 25 = 55.00000000000001) is not rounded up to the next step
        self.anneal_steps = math.ceil(round(config.kl_anneal_epochs * self.steps_per_epoch, 9))
        # the loop checks the loss itself (in _step), to restore the last good state and report the step
        self.loss_fn = AttentionELBO(
            model, num_data=self.num_data, beta=config.beta, combine_terms=False, check_finite=False
        )
        # the multi-tensor implementation on every device: torch picks it by itself on a GPU only, and on the CPU its
        # per-parameter loop costs about ten operators per parameter tensor and step (the same numbers either way)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, weight_decay=config.weight_decay, foreach=True
        )
        self.scheduler = warmup_cosine_schedule(self.optimizer, total_steps, warmup_steps, config.min_lr)
        self.generator = torch.Generator()
        self.parameters = [parameter for parameter in model.parameters() if parameter.is_floating_point()]
        # the dtype of the step's read of its gradient norm and largest parameter: exact for every parameter dtype
        # (float16 / bfloat16 read as float32, float64 as float64)
        self.read_dtype = functools.reduce(torch.promote_types, [p.dtype for p in self.parameters], torch.float32)
        self.max_norm = math.inf if config.grad_clip is None else config.grad_clip
        self.captured = self._captured_step() if config.cuda_graphs else None
        # the validation's passes replayed from CUDA graphs too (one per batch shape)
        self.evaluated = CapturedForward(model, self.device) if config.cuda_graphs else model
        watchers = ([ProgressBar()] if config.progress else []) + list(callbacks)
        self.callbacks = CallbackList(watchers if strategy.is_main else [])
        self.epoch = 0

    # -- the run ------------------------------------------------------------------------------------------------------
    def run(self, resume: bool) -> TrainResult:
        if resume:
            state = (self.model, self.optimizer, self.scheduler, self.generator)
            checkpoint, best = restore_run(
                self.directory, *state, self._settings(), self.device, steps_per_epoch=self.steps_per_epoch
            )
            start_epoch = checkpoint["epoch"]
            self.result = TrainResult(list(checkpoint["history"]), checkpoint["best_epoch"], checkpoint["best_val_nll"])
            best = _state_copy(self.model) if best is None else best
            self.best_state = {name: value.to(self.device) for name, value in best.items()}
        else:
            torch.manual_seed(self.config.seed + self.strategy.rank)  # independent noise per process
            self.generator.manual_seed(self.config.seed)  # the same batch order on every process
            start_epoch, self.result = 0, TrainResult()
            self.best_state = _state_copy(self.model)  # the fallback before any evaluation
        context = TrainingContext(self.model, self.config, self.steps_per_epoch, start_epoch, self.result)
        try:
            self.callbacks.on_train_begin(context)
            for epoch in range(start_epoch + 1, self.config.epochs + 1):
                if self._patience_exhausted():
                    break
                self.epoch = epoch
                self._epoch(context)
            self.strategy.finish(self.model, self.best_state)
        except BaseException as error:
            self.callbacks.on_exception(context, error)
            raise
        finally:  # the graphs' memory back to the allocator (the loop holds a reference cycle)
            self.captured = None
            if isinstance(self.evaluated, CapturedForward):
                self.evaluated.release()
        self.model.load_state_dict(self.best_state)
        self.model.eval()
        try:
            self.callbacks.on_train_end(context)
        except BaseException as error:  # a hook raising anywhere: every callback is told (the callbacks' contract)
            self.callbacks.on_exception(context, error)
            raise
        return self.result

    def _epoch(self, context: TrainingContext) -> None:
        """One epoch: the steps over a permutation of the training set, the validation and the checkpoint."""
        started = time.perf_counter()
        self.model.train()
        self.callbacks.on_epoch_begin(context, self.epoch)
        totals = [0.0] * (len(LOSS_PARTS) + 1)  # the parts weighted by the batch sizes, and the sequence count
        order = self.strategy.shard(torch.randperm(self.num_data, generator=self.generator))
        for step in range(self.steps_per_epoch):
            index = order[step * self.config.batch_size : (step + 1) * self.config.batch_size]
            values = self._step(index, step + 1)
            for position, name in enumerate(LOSS_PARTS):
                totals[position] += values[name] * index.shape[0]
            totals[-1] += index.shape[0]
            self.callbacks.on_step_end(context, self.epoch, step + 1, values)
        record = self._validate(self.strategy.sum(totals), values["lr"], started)
        if record is not None:  # the main process
            improved = self._select(record)
            self._checkpoint(improved)
            self.callbacks.on_epoch_end(context, self.epoch, record)

    def _captured_step(self) -> CapturedStep:
        """The CUDA graph of the full-size steps (``config.cuda_graphs``), after checking that the run can use one."""
        where = "TrainConfig(cuda_graphs=True)"
        if self.strategy.world_size > 1:
            raise ValueError(f"{where}: CUDA graphs of data-parallel steps are not supported (one process only)")
        refused = capture_refusals(self.model)
        if refused:
            raise ValueError(
                f"{where}: the model's attention layers {refused} cannot be captured in a CUDA graph (they read values "
                "on the host: supports_graph_capture is False); train them with cuda_graphs=False"
            )
        # the KL weight as a float64 tensor, filled before each replay: a float would be frozen into the graph
        self.loss_fn.beta = torch.tensor(self.config.beta, dtype=torch.float64, device=self.device)
        return CapturedStep(self._loss_parts, self.parameters, self.device)

    def _loss_parts(self, inputs: Tensor, mask: Tensor | None, labels: Tensor) -> Tensor:
        """The loss parts of :data:`LOSS_PARTS` but the gradient norm, stacked (the loss first)."""
        parts = self.loss_fn(self.forward(inputs, mask=mask), labels)
        return torch.stack([parts[name] for name in LOSS_PARTS[:-1]])

    def _set_beta(self, beta: float) -> None:
        if torch.is_tensor(self.loss_fn.beta):
            self.loss_fn.beta.fill_(beta)
        else:
            self.loss_fn.beta = beta

    def _step(self, index: Tensor, step: int) -> dict[str, float]:
        """One optimiser step on the training rows ``index`` ``(b,)``: the loss parts, gradient norm and rate."""
        inputs, mask = batch_to_device(self.train_inputs, self.train_mask, index, self.device)
        labels = self.train_labels[index].to(self.device)
        global_step = self.scheduler.last_epoch  # from 0; restored on resume
        where = f"epoch {self.epoch}, step {step}/{self.steps_per_epoch} (global step {global_step + 1})"
        if self.anneal_steps:  # beta_t = beta min(1, (t + 1) / A), t the global step
            self._set_beta(self.config.beta * min(1.0, (global_step + 1) / self.anneal_steps))
        if self.captured is not None and index.shape[0] == self.config.batch_size:
            # forward and backward passes replayed by the CUDA graph; the loss parts read after it, before the
            # optimiser step (a non-finite loss stops the run with the parameters unchanged)
            values = self._read_loss_parts(self.captured(inputs, mask, labels), where, step)
        else:
            values = self._eager_forward_backward(inputs, mask, labels, where, step)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        # the second read: the gradient norm and the largest parameter magnitude together. A non-finite gradient norm
        # stops the run before any use of the stepped parameters (the model is restored from the best state), and a
        # step can make a parameter non-finite with a finite loss and gradient (a NaN or Inf in the optimiser's
        # moments, a huge learning rate): stop here, before the next forward pass sees it
        read = torch.stack((grad_norm.to(self.device, self.read_dtype), self._largest_parameter()))
        grad_norm, largest = read.tolist()
        if not math.isfinite(grad_norm):
            self._fail(f"non-finite gradient norm {grad_norm} at {where}: {_describe(values, ELBO_PARTS)}", step)
        if not math.isfinite(largest):
            broken = non_finite_parameters(self.model)[:5]
            self._fail(f"non-finite parameters {broken} after the optimiser step at {where}", step)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step used
        self.scheduler.step()
        return {**values, "grad_norm": grad_norm, "lr": lr}

    def _eager_forward_backward(
        self, inputs: Tensor, mask: Tensor | None, labels: Tensor, where: str, step: int
    ) -> dict[str, float]:
        """The forward pass, the loss parts (read once) and the backward pass of an eager step."""
        try:
            parts = self.loss_fn(self.forward(inputs, mask=mask), labels)
        except ValueError as error:
            if not _activations_overflowed(error, inputs):
                raise
            self.strategy.any(True)  # the stop flag of _read_loss_parts: the other processes stop at this step too
            self._fail(f"non-finite values in the forward pass at {where} ({error})", step, error)
        values = self._read_loss_parts(torch.stack([parts[name].detach() for name in LOSS_PARTS[:-1]]), where, step)
        self.optimizer.zero_grad(set_to_none=True)
        parts["loss"].backward()  # a data-parallel wrapper all-reduces the gradients here
        return values

    def _read_loss_parts(self, stacked: Tensor, where: str, step: int) -> dict[str, float]:
        """The loss parts of :data:`LOSS_PARTS` but the gradient norm, stacked, in one read of the device (the step's
        first of two synchronisations on a GPU); a non-finite loss on any process stops every process (one stopping
        alone would hang the others)."""
        values = dict(zip(LOSS_PARTS[:-1], stacked.tolist(), strict=True))
        finite = math.isfinite(values["loss"])
        if self.strategy.any(not finite):
            if finite:  # only another process found one (a non-finite loss or forward pass)
                self._fail(f"non-finite training loss or forward pass on another process at {where}", step)
            self._fail(f"non-finite training loss at {where}: {_describe(values, ELBO_PARTS)}", step)
        return values

    def _validate(self, totals: list[float], lr: float, started: float) -> dict[str, float] | None:
        """The epoch's history entry from the summed loss parts ``totals`` and the last step's rate ``lr``: the
        validation runs on the main process (``None`` on the others)."""
        is_main = self.strategy.is_main
        config = self.config
        probabilities, overflow = None, None
        if is_main:
            try:
                probabilities = evaluate(
                    self.evaluated, self.val, config.eval_samples, config.eval_batch_size, config.mc_dropout
                )
            except ValueError as error:
                if not _activations_overflowed(error, dataset_inputs(self.val)[0]):
                    raise
                overflow = error
        non_finite = overflow is not None or (probabilities is not None and not all_finite(probabilities))
        if self.strategy.any(non_finite):  # every process stops (one stopping alone would hang the others)
            if overflow is not None:
                self._fail(
                    f"non-finite values in the validation's forward pass after epoch {self.epoch} ({overflow})",
                    cause=overflow,
                )
            self._fail(f"non-finite validation predictions after epoch {self.epoch}")  # e.g. Monte Carlo samples
        if not is_main:
            return None
        val_accuracy, val_nll = validation_metrics(probabilities, self.val_labels)
        record = {"epoch": self.epoch, **{name: totals[i] / totals[-1] for i, name in enumerate(LOSS_PARTS)}}
        record.update(val_accuracy=val_accuracy, val_nll=val_nll, lr=lr, seconds=time.perf_counter() - started)
        self.result.history.append(record)
        return record

    def _patience_exhausted(self) -> bool:
        """Early stopping: ``config.patience`` epochs trained since the best one (decided by the main process, which
        holds the history; after a resume from the restored history, so that a resumed run stops where the
        uninterrupted one did)."""
        patience = self.config.patience
        if patience is None:
            return False
        history = self.result.history
        return self.strategy.any(bool(history) and history[-1]["epoch"] - self.result.best_epoch >= patience)

    def _select(self, record: dict[str, float]) -> bool:
        """Keep the epoch's state when its validation NLL is the lowest so far (ties keep the earlier epoch)."""
        improved = record["val_nll"] < self.result.best_val_nll
        if improved:
            self.result.best_epoch, self.result.best_val_nll = self.epoch, record["val_nll"]
            self.best_state = _state_copy(self.model)
        return improved

    def _checkpoint(self, improved: bool) -> None:
        """``last.pt`` (and ``best.pt`` when the epoch improved), committed together by the manifest."""
        if self.directory is None:
            return
        checkpoint = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "rng": rng_state(self.generator, self.device),
            "history": self.result.history,
            "best_epoch": self.result.best_epoch,
            "best_val_nll": self.result.best_val_nll,
            "config": self._settings(),
        }
        try:
            save_run_checkpoints(self.directory, checkpoint, checkpoint if improved else None)
        except OSError as error:  # a full disk, a folder that became unwritable: say what is still there
            reason = error.strerror or str(error)
            if self.epoch > 1:  # a resumed run's first epoch too: the pair it resumed from is still there
                kept = (
                    f"it still holds the checkpoints of epoch {self.epoch - 1}, the last complete pair; make room and "
                    "resume from it (resume=True, or --resume of gpattn train)"
                )
            else:
                kept = (
                    "it holds no checkpoint of this run, so there is nothing to resume; make room and train again "
                    "from the start (resume=False, or the same gpattn train command with --overwrite)"
                )
            raise OSError(
                error.errno,
                f"cannot write the checkpoints of epoch {self.epoch} to {self.directory} ({reason}); {kept}",
            ) from error

    def _settings(self) -> dict[str, Any]:
        """The run's settings as the checkpoints store them: the config, the torch thread count (the numbers on the
        CPU depend on it; a resumed run with another count is warned about), the numbers of training and validation
        examples ``num_data`` (the ELBO's :math:`n`) and ``num_val`` (a resumed run with another training or
        validation set size is refused) and the model's
        :func:`~gpattn.training.checkpoints.model_description` as built (a resumed run into a model of another
        configuration with the same parameter shapes, e.g. another number of heads, is refused)."""
        return {
            **self.config.to_dict(),
            "threads": torch.get_num_threads(),
            "num_data": self.num_data,
            "num_val": self.val_labels.shape[0],
            "model": self.model_description,
        }

    # -- divergence ---------------------------------------------------------------------------------------------------
    def _largest_parameter(self) -> Tensor:
        # the largest |parameter| entry (0-dim, on the device, in read_dtype; NaN propagates), from one fused max-norm
        # pass, not one per parameter
        if not self.parameters:
            return torch.zeros((), device=self.device, dtype=self.read_dtype)
        norms = torch._foreach_norm(self.parameters, math.inf)
        return torch.stack([norm.to(self.read_dtype) for norm in norms]).amax()

    def _fail(self, message: str, step: int | None = None, cause: BaseException | None = None) -> None:
        """Load the best state so far into the model (on every process: the strategy shares the main process's,
        which alone selects) and raise :class:`~gpattn.training.TrainingDivergedError`. Every process calls it at the
        same step: the divergence checks read values that agree across the processes."""
        self.result.best_epoch = self.strategy.share_best(self.best_state, self.result.best_epoch)
        self.model.load_state_dict(self.best_state)
        self.model.eval()
        if self.directory is None:
            kept = ""
        elif self.epoch > 1:
            kept = f"; {self.directory / 'last.pt'} still holds epoch {self.epoch - 1}, the last good one"
        else:
            kept = f"; no checkpoint of this run was written to {self.directory}"
        raise TrainingDivergedError(
            f"training diverged: {message}; the model now holds the state of epoch {self.result.best_epoch}{kept} "
            f"(lower the learning rate or clip the gradients)",
            self.epoch,
            step,
            self.result.best_epoch,
        ) from cause
