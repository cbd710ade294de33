"""The headline of a comparison: the declared endpoints (:mod:`gpattn.comparison.endpoints`) estimated from the
records, the primary endpoint's verdict by the declared rule, and the secondaries with Holm-adjusted p-values
(:func:`headline_text`, the top of ``table.md`` and of the results page).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal

from .config import MAIN_SEEDS
from .endpoints import (
    DECLARED_ECE_BINS,
    DECLARED_PRIMARY_SEEDS,
    DESCRIPTIVE_ENDPOINTS,
    PRIMARY_ENDPOINT,
    SECONDARY_ENDPOINTS,
    Endpoint,
    declaration_text,
)
from .records import RunRecord
from .statistics import (
    PairedDifference,
    hierarchical_difference,
    holm_adjusted,
    paired_difference,
    paired_p_value,
    scaled_mean,
)
from .table_rows import (
    check_one_run_per_seed,
    flat_rows,
    group_rows,
    markdown_cell,
    missing_reason,
    split_ensemble_row,
    with_temperature_scaled,
)

__all__ = [
    "FAMILY_WISE_LEVEL",
    "MIN_SEEDS_FOR_INTERVALS",
    "EndpointEstimate",
    "ensemble_size",
    "estimate_endpoint",
    "estimate_secondaries",
    "headline_text",
    "measured_endpoints",
    "verdict",
]

#: Fewest paired seeds from which the report forms an interval, and tests: the paired-t interval and the paired-t
#: test are one inference, so below it an estimate has neither (no p-value, no Holm-adjusted p, no verdict).
MIN_SEEDS_FOR_INTERVALS = 5
#: The family-wise error rate at which a secondary difference is stated.
FAMILY_WISE_LEVEL = 0.05
#: Flat-row columns with per-example values (``RunRecord.per_example``) for the seeds-and-examples interval.
PER_EXAMPLE = {"test_nll": "test_nll"}


@dataclass(frozen=True)
class EndpointEstimate:
    """An :class:`~gpattn.comparison.endpoints.Endpoint` estimated from a comparison's records.

    :ivar endpoint: The endpoint.
    :ivar mean: The mean paired difference ``reference - other`` (NaN without paired seeds).
    :ivar n: Paired seeds.
    :ivar t: The 95 % paired-t interval, or ``None`` (fewer than :data:`MIN_SEEDS_FOR_INTERVALS` paired seeds).
    :ivar hierarchical: The 95 % seeds-and-examples bootstrap interval
        (:func:`~gpattn.comparison.hierarchical_difference`) where the records hold per-example values, else ``None``.
    :ivar examples: Test examples per seed of ``hierarchical`` (0 without it).
    :ivar p_value: The paired-t test's two-sided p-value (NaN: no test, also below :data:`MIN_SEEDS_FOR_INTERVALS`
        paired seeds, where there is no interval either).
    :ivar holm: The Holm-adjusted p-value within the secondary family (NaN: not in it, or no test).
    :ivar note: How the values were read (e.g. the OOD scores used), ``""`` if nothing to say.
    :ivar missing: Why there is no interval (no estimate at all where ``n`` is 0), ``""`` when there is one.
    :ivar seeds: The paired seeds, in the reference's order.
    :ivar left_out: The seeds one of the two rows ran on the task that the pairing leaves out (the metric not finite
        there, or no run of the other row), sorted; ``note`` says why.
    """

    endpoint: Endpoint
    mean: float
    n: int
    t: PairedDifference | None = None
    hierarchical: PairedDifference | None = None
    examples: int = 0
    p_value: float = math.nan
    holm: float = math.nan
    note: str = ""
    missing: str = ""
    seeds: tuple[int, ...] = ()
    left_out: tuple[int, ...] = ()

    def intervals(self) -> list[PairedDifference]:
        """The intervals there are: the paired t, then the seeds-and-examples one."""
        return [interval for interval in (self.t, self.hierarchical) if interval is not None]


def _per_example(records: list[RunRecord], task: str, row: str, key: str) -> dict[int, list[float]]:
    return {
        record.seed: record.per_example[key]
        for record in records
        if record.task == task and record.attention == row and record.per_example.get(key)
    }


def _missing(rows: list[dict], endpoint: Endpoint, values: tuple[dict, dict], note: str) -> str:
    # a row without runs on the task; else the note of the values' reading (no pooled OOD set); else each row's reason
    groups = group_rows(rows)
    pair = (endpoint.reference, endpoint.other)
    absent = [f"no {row} runs on {endpoint.task}" for row in pair if (endpoint.task, row) not in groups]
    if absent or note:
        return "; ".join(absent) or note
    return "; ".join(
        dict.fromkeys(
            f"{row}: {missing_reason(groups[(endpoint.task, row)], endpoint.column)}"
            for row, found in zip(pair, values, strict=True)
            if not found
        )
    )


def _seed_list(values: dict[int, float]) -> str:
    return ", ".join(map(str, sorted(values)))


def _left_out(rows: list[dict], endpoint: Endpoint, values: tuple[dict, dict]) -> tuple[str, tuple[int, ...]]:
    # the seeds a row ran on the task that the pairing drops, and why: a metric that is not finite there (a failed or
    # undefined run: dropping it is not counting it as a loss, hence said), or a seed the other row has no run of
    groups = group_rows(rows)
    pair = (endpoint.reference, endpoint.other)
    ran = [dict.fromkeys(row["seed"] for row in groups.get((endpoint.task, name), [])) for name in pair]
    reasons, dropped = [], set()
    for name, seeds, found in zip(pair, ran, values, strict=True):
        undefined = [seed for seed in seeds if seed not in found]
        if undefined:
            reasons.append(f"{_seed_list(undefined)} (no finite {endpoint.label} of {name})")
            dropped.update(undefined)
    for name, other, other_ran, found in zip(pair, pair[::-1], ran[::-1], values, strict=True):
        unmatched = [seed for seed in found if seed not in other_ran and seed not in dropped]
        if unmatched:
            reasons.append(f"{_seed_list(unmatched)} (of {name}: no {other} run)")
            dropped.update(unmatched)
    if not reasons:
        return "", ()
    return f"seeds left out of the pairing: {'; '.join(reasons)}", tuple(sorted(dropped))


def estimate_endpoint(
    records: list[RunRecord], endpoint: Endpoint, *, hierarchical: bool = True, num_resamples: int = 10000
) -> EndpointEstimate:
    """The endpoint's paired difference over seeds with its 95 % paired-t interval and p-value and, where the records
    hold per-example values of the metric and ``hierarchical``, the 95 % seeds-and-examples interval. Below
    :data:`MIN_SEEDS_FOR_INTERVALS` paired seeds: the mean difference only (no interval and no p-value: the test is
    the interval's inference). The pairing takes the seeds where both rows ran with a finite value; the seeds it
    leaves out (a value that is not finite, e.g. a failed run, which is then not counted as a loss; a seed the other
    row did not run) are named in ``note`` and ``left_out``.

    .. note:: Cost: O(seeds) for the t interval; O(``num_resamples`` seeds examples) for the bootstrap.

    :param records: The comparison's records (the ``+ts`` variants inside them are rows of their own).
    :param endpoint: The endpoint.
    :param hierarchical: Form the seeds-and-examples interval where possible.
    :param num_resamples: Resamples of that interval (seed 0: the same records give the same interval).
    :raises ValueError: A row of the endpoint with more than one run of a seed on its task.
    """
    expanded = with_temperature_scaled(records)
    rows = flat_rows(records)
    # {seed: value} would keep the last of two runs of one seed: the endpoint's two rows on its task checked
    pair = (endpoint.reference, endpoint.other)
    check_one_run_per_seed(
        [row for row in rows if row["task"] == endpoint.task and row["attention"] in pair], "estimate_endpoint"
    )
    reference, other, note = endpoint.seed_values(rows)
    seeds = [seed for seed in reference if seed in other]
    if not reference or not other:
        return EndpointEstimate(endpoint, math.nan, 0, missing=_missing(rows, endpoint, (reference, other), note))
    mean = scaled_mean([reference[seed] - other[seed] for seed in seeds]) if seeds else math.nan
    if not seeds:  # both rows ran, on other seeds: nothing to pair
        reason = (
            f"{endpoint.reference} and {endpoint.other} share no seed on {endpoint.task} (seeds "
            f"{_seed_list(reference)} and {_seed_list(other)}): nothing to pair"
        )
        return EndpointEstimate(endpoint, mean, 0, note=note, missing=reason)
    dropped, left_out = _left_out(rows, endpoint, (reference, other))
    note = "; ".join(text for text in (note, dropped) if text)
    if len(seeds) < MIN_SEEDS_FOR_INTERVALS:  # no interval, hence no test (p stays NaN)
        reason = f"{len(seeds)} paired seed(s), fewer than {MIN_SEEDS_FOR_INTERVALS}: no interval"
        return EndpointEstimate(
            endpoint, mean, len(seeds), note=note, missing=reason, seeds=tuple(seeds), left_out=left_out
        )
    p_value = paired_p_value(reference, other)
    interval = paired_difference(reference, other, min_pairs=MIN_SEEDS_FOR_INTERVALS)
    bootstrap, examples = None, 0
    key = PER_EXAMPLE.get(endpoint.column)
    if hierarchical and key is not None:
        left = _per_example(expanded, endpoint.task, endpoint.reference, key)
        right = _per_example(expanded, endpoint.task, endpoint.other, key)
        if all(seed in left and seed in right for seed in seeds):
            left, right = {seed: left[seed] for seed in seeds}, {seed: right[seed] for seed in seeds}
            bootstrap = hierarchical_difference(left, right, num_resamples=num_resamples)
            examples = len(left[seeds[0]])
        else:
            note = (
                note + "; " if note else ""
            ) + "no per-example values in these records: no seeds-and-examples interval"
    return EndpointEstimate(
        endpoint,
        mean,
        len(seeds),
        interval,
        bootstrap,
        examples,
        p_value,
        note=note,
        seeds=tuple(seeds),
        left_out=left_out,
    )


def ensemble_size(records: list[RunRecord]) -> int:
    """The members per model of the primary pair's rows in ``records``: 1 for single models (or no such rows), ``K``
    for the ensembles ``kep_svgp_ens<K>`` / ``softmax_ens<K>`` of ``gpattn compare --ensemble K`` (the smallest ``K``
    when the records hold several, and 1 when they hold single models too). O(records)."""
    pair = {row.removesuffix("+ts") for row in (PRIMARY_ENDPOINT.reference, PRIMARY_ENDPOINT.other)}
    sizes = {size for row, size in map(split_ensemble_row, (r.attention for r in records)) if row in pair}
    return 1 if not sizes or 1 in sizes else min(sizes)


def measured_endpoints(
    records: list[RunRecord], ece_bins: int = DECLARED_ECE_BINS
) -> tuple[Endpoint, tuple[Endpoint, ...], tuple[Endpoint, ...]]:
    """The primary, secondary and descriptive endpoints as ``records`` measure them
    (:meth:`~gpattn.comparison.endpoints.Endpoint.measured_as`): on the ensembles of :func:`ensemble_size` members
    (an ``--ensemble K`` grid: ``kep_svgp_ens<K>+ts − softmax_ens<K>+ts``, as its tables pair them), the ECE on the
    run's ``ece_bins``; the declared endpoints for single models on the declared bins. O(records)."""
    size = ensemble_size(records)
    primary = PRIMARY_ENDPOINT.measured_as(size, ece_bins)
    secondaries = tuple(endpoint.measured_as(size, ece_bins) for endpoint in SECONDARY_ENDPOINTS)
    return primary, secondaries, tuple(endpoint.measured_as(size, ece_bins) for endpoint in DESCRIPTIVE_ENDPOINTS)


def estimate_secondaries(records: list[RunRecord], ece_bins: int = DECLARED_ECE_BINS) -> list[EndpointEstimate]:
    """The secondary endpoints (:data:`~gpattn.comparison.endpoints.SECONDARY_ENDPOINTS`, as the records measure them:
    :func:`measured_endpoints`, ``ece_bins`` the run's ECE bins), each with its paired-t p-value Holm-adjusted over the
    family (:func:`~gpattn.comparison.holm_adjusted`; an endpoint without a test, e.g. one with fewer than
    :data:`MIN_SEEDS_FOR_INTERVALS` paired seeds, does not count and has no adjusted p-value). O(records) each."""
    _, secondaries, _ = measured_endpoints(records, ece_bins)
    estimates = [estimate_endpoint(records, endpoint, hierarchical=False) for endpoint in secondaries]
    adjusted = holm_adjusted([estimate.p_value for estimate in estimates])
    return [dataclasses.replace(estimate, holm=holm) for estimate, holm in zip(estimates, adjusted, strict=True)]


def _value(estimate: EndpointEstimate, value: float, sign: bool = True) -> str:
    digits = 2 if estimate.endpoint.percent else 3
    return f"{value * estimate.endpoint.scale():{'+' if sign else ''}.{digits}f}"


def _interval(estimate: EndpointEstimate, interval: PairedDifference) -> str:
    return f"[{_value(estimate, interval.low)}, {_value(estimate, interval.high)}]"


def verdict(estimate: EndpointEstimate) -> tuple[str, str]:
    """The declared verdict rule applied to an estimate: ``(kind, sentence)``.

    ``kind`` is ``"lower"`` / ``"higher"`` (every interval excludes 0 on that side: the reference's metric is lower /
    higher), ``"none"`` (an interval holds 0, or the intervals exclude 0 on opposite sides: no difference detected;
    the sentence gives the hull of the intervals, the differences the run excludes) or ``"missing"`` (no interval:
    the sentence gives the mean difference where there are paired seeds, fewer than
    :data:`MIN_SEEDS_FOR_INTERVALS`, and says that it is no verdict).
    """
    endpoint, unit = estimate.endpoint, estimate.endpoint.unit
    intervals = estimate.intervals()
    if not intervals and estimate.n and not math.isnan(estimate.mean):
        return "missing", (
            f"No verdict: {endpoint.reference} − {endpoint.other} = {_value(estimate, estimate.mean)} {unit}, the mean "
            f"over {estimate.n} paired seed{'' if estimate.n == 1 else 's'} without an interval (an interval, and so "
            f"a verdict, needs at least {MIN_SEEDS_FOR_INTERVALS})."
        )
    if not intervals:
        return "missing", f"Not measured: {estimate.missing}."
    names = ["paired t"] + (["seeds and examples"] if estimate.hierarchical is not None else [])
    shown = "; ".join(f"{_interval(estimate, i)} {name}" for i, name in zip(intervals, names, strict=True))
    value = _value(estimate, estimate.mean)
    difference = f"{endpoint.reference} − {endpoint.other} = {value} {unit} ({shown}, n = {estimate.n} seeds)"
    below, above = all(i.high < 0 for i in intervals), all(i.low > 0 for i in intervals)
    if below or above:
        kind = "lower" if below else "higher"
        size = _value(estimate, abs(estimate.mean), sign=False)
        return kind, f"{difference}: {endpoint.reference} has the {kind} {endpoint.label}, by {size} {unit}."
    low, high = min(i.low for i in intervals), max(i.high for i in intervals)
    bound = _value(estimate, max(abs(low), abs(high)), sign=False)
    partial = [name for i, name in zip(intervals, names, strict=True) if i.significant]
    if len(partial) > 1:  # every interval excludes 0, but not on the same side
        aside = " (the intervals exclude 0 on opposite sides)"
    else:
        aside = f" (only the {partial[0]} interval excludes 0)" if partial else ""
    return "none", (
        f"No difference detected{aside}: {difference}; the intervals exclude differences larger than {bound} {unit} "
        "in either direction."
    )


def _p(value: float) -> str:
    """A p-value at 4 decimals, rounded up (``< 0.0001`` below 0.0001), so that the printed rule applied to the
    printed value gives the statement beside it: a Holm p of 0.050004, not stated, shows as 0.0501, not 0.0500.
    Rounded from the shortest decimal that reads back as ``value`` (``repr``): the double nearest 0.05 shows as
    0.0500 and is stated, as ``value <= FAMILY_WISE_LEVEL`` says."""
    if math.isnan(value):
        return "n/a"
    if value < 1e-4:
        return "< 0.0001"
    return f"{Decimal(repr(value)).quantize(Decimal('0.0001'), rounding=ROUND_CEILING)}"


def _secondary_rows(estimates: list[EndpointEstimate], tested: bool) -> list[str]:
    lines = []
    for estimate in estimates:
        endpoint = estimate.endpoint
        name = f"{endpoint.label} ({endpoint.reference} − {endpoint.other}), {endpoint.unit}"
        if estimate.note:
            name += f"; {estimate.note}"
        mean = "n/a" if math.isnan(estimate.mean) else _value(estimate, estimate.mean)
        interval = _interval(estimate, estimate.t) if estimate.t is not None else f"n/a: {estimate.missing}"
        cells = [name, mean, interval, str(estimate.n)]
        if tested:
            stated = "n/a" if math.isnan(estimate.holm) else ("yes" if estimate.holm <= FAMILY_WISE_LEVEL else "no")
            cells += [_p(estimate.p_value), _p(estimate.holm), stated]
        lines.append("| " + " | ".join(map(markdown_cell, cells)) + " |")
    return lines


def _measured_notes(records: list[RunRecord], ece_bins: int) -> list[str]:
    # where the records measure the endpoints otherwise than they are declared: ensembles, another ECE binning
    notes = []
    size = ensemble_size(records)
    if size > 1:
        primary = PRIMARY_ENDPOINT.measured_as(size)
        notes += [
            f"Note: these records are ensembles of {size} members (`gpattn compare --ensemble {size}`): every "
            f"endpoint below is read on them ({primary.reference} − {primary.other}, and likewise), not on the single "
            "models it is declared on.",
            "",
        ]
    if ece_bins != DECLARED_ECE_BINS:
        notes += [
            f"Note: the ECE is on {ece_bins} equal-width bins (`--ece-bins {ece_bins}`), not the {DECLARED_ECE_BINS} "
            "it is declared on.",
            "",
        ]
    return notes


def _subset_note(primary: EndpointEstimate) -> list[str]:
    # the primary endpoint on fewer seeds than declared: make main's subset, or another count
    if not 0 < primary.n < DECLARED_PRIMARY_SEEDS:
        return []
    if primary.left_out:  # run, but not paired: not a subset of the declared run's seeds
        count = len(primary.left_out)
        which = f"{count} seed{'' if count == 1 else 's'} of these records left out of the pairing (note above); "
    elif sorted(primary.seeds) == sorted(MAIN_SEEDS):
        which = f"these records are the subset of `make main` (seeds {MAIN_SEEDS[0]}-{MAIN_SEEDS[-1]}); "
    else:
        which = ""
    return [
        f"Note: {primary.n} paired seed{'' if primary.n == 1 else 's'}, fewer than the {DECLARED_PRIMARY_SEEDS} the "
        "endpoint is declared on: "
        f"{which}the declared estimate is the one of `gpattn compare --full` (seeds 0-{DECLARED_PRIMARY_SEEDS - 1}).",
        "",
    ]


def headline_text(
    records: list[RunRecord], num_resamples: int = 10000, declaration: bool = True, ece_bins: int = DECLARED_ECE_BINS
) -> str:
    """The headline block (markdown): the declared endpoints in words (unless ``declaration`` is false: a page that
    states them earlier), the primary estimate with both intervals and its verdict (below
    :data:`MIN_SEEDS_FOR_INTERVALS` paired seeds its mean difference, without interval or verdict), the secondaries
    with paired-t and Holm-adjusted p-values, the differences reported without a test, and the primary difference on
    the other tasks of the records (descriptive). The endpoints are read as the records measure them
    (:func:`measured_endpoints`: an ``--ensemble K`` grid's ensembles, the run's ``ece_bins``), with a note where
    that is not as declared.

    .. note:: Cost: dominated by the seeds-and-examples bootstrap, O(``num_resamples`` seeds examples).
    """
    measured, _, descriptives = measured_endpoints(records, ece_bins)
    primary = estimate_endpoint(records, measured, num_resamples=num_resamples)
    lines = ["## Headline", "", *([declaration_text(), ""] if declaration else [])]
    lines += [*_measured_notes(records, ece_bins), "### Primary endpoint", ""]
    if primary.t is None and primary.n:  # the mean alone, said plainly
        lines += ["| interval | difference | 95 % interval | over |", "|---|---|---|---|"]
        lines.append(
            f"| paired t | {_value(primary, primary.mean)} {primary.endpoint.unit} | none: fewer than "
            f"{MIN_SEEDS_FOR_INTERVALS} paired seeds | {primary.n} seed{'' if primary.n == 1 else 's'} |"
        )
        lines.append("")
    if primary.t is not None:
        lines += ["| interval | difference | 95 % interval | over |", "|---|---|---|---|"]
        lines.append(
            f"| paired t | {_value(primary, primary.mean)} {primary.endpoint.unit} | {_interval(primary, primary.t)} | "
            f"{primary.n} seeds |"
        )
        if primary.hierarchical is not None:
            lines.append(
                f"| seeds-and-examples bootstrap | {_value(primary, primary.hierarchical.mean)} "
                f"{primary.endpoint.unit} | {_interval(primary, primary.hierarchical)} | {primary.n} seeds x "
                f"{primary.examples} test examples |"
            )
        lines.append("")
    if primary.note:
        lines += [f"Note: {primary.note}.", ""]
    lines += _subset_note(primary)
    lines += [f"**Verdict**: {verdict(primary)[1]}", ""]
    secondaries = estimate_secondaries(records, ece_bins)
    tests = sum(not math.isnan(estimate.p_value) for estimate in secondaries)
    untested = len(secondaries) - tests
    lines += [f"### Secondary endpoints (Holm-adjusted over m = {tests} tests)", ""]
    if untested:
        lines += [
            f"Note: {untested} of the {len(secondaries)} declared secondaries {'has' if untested == 1 else 'have'} "
            f"no test in these records (fewer than {MIN_SEEDS_FOR_INTERVALS} paired seeds, or not measured): no "
            "interval, p, adjusted p or statement (n/a), and no count in m.",
            "",
        ]
    lines += [
        "| endpoint | difference | 95 % paired-t interval | n | p | p (Holm) | stated at 5 % |",
        "|---|---|---|---|---|---|---|",
        *_secondary_rows(secondaries, tested=True),
        "",
        f"p: the two-sided paired-t test over the seeds; p (Holm): Holm-adjusted over the m = {tests} secondary tests "
        "that have a p-value, so that the chance of any false statement among them is at most 5 %; stated: p (Holm) "
        "<= 0.05. The p-values are rounded up at 4 decimals, so that the rule holds for the values shown. The "
        "interval beside it is the unadjusted 95 % paired-t interval. With fewer than "
        f"{MIN_SEEDS_FOR_INTERVALS} paired seeds there is neither interval nor test.",
        "",
        "### Reported without a test",
        "",
        "| difference | value | 95 % paired-t interval | n |",
        "|---|---|---|---|",
        *_secondary_rows([estimate_endpoint(records, e, hierarchical=False) for e in descriptives], False),
        "",
    ]
    others = [task for task in dict.fromkeys(r.task for r in records) if task != measured.task]
    estimates = [estimate_endpoint(records, measured.on_task(task), hierarchical=False) for task in others]
    estimates = [estimate for estimate in estimates if estimate.n]
    if estimates:
        lines += [
            "### The primary difference on the other tasks (descriptive, not an endpoint)",
            "",
            "| task | difference, nats | 95 % paired-t interval | n |",
            "|---|---|---|---|",
        ]
        for estimate in estimates:
            interval = _interval(estimate, estimate.t) if estimate.t is not None else f"n/a: {estimate.missing}"
            lines.append(
                f"| {markdown_cell(estimate.endpoint.task)} | {_value(estimate, estimate.mean)} | "
                f"{markdown_cell(interval)} | {estimate.n} |"
            )
        lines.append("")
    return "\n".join(lines)
