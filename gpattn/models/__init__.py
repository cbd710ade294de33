"""Models built from the kernel-eigen strategies, Monte Carlo prediction, MC dropout and temperature scaling."""

from .kernel_eigen_pair_svgp import KernelEigenPairSVGP
from .monte_carlo import monte_carlo_logits
from .monte_carlo_dropout import DROPOUT_MODULES, dropout_modules, mc_dropout
from .prediction import predict_probabilities
from .presets import VIT_CIFAR_PRESET
from .temperature_scaling import TemperatureScaling, fit_temperature
from .transformer import Transformer

__all__ = [
    "DROPOUT_MODULES",
    "VIT_CIFAR_PRESET",
    "KernelEigenPairSVGP",
    "TemperatureScaling",
    "Transformer",
    "dropout_modules",
    "fit_temperature",
    "mc_dropout",
    "monte_carlo_logits",
    "predict_probabilities",
]
