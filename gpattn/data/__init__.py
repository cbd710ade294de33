"""Data: toy regression sets drawn from an asymmetric generating process; toy directed sequence tasks; the 8x8
digits and MNIST-1D with held-out classes, shifts and noise OOD; CIFAR-10 / CIFAR-10-C loaders for local files."""

from .cifar import CIFAR10_C_CORRUPTIONS, CIFAR10_CLASSES, DataFileError, load_cifar10, load_cifar10_c
from .digits import (
    SHIFT_KINDS,
    SHIFT_PARAMETERS,
    ImageSplits,
    images_to_patches,
    load_digits_splits,
    make_noise_ood,
    make_shifted_test_sets,
    patches_to_images,
    shift_images,
)
from .image_dataset import ImageDataset
from .mnist1d import (
    MNIST1D_NOISE_FAMILIES,
    MNIST1D_SHIFT_KINDS,
    MNIST1D_SHIFT_PARAMETERS,
    MNIST1DSplits,
    load_mnist1d,
    make_mnist1d_noise_ood,
    make_mnist1d_shifted_test_sets,
    make_mnist1d_shuffled_test_set,
    make_mnist1d_signals,
    mnist1d_noise_families,
    signals_to_tokens,
)
from .toy_regression import RegressionData, make_asymmetric_regression_1d, make_asymmetric_regression_2d
from .toy_sequences import SequenceDataset, SequenceSplits, make_pointer_task, make_successor_task

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR10_C_CORRUPTIONS",
    "DataFileError",
    "ImageDataset",
    "ImageSplits",
    "MNIST1DSplits",
    "MNIST1D_NOISE_FAMILIES",
    "MNIST1D_SHIFT_KINDS",
    "MNIST1D_SHIFT_PARAMETERS",
    "RegressionData",
    "SHIFT_KINDS",
    "SHIFT_PARAMETERS",
    "SequenceDataset",
    "SequenceSplits",
    "images_to_patches",
    "load_cifar10",
    "load_cifar10_c",
    "load_digits_splits",
    "load_mnist1d",
    "make_asymmetric_regression_1d",
    "make_asymmetric_regression_2d",
    "make_mnist1d_noise_ood",
    "make_mnist1d_shifted_test_sets",
    "make_mnist1d_shuffled_test_set",
    "make_mnist1d_signals",
    "mnist1d_noise_families",
    "make_noise_ood",
    "make_pointer_task",
    "make_shifted_test_sets",
    "make_successor_task",
    "patches_to_images",
    "shift_images",
    "signals_to_tokens",
]
