"""Training: the one loop that single-process, ensemble and data-parallel training share (:func:`train_model`, with
:class:`Callback` s), its settings and result, checkpoints and resume, the learning-rate schedule, ensembles and the
data-parallel strategy (:mod:`gpattn.training.distributed`), and the predictions the loop validates with.

This package depends on the models and metrics only; the comparison (:mod:`gpattn.comparison`) builds on it.
"""

from .batches import batch_to_device, dataset_inputs, dataset_labels
from .callbacks import Callback, CallbackList, TrainingContext
from .checkpoints import CHECKPOINT_KEYS, load_checkpoint
from .config import TrainConfig, TrainResult
from .ensembles import member_seed, train_ensemble
from .errors import CheckpointError, NonFiniteLossError, TrainingDivergedError
from .loop import train_model
from .predictions import ensemble_probabilities, evaluate, validation_metrics
from .progress import EpochLog, ProgressBar
from .schedule import warmup_cosine_lr, warmup_cosine_schedule
from .strategy import TrainingStrategy

__all__ = [
    "CHECKPOINT_KEYS",
    "Callback",
    "CallbackList",
    "CheckpointError",
    "EpochLog",
    "NonFiniteLossError",
    "ProgressBar",
    "TrainConfig",
    "TrainResult",
    "TrainingContext",
    "TrainingDivergedError",
    "TrainingStrategy",
    "batch_to_device",
    "dataset_inputs",
    "dataset_labels",
    "ensemble_probabilities",
    "evaluate",
    "load_checkpoint",
    "member_seed",
    "train_ensemble",
    "train_model",
    "validation_metrics",
    "warmup_cosine_lr",
    "warmup_cosine_schedule",
    "DataParallelStrategy",
    "parameter_checksum",
    "shard_indices",
    "train_distributed",
]

#: Names of :mod:`gpattn.training.distributed`, imported on first use so that
#: ``torchrun ... -m gpattn.training.distributed`` does not find that module already loaded.
_DISTRIBUTED = ("DataParallelStrategy", "parameter_checksum", "shard_indices", "train_distributed")


def __getattr__(name: str):
    if name in _DISTRIBUTED:
        from . import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
