"""The comparison's endpoints, declared before any run (issue 23's protocol): the primary endpoint, the family of
secondary endpoints whose p-values are Holm-adjusted together, and the differences reported without a test.

An :class:`Endpoint` is one paired difference ``reference - other`` of one metric on one task; its per-seed values
come from the flat rows of the records (:func:`~gpattn.comparison.table_rows.flat_rows`), so that the headline and
the tables read the same numbers.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from typing import Any

from .table_rows import ensemble_row, group_rows, pooled_ood_set, seed_values

__all__ = [
    "DECLARED_ECE_BINS",
    "DECLARED_OOD_SCORE",
    "DECLARED_PRIMARY_SEEDS",
    "DESCRIPTIVE_ENDPOINTS",
    "PRIMARY_ENDPOINT",
    "SECONDARY_ENDPOINTS",
    "Endpoint",
    "declaration_text",
]

#: The ``column`` of an endpoint on each row's declared OOD score (:meth:`Endpoint.seed_values`).
DECLARED_OOD_SCORE = "ood_declared_auroc"
#: The seeds the primary endpoint is declared on (``gpattn compare --full`` runs the primary pair with seeds 0-9).
DECLARED_PRIMARY_SEEDS = 10
#: The equal-width bins the ECE endpoint is declared on (``gpattn compare``'s default ``--ece-bins``).
DECLARED_ECE_BINS = 15


@dataclass(frozen=True)
class Endpoint:
    """A declared paired difference: ``reference - other`` of the metric ``column`` on ``task``, paired by seed.

    :ivar label: What it measures, in words (``"test NLL"``).
    :ivar column: The flat-row column (:func:`~gpattn.comparison.table_rows.flat_rows`), e.g. ``"test_nll"``, or
        :data:`DECLARED_OOD_SCORE`: the AUROC on the task's pooled OOD set of each row's score declared before the
        run by its kind, never chosen on the OOD data: the mutual information for a stochastic row (its Monte Carlo
        predictions vary: the mutual information is recorded for every seed that has a maximum-probability AUROC),
        the maximum probability for a deterministic row.
    :ivar reference: The reference row (``"kep_svgp+ts"``).
    :ivar other: The row it is compared with (``"softmax+ts"``).
    :ivar task: The task.
    :ivar percent: Shown in percentage points (rates), else in the metric's own unit.
    :ivar higher_is_better: Whether a positive difference favours the reference.
    :ivar unit: The unit of a shown difference (``"nats"``, ``"points"``).

    Example:
        >>> from gpattn.comparison.endpoints import PRIMARY_ENDPOINT
        >>> PRIMARY_ENDPOINT.describe()
        'test NLL of kep_svgp+ts minus softmax+ts on mnist1d'
        >>> PRIMARY_ENDPOINT.on_task("digits").describe()
        'test NLL of kep_svgp+ts minus softmax+ts on digits'
    """

    label: str
    column: str
    reference: str
    other: str
    task: str = "mnist1d"
    percent: bool = False
    higher_is_better: bool = False
    unit: str = ""

    def describe(self) -> str:
        """``"<label> of <reference> minus <other> on <task>"``."""
        return f"{self.label} of {self.reference} minus {self.other} on {self.task}"

    def on_task(self, task: str) -> Endpoint:
        """The same difference on another task (descriptive: the declared endpoints are on their own task)."""
        return dataclasses.replace(self, task=task)

    def measured_as(self, ensemble: int = 1, ece_bins: int = DECLARED_ECE_BINS) -> Endpoint:
        """The same difference as a grid of other settings measures it: between the ensembles of ``ensemble``
        members of its rows (``gpattn compare --ensemble K`` records ``kep_svgp_ens<K>+ts``), and for the ECE on
        ``ece_bins`` bins, labelled so (``"ECE (5 bins)"``); the endpoint itself for the declared settings. O(1).

        Example:
            >>> from gpattn.comparison.endpoints import PRIMARY_ENDPOINT
            >>> PRIMARY_ENDPOINT.measured_as(ensemble=2).describe()
            'test NLL of kep_svgp_ens2+ts minus softmax_ens2+ts on mnist1d'
        """
        label = f"ECE ({ece_bins} bins)" if self.column == "test_ece" else self.label
        reference, other = (ensemble_row(row, ensemble) for row in (self.reference, self.other))
        return dataclasses.replace(self, label=label, reference=reference, other=other)

    def scale(self) -> float:
        """100 for a rate shown in percentage points, else 1."""
        return 100.0 if self.percent else 1.0

    def seed_values(self, rows: list[dict[str, Any]]) -> tuple[dict[int, float], dict[int, float], str]:
        """The per-seed values of the reference and the other row on the endpoint's task, and a note on how they
        were read (for :data:`DECLARED_OOD_SCORE`: which set and which score each row uses; else ``""``).

        :param rows: Flat rows of the records (:func:`~gpattn.comparison.table_rows.flat_rows`).
        :return: ``({seed: value} of the reference, {seed: value} of the other row, note)``; empty mappings for a
            row that is not in the rows.
        """
        groups = group_rows(rows)
        reference = groups.get((self.task, self.reference), [])
        other = groups.get((self.task, self.other), [])
        if self.column != DECLARED_OOD_SCORE:
            return seed_values(reference, self.column), seed_values(other, self.column), ""
        ood_set = pooled_ood_set([row for (task, _), group in groups.items() if task == self.task for row in group])
        if ood_set is None:
            return {}, {}, "no pooled OOD set"
        chosen = [_declared_score(group, ood_set) for group in (reference, other)]
        note = f"{ood_set} OOD set; " + ", ".join(
            f"{name}: {score}" for name, (_, score) in zip((self.reference, self.other), chosen, strict=True)
        )
        return chosen[0][0], chosen[1][0], note


def _declared_score(group: list[dict[str, Any]], ood_set: str) -> tuple[dict[int, float], str]:
    # by the row's kind, not by the AUROCs: the mutual information when every seed with a score recorded it (a
    # stochastic row; a failed seed has neither score), else the maximum probability (a deterministic row has no
    # mutual information). The seeds themselves are compared, not their counts: a row with the mutual information on
    # every seed is read by it even where the maximum probability is undefined on one
    maximum = seed_values(group, f"ood_{ood_set}_auroc")
    information = seed_values(group, f"ood_{ood_set}_auroc_mi")
    if information and set(maximum) <= set(information):
        return information, "mutual information"
    return maximum, "max probability"


_PAIR = ("kep_svgp+ts", "softmax+ts")

#: The primary endpoint: does GP attention add anything once both models are calibrated?
PRIMARY_ENDPOINT = Endpoint("test NLL", "test_nll", *_PAIR, unit="nats")

#: The secondary endpoints, one family for Holm's adjustment (issue 23's list: the untempered NLL, then the primary
#: pair's accuracy, ECE, shift NLL, shift ECE and OOD AUROC).
SECONDARY_ENDPOINTS = (
    Endpoint("test NLL, untempered", "test_nll", "kep_svgp", "softmax", unit="nats"),
    Endpoint("accuracy", "test_accuracy", *_PAIR, percent=True, higher_is_better=True, unit="points"),
    Endpoint(f"ECE ({DECLARED_ECE_BINS} bins)", "test_ece", *_PAIR, percent=True, unit="points"),
    Endpoint("shift NLL", "shift_nll", *_PAIR, unit="nats"),
    Endpoint("shift ECE", "shift_ece", *_PAIR, percent=True, unit="points"),
    Endpoint("OOD AUROC", DECLARED_OOD_SCORE, *_PAIR, percent=True, higher_is_better=True, unit="points"),
)

#: Differences of the primary pair reported beside the tests, without a p-value (not in the Holm family).
DESCRIPTIVE_ENDPOINTS = (
    Endpoint("shift Brier", "shift_brier", *_PAIR, percent=True, unit="points"),
    Endpoint("debiased calibration error", "test_debiased_ce", *_PAIR, percent=True, unit="points"),
    Endpoint("confidence - accuracy", "test_gap", *_PAIR, percent=True, unit="points"),
)


def declaration_text() -> str:
    """The declared endpoints in words (markdown paragraphs wrapped at 120 characters), as ``table.md`` and the
    results page state them before any number."""
    primary = PRIMARY_ENDPOINT
    secondaries = "; ".join(
        f"{endpoint.label} ({endpoint.reference} − {endpoint.other})" for endpoint in SECONDARY_ENDPOINTS
    )
    paragraphs = [
        f"**Primary endpoint** (declared before the run): the {primary.label} of {primary.reference} minus "
        f"{primary.other} on clean {primary.task} test data, in {primary.unit} (like for like: does GP attention add "
        f"anything once both models are calibrated?); negative favours {primary.reference}. Estimated with its 95 % "
        "paired-t interval over the seeds and a 95 % seeds-and-examples bootstrap interval (the test examples "
        "resampled too). The protocol runs the primary pair with 10 seeds and every other row with 5.",
        f"**Secondary endpoints**, on {primary.task}, each a paired-t test over the seeds with its p-value "
        f"Holm-adjusted over the family of {len(SECONDARY_ENDPOINTS)}: {secondaries}. The OOD AUROC is on the pooled "
        "OOD set, with each row's score declared by its kind: the mutual information of the Monte Carlo "
        "predictions for a stochastic row, the maximum probability for a deterministic row (never chosen on the OOD "
        "data).",
        "**Verdict rule**: a difference is stated when every interval of the primary endpoint excludes 0 on the same "
        "side; otherwise no difference is detected, and the hull of the intervals bounds the differences the run "
        "excludes. A secondary difference is stated when its Holm-adjusted p-value is at most 0.05.",
    ]
    return "\n\n".join(textwrap.fill(paragraph, 120, break_on_hyphens=False) for paragraph in paragraphs)
