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
from .ood import ood_aupr, ood_auroc, ood_fpr_at_95_tpr
from .selective import aurc, eaurc, fpr_at_95_tpr, misclassification_auroc

__all__ = [
    "ReliabilityDiagram",
    "accuracy",
    "aurc",
    "brier_score",
    "eaurc",
    "expected_calibration_error",
    "fpr_at_95_tpr",
    "maximum_calibration_error",
    "misclassification_auroc",
    "negative_log_likelihood",
    "ood_aupr",
    "ood_auroc",
    "ood_fpr_at_95_tpr",
    "reliability_diagram_data",
]
