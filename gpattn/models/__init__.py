"""Models built from the kernel-eigen strategies, Monte Carlo prediction, MC dropout, temperature scaling and a
last-layer Laplace approximation."""

from .kernel_eigen_pair_svgp import KernelEigenPairSVGP
from .last_layer_laplace import LastLayerLaplace
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
    "LastLayerLaplace",
    "TemperatureScaling",
    "Transformer",
    "dropout_modules",
    "fit_temperature",
    "mc_dropout",
    "monte_carlo_logits",
    "predict_probabilities",
]
