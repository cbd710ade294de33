"""The settings of the training loop (:class:`TrainConfig`) and what it returns (:class:`TrainResult`)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..validation import MAX_SEED, check_bool, check_device, check_float, check_int

__all__ = ["DEVICE_TYPES", "TrainConfig", "TrainResult"]

#: The device types the loop runs on.
DEVICE_TYPES = ("cpu", "cuda")


@dataclass
class TrainConfig:
    """Settings of :func:`~gpattn.training.train_model` (validated on construction: a bad value raises ``ValueError``;
    NumPy numbers are stored as Python ``int`` and ``float``, so that the checkpoints hold plain values).

    :ivar epochs: Epochs to train (in total, counting those of a resumed run).
    :ivar batch_size: Training minibatch size (the last batch of an epoch may be smaller); per process in
        data-parallel training.
    :ivar lr: Peak learning rate of AdamW (reached at the end of the warm-up).
    :ivar weight_decay: AdamW's decoupled weight decay.
    :ivar warmup_epochs: Length of the linear warm-up in epochs (may be fractional): ``round(warmup_epochs *
        steps_per_epoch)`` optimiser steps, Python's rounding (to the nearest, halves to even: 0.5 epoch of one step
        is no warm-up; the KL annealing below rounds up instead).
    :ivar warmup_steps: Length of the warm-up in optimiser steps; overrides ``warmup_epochs`` when set.
    :ivar min_lr: Learning rate at the end of the cosine decay (``0 <= min_lr <= lr``).
    :ivar grad_clip: Maximum global gradient norm, or ``None`` for no clipping.
    :ivar beta: KL weight :math:`\\beta` of :class:`~gpattn.mlls.AttentionELBO`.
    :ivar kl_anneal_epochs: KL annealing: the weight rises linearly from :math:`\\beta / A` to :math:`\\beta` over the
        first :math:`A` optimiser steps (``kl_anneal_epochs`` epochs, may be fractional, rounded up),
        :math:`\\beta_t = \\beta \\min(1, (t + 1) / A)` at global step :math:`t`; ``0`` (default) for none. SGPA's
        official recipe anneals its KL from 0 to 1 (docs/guide/papers.md); the validation NLL that selects the model
        does not depend on it.
    :ivar eval_samples: Monte Carlo samples :math:`T` of the validation predictions.
    :ivar eval_batch_size: Batch size of the validation predictions.
    :ivar mc_dropout: Validation predictions with dropout on (the MC-dropout predictive over ``eval_samples`` passes,
        :func:`~gpattn.training.evaluate`), so that a model used with MC dropout at test time is selected, stopped
        early and tuned on the predictive it is used with; ``False`` (default): eval mode, dropout off.
    :ivar seed: Seed of the global torch RNG and of the batch order.
    :ivar device: ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"`` (available on this machine).
    :ivar cuda_graphs: Capture the forward and backward passes of the full-size training steps as one CUDA graph and
        replay it (:class:`~gpattn.training.graphs.CapturedStep`): a CUDA device, one process, and every attention layer
        of the model :attr:`~gpattn.attention.AttentionLayer.supports_graph_capture`; the last, smaller batch of an
        epoch runs eagerly. The validation's Monte Carlo passes are replayed from CUDA graphs too
        (:class:`~gpattn.training.graphs.CapturedForward`, one per batch shape). The run is reproducible, but its
        random draws are not the eager run's.
    :ivar progress: Show a tqdm bar per epoch (only on a terminal).
    :ivar checkpoint_dir: Directory of ``best.pt`` and ``last.pt`` (created if missing), or ``None`` (in memory).
    :ivar schedule_epochs: Horizon of the cosine schedule in epochs (default ``epochs``). Set it to the planned total
        when a run is deliberately split into stages (``epochs=2`` now, ``epochs=4, resume=True`` later), so that
        the staged run follows the same schedule as an uninterrupted one. A horizon below ``epochs`` needs ``min_lr >
        0``: the epochs past it train at the constant rate ``min_lr`` (e.g. to extend a finished run, resumed with
        its ``schedule_epochs``); with ``min_lr=0`` they would train at rate 0, and the config refuses it.
    :ivar patience: Early stopping on the validation NLL: training stops once ``patience`` epochs have passed without
        a lower validation NLL than the best one (epoch :math:`e` is the last when :math:`e - e^\\star \\ge`
        ``patience``, :math:`e^\\star` the best epoch), and the model keeps the best state as always; ``None``
        (default) trains all ``epochs``. The cosine schedule still spans ``epochs`` (or ``schedule_epochs``), so a
        run that stops early equals the first epochs of the full one, and a resumed run stops where the
        uninterrupted one did.
    """

    epochs: int = 10
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_epochs: float = 1.0
    warmup_steps: int | None = None
    min_lr: float = 0.0
    grad_clip: float | None = 1.0
    beta: float = 1.0
    kl_anneal_epochs: float = 0.0
    eval_samples: int = 10
    eval_batch_size: int = 256
    mc_dropout: bool = False
    seed: int = 0
    device: str = "cpu"
    cuda_graphs: bool = False
    progress: bool = True
    checkpoint_dir: str | Path | None = None
    schedule_epochs: int | None = None
    patience: int | None = None

    def __post_init__(self) -> None:
        # every numeric setting is stored as a plain Python int or float (a NumPy scalar or a 0-dim tensor is
        # converted), so that to_dict() and the checkpoints hold plain values only (torch.load(weights_only=True)
        # reads no NumPy scalar, and the content checksum takes none)
        where = "TrainConfig"
        for name in ("epochs", "batch_size", "eval_samples", "eval_batch_size"):
            setattr(self, name, check_int(name, getattr(self, name), where=where))
        for name in ("warmup_steps", "schedule_epochs", "patience"):
            if getattr(self, name) is not None:
                minimum = 0 if name == "warmup_steps" else 1
                setattr(self, name, check_int(name, getattr(self, name), minimum=minimum, where=where))
        # torch.manual_seed's range
        self.seed = check_int("seed", self.seed, minimum=-(2**63), maximum=MAX_SEED, where=where)
        self.lr = check_float("lr", self.lr, 0.0, strict_minimum=True, where=where)
        self.min_lr = check_float("min_lr", self.min_lr, 0.0, self.lr, where=where)
        for name in ("weight_decay", "warmup_epochs", "beta", "kl_anneal_epochs"):
            setattr(self, name, check_float(name, getattr(self, name), 0.0, where=where))
        if self.grad_clip is not None:
            self.grad_clip = check_float("grad_clip", self.grad_clip, 0.0, strict_minimum=True, where=where)
        device = check_device("device", self.device, where=where, types=DEVICE_TYPES)
        if type(self.device) is not str:  # a torch.device or a str subclass (numpy.str_): a plain string
            self.device = str(self.device) if isinstance(self.device, str) else str(device)
        for name in ("progress", "mc_dropout", "cuda_graphs"):  # NumPy's bools as Python's (the config's JSON)
            setattr(self, name, check_bool(name, getattr(self, name), where=where))
        if self.checkpoint_dir is not None and not isinstance(self.checkpoint_dir, (str, os.PathLike)):
            raise ValueError(f"{where}: expected checkpoint_dir to be a path or None, got {self.checkpoint_dir!r}")
        if self.checkpoint_dir is not None and os.fspath(self.checkpoint_dir) == "":
            # Path("") is the current directory: best.pt and last.pt would land wherever the run was started
            raise ValueError(
                f"{where}: expected checkpoint_dir to be a folder or None, got the empty string (use '.' for the "
                "current directory)"
            )
        if self.checkpoint_dir is not None and Path(self.checkpoint_dir).exists():
            if not Path(self.checkpoint_dir).is_dir():
                raise ValueError(
                    f"{where}: expected checkpoint_dir to be a folder (created if missing), got the existing file "
                    f"{str(self.checkpoint_dir)!r}"
                )
        if self.schedule_epochs is not None and self.schedule_epochs < self.epochs and self.min_lr == 0:
            raise ValueError(
                f"{where}: schedule_epochs={self.schedule_epochs} is below epochs={self.epochs} with min_lr=0: the "
                f"cosine schedule reaches learning rate 0 at the end of epoch {self.schedule_epochs} and stays there, "
                f"so epochs {self.schedule_epochs + 1}..{self.epochs} would not change the model; set schedule_epochs "
                "to at least epochs (or None: epochs), or min_lr > 0 to train the epochs past the horizon at that floor"
            )

    @property
    def horizon_epochs(self) -> int:
        """Epochs of the cosine schedule: ``schedule_epochs`` or ``epochs``."""
        return self.epochs if self.schedule_epochs is None else self.schedule_epochs

    def schedule_steps(self, steps_per_epoch: int) -> tuple[int, int]:
        """``(total_steps, warmup_steps)`` of the schedule for ``steps_per_epoch`` optimiser steps per epoch."""
        total = self.horizon_epochs * steps_per_epoch
        warmup = self.warmup_steps if self.warmup_steps is not None else round(self.warmup_epochs * steps_per_epoch)
        return total, min(warmup, total)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (``checkpoint_dir`` as a string), as stored in the checkpoints."""
        values = asdict(self)
        values["checkpoint_dir"] = None if self.checkpoint_dir is None else str(self.checkpoint_dir)
        return values


@dataclass
class TrainResult:
    """What :func:`~gpattn.training.train_model` returns.

    :ivar history: One dict per epoch: ``epoch`` (from 1), the training loss parts averaged over the epoch's
        sequences ``loss``, ``nll``, ``kl``, ``ksvd``, ``prior`` (weighted as in :class:`~gpattn.mlls.AttentionELBO`,
        ``loss`` their sum; ``prior`` 0 without hyperparameter priors, absent from the epochs of checkpoints written
        before it was recorded), the pre-clipping gradient norm ``grad_norm`` averaged the same way (each step's
        weighted by its batch size), ``val_accuracy``, ``val_nll``, the learning rate of the epoch's last step ``lr``
        and the wall time ``seconds``.
    :ivar best_epoch: Epoch of the lowest validation NLL (its state is the model's after training).
    :ivar best_val_nll: That NLL.
    """

    history: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int = 0
    best_val_nll: float = math.inf
