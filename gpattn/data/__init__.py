"""Data: toy regression sets drawn from an asymmetric generating process; toy directed sequence tasks."""

from .toy_regression import RegressionData, make_asymmetric_regression_1d, make_asymmetric_regression_2d
from .toy_sequences import SequenceDataset, SequenceSplits, make_pointer_task, make_successor_task

__all__ = [
    "RegressionData",
    "SequenceDataset",
    "SequenceSplits",
    "make_asymmetric_regression_1d",
    "make_asymmetric_regression_2d",
    "make_pointer_task",
    "make_successor_task",
]
