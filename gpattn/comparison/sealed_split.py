"""The tuner's view of a task: its training and validation splits, the test split sealed (:class:`SealedSplit`), so
that no trial of ``gpattn tune`` can read the test data."""

from __future__ import annotations

import dataclasses
from typing import Any

from .tasks import TaskData

__all__ = ["SealedSplit", "tuning_data"]


class SealedSplit:
    """The test split as the tuner holds it: any access (an attribute, its length, an item, iteration) raises
    ``RuntimeError``, so that no trial can read it.

    :param task: The task's name (for the message).
    """

    def __init__(self, task: str) -> None:
        object.__setattr__(self, "_task", task)

    def _refuse(self, *args: Any) -> None:
        raise RuntimeError(f"the tuner never reads the test split of {object.__getattribute__(self, '_task')!r}")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle protocol lookups
            raise AttributeError(name)
        self._refuse()

    __len__ = __iter__ = __getitem__ = __setattr__ = _refuse


def tuning_data(data: TaskData) -> TaskData:
    """``data`` as the tuner sees it: the training and validation splits only (the test split a
    :class:`SealedSplit`, no shifted or OOD sets)."""
    return dataclasses.replace(data, test=SealedSplit(data.name), shifted={}, ood={})
