"""Classification metrics: calibration, selective classification and out-of-distribution detection."""

from .calibration import (
    ReliabilityDiagram,
    accuracy,
    brier_score,
    expected_calibration_error,
    maximum_calibration_error,
    negative_log_likelihood,
    reliability_diagram_data,
)
from .calibration_estimators import debiased_calibration_error, sweep_calibration_error
from .ood import ood_aupr, ood_auroc, ood_fpr_at_95_tpr
from .selective import aurc, eaurc, fpr_at_95_tpr, misclassification_auroc
from .uncertainty import expected_entropy, mutual_information, ood_auroc_mutual_information, predictive_entropy

__all__ = [
    "ReliabilityDiagram",
    "accuracy",
    "aurc",
    "brier_score",
    "debiased_calibration_error",
    "eaurc",
    "expected_entropy",
    "expected_calibration_error",
    "fpr_at_95_tpr",
    "maximum_calibration_error",
    "misclassification_auroc",
    "mutual_information",
    "negative_log_likelihood",
    "ood_aupr",
    "ood_auroc_mutual_information",
    "ood_auroc",
    "ood_fpr_at_95_tpr",
    "predictive_entropy",
    "reliability_diagram_data",
    "sweep_calibration_error",
]
