"""Ensembles: independent members trained by the one training loop, with one seed rule.

**Seed rule.** Member :math:`k` (from 0) of an ensemble of :math:`K` members with seed :math:`s` is initialised and
trained with the seed :math:`sK + k` (:func:`member_seed`). A single model (:math:`K = 1`) keeps its seed :math:`s`,
and for non-negative seeds the members of the ensembles of different seeds never share a seed (seeds ``0, 1, 2``
with :math:`K = 2` train the members ``{0, 1}``, ``{2, 3}``, ``{4, 5}``), so that their spread over seeds is that of
independent ensembles. ``gpattn compare --ensemble K`` uses the same rule.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..validation import MAX_SEED, check_int
from .callbacks import Callback, check_callbacks
from .checkpoint_files import MANIFEST
from .config import TrainConfig, TrainResult
from .errors import CheckpointError
from .loop import train_model

__all__ = ["member_seed", "train_ensemble"]


def member_seed(seed: int, member: int, size: int) -> int:
    """The seed :math:`sK + k` of member ``member`` (:math:`k`) of an ensemble of ``size`` (:math:`K`) members with
    seed ``seed`` (:math:`s`); see the module docstring.

    :raises ValueError: Unless ``0 <= member < size``, or if :math:`sK + k` leaves the range of
        ``torch.manual_seed`` (:math:`-2^{63}` to :data:`~gpattn.validation.MAX_SEED`).
    """
    seed = check_int("seed", seed, minimum=None)
    size = check_int("size", size)
    member = check_int("member", member, minimum=0, maximum=size - 1)
    value = seed * size + member
    if not -(2**63) <= value <= MAX_SEED:
        raise ValueError(
            f"member {member} of an ensemble of {size} with seed {seed} would train with the seed seed * size + member "
            f"= {value}, outside torch.manual_seed's range [-2**63, 2**64 - 1]: ensembles of {size} take seeds "
            f"from {-(2**63 // size)} to {(MAX_SEED - size + 1) // size}"
        )
    return value


def train_ensemble(
    make_model: Callable[[int], torch.nn.Module],
    train: Any,
    val: Any,
    config: TrainConfig,
    size: int,
    resume: bool = False,
    *,
    callbacks: Iterable[Callback] = (),
) -> list[tuple[torch.nn.Module, TrainResult]]:
    """Train ``size`` independent members (Deep Ensembles with softmax attention, KEP-SVGP ensembles with
    ``"kep_svgp"``) with :func:`~gpattn.training.train_model`; average their predictions with
    :func:`~gpattn.training.ensemble_probabilities`.

    Member ``k`` is built by ``make_model(k)`` right after ``torch.manual_seed(member_seed(config.seed, k, size))``
    (so its initialisation is seeded too) and trained with that seed. With a ``checkpoint_dir``, member ``k`` writes
    its checkpoints to the subdirectory ``member_<k>`` (an ensemble of one, a single model, to ``checkpoint_dir``
    itself), and ``resume=True`` resumes every member from there (a member after the first that wrote no checkpoint,
    because the run was interrupted before it finished its first epoch, trains from the start, as it would have).

    :param make_model: Builds member ``k`` (on any device: it is moved to ``config.device``).
    :param train: Training set (as for :func:`~gpattn.training.train_model`).
    :param val: Validation set.
    :param config: The settings of every member (their seeds follow the rule above).
    :param size: Number of members :math:`K`.
    :param resume: Continue interrupted members from their ``last.pt``.
    :param callbacks: :class:`~gpattn.training.Callback` s told about every member's training, in member order.
    :return: ``[(model, result), ...]`` in member order.
    :raises TypeError: ``make_model`` returns something else than a ``torch.nn.Module`` (the message names the
        member), or ``callbacks`` is not a list of callbacks.
    :raises ValueError: ``make_model(k)`` returns an earlier member, or a model sharing parameters with one (e.g.
        ``lambda k: model``): the members would not be independent, each training on from the one before.
    :raises CheckpointError: As :func:`~gpattn.training.train_model`; resuming from the checkpoints of an ensemble of
        another size names the sizes.
    """
    check_int("size", size)
    callbacks = check_callbacks(callbacks, "train_ensemble")
    members = []
    earlier: dict[int, int] = {}  # id of every earlier member's parameter -> its member
    for k in range(size):
        directory = config.checkpoint_dir
        if directory is not None and size > 1:
            directory = Path(directory) / f"member_{k}"
        member_config = replace(config, seed=member_seed(config.seed, k, size), checkpoint_dir=directory)
        torch.manual_seed(member_config.seed)
        model = make_model(k)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"train_ensemble: expected make_model({k}) to return a torch.nn.Module (member {k}), got "
                f"{type(model).__name__}"
            )
        shared = next((earlier[id(p)] for p in model.parameters() if id(p) in earlier), None)
        if shared is not None:
            raise ValueError(
                f"train_ensemble: make_model({k}) returned a model sharing parameters with member {shared} (the same "
                "model?): the members must be independent; build a new model in make_model, e.g. "
                "make_model=lambda k: Transformer(...)"
            )
        earlier.update((id(p), k) for p in model.parameters())
        # a later member that wrote no checkpoint (the run was interrupted before it finished its first epoch) starts
        # from the beginning, as in the uninterrupted run, instead of failing for the want of a last.pt
        member_resume = resume and not (k > 0 and directory is not None and _not_started(Path(directory)))
        try:
            result = train_model(model, train, val, member_config, member_resume, callbacks=callbacks)
        except (CheckpointError, FileNotFoundError) as error:
            hint = _size_hint(config.checkpoint_dir, size) if resume else ""
            if not hint:
                raise
            raise type(error)(f"{error} ({hint})") from error
        members.append((model, result))
    return members


def _not_started(directory: Path) -> bool:
    """Whether a member's checkpoint folder holds no checkpoint, committed or not (no ``last.pt``, no manifest)."""
    return not (directory / "last.pt").exists() and not (directory / MANIFEST).exists()


def _size_hint(directory: str | os.PathLike | None, size: int) -> str:
    """When ``directory`` holds the checkpoints of an ensemble of another size than ``size``: which (else ``""``)."""
    if directory is None:
        return ""
    directory = Path(directory)
    members = [
        int(match.group(1))
        for path in (directory.glob("member_*") if directory.is_dir() else ())
        if (match := re.fullmatch(r"member_(\d+)", path.name)) and (path / "last.pt").is_file()
    ]
    if size > 1 and not members and (directory / "last.pt").is_file():
        return (
            f"{directory} holds the checkpoints of a single model, written by an ensemble of size 1, but size={size} "
            "now: resume with size=1"
        )
    if members and (size == 1 or max(members) >= size):
        least = max(max(members) + 1, 2)  # an ensemble of one writes no member folders
        return (
            f"{directory} holds the checkpoints of members up to member_{max(members)}, written by an ensemble of at "
            f"least {least} members, but size={size} now: resume with the size that wrote them"
        )
    return ""
