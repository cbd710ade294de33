"""The results page (``docs/guide/results.md``), generated from the records of one or more run folders
(:func:`results_page`; ``gpattn report --page`` writes it with its figures), and the check that a run's verdicts
survive a perturbation that changes only float rounding (:func:`compare_verdicts`, ``gpattn report --same-verdict``).

No number on the page is typed by hand: it states the declared endpoints, then the headline, the full tables, the
figures and the machine, all read from the folders' ``results.json``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..methods import get_method
from .endpoints import DECLARED_ECE_BINS, declaration_text
from .environment import code_label, environment_lines
from .headline import (
    FAMILY_WISE_LEVEL,
    EndpointEstimate,
    estimate_endpoint,
    estimate_secondaries,
    headline_text,
    measured_endpoints,
    verdict,
)
from .records import RunRecord
from .report import markdown_table
from .runner import result_entries
from .statistics import scaled_mean
from .table_rows import split_ensemble_row
from .tuning_space import TUNED_ROWS, search_space

__all__ = ["RunFolders", "compare_verdicts", "read_run_folders", "results_page"]

#: Settings of a run folder's ``config`` that say how the runs were scheduled and shown, not what they computed.
SCHEDULING = ("progress", "jobs")


@dataclass(frozen=True)
class RunFolders:
    """The records of one or more run folders, merged by ``(task, row, seed)`` (:func:`read_run_folders`).

    :ivar names: The folders, as shown on a page (relative to the working directory, else by name).
    :ivar records: The merged records, in folder and file order.
    :ivar configs: Each folder's ``config`` entry.
    :ivar environments: Each folder's ``environment`` entry (``{}`` for a folder written before it existed).
    :ivar codes: Each folder's ``codes`` entry, the code that made its runs
        (:func:`~gpattn.comparison.environment.run_file_codes`; ``[]`` for a folder written before it existed).
    """

    names: list[str]
    records: list[RunRecord]
    configs: list[dict[str, Any]]
    environments: list[dict[str, Any]]
    codes: list[list[dict[str, Any]]]

    @property
    def ece_bins(self) -> int:
        """The equal-width ECE bins of the runs (``--ece-bins``; :func:`read_run_folders` checked that the folders
        agree): the first folder's ``config``, else the bins of a record's reliability diagram, else the declared
        :data:`~gpattn.comparison.endpoints.DECLARED_ECE_BINS`. O(records) at most."""
        bins = self.configs[0].get("ece_bins") if self.configs else None
        if isinstance(bins, int) and not isinstance(bins, bool):
            return bins
        counts = [len(record.reliability.count) for record in self.records if record.reliability is not None]
        return counts[0] if counts else DECLARED_ECE_BINS


def _display(folder: str | os.PathLike) -> str:
    # a folder below the working directory by its relative path, another one by its name (no machine paths on a page)
    path = Path(folder).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return path.name


#: ``train`` entries that may differ between two executions of one run (wall time; the epoch count older records lack)
UNCOMPARED_TRAIN_ENTRIES = ("seconds", "epochs_trained")


def _numbers(record: RunRecord) -> dict:
    """What must agree between two copies of one run: the record without its wall time and without the epoch count
    that records written before it existed lack (the same run trained twice differs in its seconds only)."""
    data = record.to_dict()
    train = data.get("train") or {}
    data["train"] = {key: value for key, value in train.items() if key not in UNCOMPARED_TRAIN_ENTRIES}
    data.pop("undefined", None)  # the reasons follow the values, whose NaN are None in the dict
    return data


_JSON_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}


def _json_kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def _checked_entries(path: Path, content: dict[str, Any]) -> tuple[dict, dict, list]:
    """The ``config``, ``environment`` and ``codes`` entries of a ``results.json``, checked to be of the types
    :func:`results_page` reads (``{}``, ``{}`` and ``[]`` where missing, as in a folder of an older gpattn)."""
    again = "(edited or damaged: the same gpattn compare command with --resume writes it again from the folder's runs/)"

    def expect(value: Any, kind: type, what: str) -> Any:
        if not isinstance(value, kind):
            raise ValueError(f"{path}: expected {what} to be {_JSON_KINDS[kind]}, got {_json_kind(value)} {again}")
        return value

    config = expect(content.get("config", {}), dict, "'config'")
    for key in ("seeds", "primary_seeds"):
        seeds = expect(config.get(key, []), list, f"config '{key}'")
        if not all(isinstance(seed, int) and not isinstance(seed, bool) for seed in seeds):
            raise ValueError(f"{path}: expected config '{key}' to be a list of integers, got {seeds!r} {again}")
    environment = expect(content.get("environment", {}), dict, "'environment'")
    for key in ("machine", "threads"):
        expect(environment.get(key, {}), dict, f"environment '{key}'")
    codes = expect(content.get("codes") or [], list, "'codes'")
    for group in codes:
        expect(expect(group, dict, "each entry of 'codes'").get("runs", []), list, "the 'runs' of each 'codes' entry")
    return config, environment, codes


def _run_identity(entry: Any) -> str:
    # the run a record of results.json names, as far as it names one
    if not isinstance(entry, dict):
        return f"not an object but {_json_kind(entry)}"
    return f"task {entry.get('task', '?')}, row {entry.get('attention', '?')}, seed {entry.get('seed', '?')}"


def _check_same_settings(folders: list[str | os.PathLike], configs: list[dict[str, Any]]) -> None:
    """Refuse to merge folders whose runs were made under settings that change the numbers: those
    :func:`~gpattn.comparison.runner.result_entries` keeps, the ones ``--resume`` checks (the rows, tasks, seeds and
    the scheduling may differ)."""
    first = result_entries(configs[0]) if configs[0] else None
    for folder, config in zip(folders[1:], configs[1:], strict=True):
        if first is None or not config:
            bare = folders[0] if first is None else folder
            raise ValueError(
                f"{bare}: its results.json records no settings ('config'), so its runs cannot be checked against "
                f"those of {folder if first is None else folders[0]}: report it on its own"
            )
        other = result_entries(config)
        changed = sorted(key for key in set(first) | set(other) if first.get(key) != other.get(key))
        if changed:
            shown = ", ".join(f"{key}: {first.get(key)!r} / {other.get(key)!r}" for key in changed)
            raise ValueError(
                f"{folders[0]} and {folder} were made with other settings ({shown}): their runs are not comparable; "
                "report each folder on its own (--same-verdict compares the verdicts of two folders)"
            )


def read_run_folders(folders: list[str | os.PathLike]) -> RunFolders:
    """Read the ``results.json`` of every folder and merge their records: the folders must have been made with the
    same settings that determine a run's numbers (those ``--resume`` checks:
    :func:`~gpattn.comparison.runner.result_entries`; the rows, tasks, seeds and scheduling may differ), and a
    ``(task, row, seed)`` in several folders must hold the same record in each (e.g. ``make main``'s runs inside the
    full run), apart from its wall time, and is kept once (the first folder's). O(records).

    :raises ValueError: One line naming the file or folders: a folder without a readable ``results.json``, an entry
        of the wrong type, a record that cannot be read (with its run), folders made with other settings (with the
        settings that differ), or two different records of one run.
    """
    if not folders:
        raise ValueError("expected at least one run folder")
    merged: dict[tuple[str, str, int], tuple[RunRecord, dict, str]] = {}
    configs, environments, codes = [], [], []
    for folder in folders:
        path = Path(folder) / "results.json"
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{path}: cannot be read as a run folder's results.json ({error})") from None
        if not isinstance(content, dict) or not isinstance(content.get("records"), list):
            raise ValueError(f"{path}: expected a results.json with a list of 'records'")
        config, environment, folder_codes = _checked_entries(path, content)
        if configs:  # before its records: a run of another setting would only "differ" from the first folder's
            _check_same_settings([folders[0], folder], [configs[0], config])
        configs.append(config)
        environments.append(environment)
        codes.append(folder_codes)
        for index, entry in enumerate(content["records"], start=1):
            try:
                record = RunRecord.from_dict(entry)
            except ValueError as error:
                raise ValueError(f"{path}: record {index} ({_run_identity(entry)}): {error}") from None
            key = (record.task, record.attention, record.seed)
            data = _numbers(record)
            if key in merged and merged[key][1] != data:
                raise ValueError(
                    f"run {'-'.join(map(str, key))} differs between {merged[key][2]} and {folder}: merge run folders "
                    "made with the same settings only"
                )
            merged.setdefault(key, (record, data, str(folder)))
    names = [_display(folder) for folder in folders]
    return RunFolders(names, [record for record, _, _ in merged.values()], configs, environments, codes)


def _seeds(count: int) -> str:
    return f"{count} seed{'' if count == 1 else 's'}"


def _runs_summary(runs: RunFolders) -> list[str]:
    lines = []
    for name, config in zip(runs.names, runs.configs, strict=True):
        count = len(config.get("seeds", [])) if config else 0
        extra = len(config.get("primary_seeds", [])) if config else 0
        seeds = f"{_seeds(count)} per row" + (f" ({count + extra} for the primary pair)" if extra else "")
        settings = ", ".join(f"{key}={value}" for key, value in config.items() if key not in SCHEDULING)
        lines.append(f"* `{name}`: {seeds}; shared settings (of the rows without a tuned configuration) `{settings}`")
    tasks = list(dict.fromkeys(record.task for record in runs.records))
    for task in tasks:
        rows = list(dict.fromkeys(r.attention for r in runs.records if r.task == task))
        described = []
        for row in rows:
            group = [r for r in runs.records if r.task == task and r.attention == row]
            tuned = {r.tuned for r in group}
            kind = "tuned" if tuned == {True} else ("default configuration" if tuned == {False} else "mixed")
            described.append(f"{row} ({_seeds(len(group))}, {kind})")
        lines.append(f"* {task}: " + ", ".join(described))
        for row in rows:
            group = [r for r in runs.records if r.task == task and r.attention == row]
            lines.append(f"    * {row}: {_hyperparameters_text(row, [r.hyperparameters for r in group])}")
    seconds = math.fsum(r.train.seconds for r in runs.records if r.train is not None)
    lines.append(
        f"* training time of the {len(runs.records)} runs, summed: {seconds / 60:.1f} min (each run's wall time; runs "
        "trained side by side overlap)"
    )
    return lines


#: How each recorded hyperparameter is shown (name, format); the others are left out
_SHOWN = (
    ("lr", "lr {:.2g}"), ("weight_decay", "weight decay {:.2g}"), ("dropout", "dropout {:.2f}"),
    ("beta", "KL weight beta {:.3g}"), ("ksvd_weight", "KSVD weight eta {:.3g}"), ("num_inducing", "s = {}"),
    ("kl_anneal_fraction", "KL annealed over {:.2f} of the run"), ("patience", "early stopping after {} epochs"),
)  # fmt: skip


def _hyperparameters_text(row: str, values: list[dict]) -> str:
    # a row's hyperparameters as the records hold them, one description when every seed used the same ones; the row
    # parameters (beta, eta, s, annealing) only for a row whose layer or objective uses them (a row that wraps models of
    # a tuned row, Deep Ensembles or the Laplace row, those of that row); a row this process does not know (an
    # attention registered by the process that ran it, or a row of another gpattn) with every recorded one
    if not values or not values[0]:
        return "hyperparameters not recorded (older records)"
    if any(value != values[0] for value in values):
        return "hyperparameters differ between seeds"
    value = values[0]
    row = split_ensemble_row(row)[0]  # an ensemble of --ensemble K: its members are the row's models
    try:
        method = get_method(row)
    except ValueError:  # not a row of this process: no layer to ask which parameters it uses
        method = None
    settings = {"num_inducing": 1, "ksvd_weight": 1.0}
    arguments = settings if method is None else method.layer_arguments(**settings)
    uses = {"num_inducing": "num_inducing" in arguments, "ksvd_weight": "ksvd_weight" in arguments}
    source = row if row in TUNED_ROWS or method is None else method.attention
    if source in TUNED_ROWS:  # the rows whose objective has a KL term are the ones the search gives a beta
        searched = {parameter.name for parameter in search_space(source, 1)}
        uses.update(beta="beta" in searched, kl_anneal_fraction="kl_anneal_fraction" in searched)
    parts = []
    if {"embed_dim", "depth", "num_heads"} <= value.keys():
        parts.append(f"width {value['embed_dim']} x depth {value['depth']} x {value['num_heads']} heads")
    parts += [f"at most {value['epochs']} epochs"] if "epochs" in value else []
    shown = [text.format(value[name]) for name, text in _SHOWN if uses.get(name, True) and value.get(name) is not None]
    if uses["num_inducing"] and "num_inducing" in value and value["num_inducing"] is None:  # recorded as "default"
        shown.append("s = the layer's default")
    return ", ".join(parts + shown)


def _temperature_caveat(records: list[RunRecord]) -> list[str]:
    # the +ts rows whose temperature raised the mean clean test NLL by more than 5 %: a temperature fitted on a
    # validation split with few misclassified examples is noisy, and a sharpened model (T < 1) pays on the test set
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for record in records:
        if record.temperature_scaled is not None:
            groups.setdefault((record.task, record.attention), []).append(record)
    worse = []
    for (task, row), group in groups.items():
        # the runs where both NLLs are finite (a NaN of a diverged run made every mean NaN and dropped the row), each
        # one tested: the sum of two finite NLLs near the largest double overflows
        paired = [
            r
            for r in group
            if math.isfinite(r.metrics.test.nll) and math.isfinite(r.temperature_scaled.metrics.test.nll)
        ]
        if not paired:
            continue
        untempered = scaled_mean([r.metrics.test.nll for r in paired])
        tempered = scaled_mean([r.temperature_scaled.metrics.test.nll for r in paired])
        temperature = scaled_mean([r.temperature_scaled.temperature for r in paired])
        fewer = (
            f", over the {len(paired)} of {len(group)} runs with both NLLs finite" if len(paired) < len(group) else ""
        )
        if tempered > 1.05 * untempered:
            worse.append(
                f"{task} {row}+ts ({row}: {untempered:.3f}, +ts: {tempered:.3f}, mean T {temperature:.2f}{fewer})"
            )
    if not worse:
        return []
    return [
        f"* Temperature scaling raised the mean clean test NLL by more than 5 % for {len(worse)} of {len(groups)} "
        f"rows: {'; '.join(worse)}. The temperature is fitted by NLL on the validation split and generalises only as "
        "far as that split does: a split with few misclassified examples (a small one, or an accurate model) gives "
        "a noisy fit, and one that sharpens the model (T < 1; towards the bound 0.01 when the split has no error at "
        "all) makes it over-confident on the test set. Read those +ts rows with that in mind."
    ]


def results_page(runs: RunFolders, figures: list[str], checks: list[tuple[RunFolders, list[str]]] = ()) -> str:
    """The results page (markdown): the declared endpoints first, then what was run, the headline, the checks of the
    primary verdict (``checks``: each other run's folders and :func:`compare_verdicts`' lines against ``runs``), the
    full tables, the figures (``figures``: paths relative to the page, each written ``![stem](<path>)``, so that a
    path with a space is one image in CommonMark (GitHub) and in Python-Markdown (the documentation site)) and the
    machine of each folder."""
    machines = []
    folders = zip(runs.names, runs.environments, runs.configs, runs.codes, strict=True)
    for name, environment, config, folder_codes in folders:
        lines = environment_lines(environment) if environment else ["* not recorded (a run folder of an older gpattn)"]
        lines += _codes_lines(folder_codes, environment)
        lines.append(
            f"* torch threads per run: {config.get('threads', '?')}, runs at a time: {config.get('jobs', '?')}"
        )
        machines += [f"`{name}`:", "", *lines, ""]
    caveats = [
        "* One model size (a small Transformer) on two small tasks; the rows' hyperparameters are the tuned or "
        "default configurations listed above, and another budget can reorder them.",
        "* The paired-t intervals treat the test set as fixed (they reflect the seeds only); the seeds-and-examples "
        "interval of the primary endpoint also resamples the test examples and, like every percentile bootstrap, is "
        "somewhat narrow for few seeds.",
        f"* The secondaries are stated at a family-wise error rate of {100 * FAMILY_WISE_LEVEL:g} % (Holm); the "
        "paired differences of the full tables are descriptive (not corrected for the many comparisons).",
        "* The shift and OOD sets are synthetic (generated noise, shifts and held-out classes): they say nothing "
        "about natural distribution shift.",
        "* A verdict that changes with float rounding is not a conclusion: `gpattn report RUN_A --same-verdict "
        "RUN_B` compares two runs that differ only in rounding (e.g. `--threads 1` and `--threads 2`).",
        *_temperature_caveat(runs.records),
    ]
    figure_lines = [f"![{Path(path).stem}](<{path}>)" for path in figures] or ["No figures (no data to draw)."]
    sources = " ".join(runs.names)
    if checks:
        sources += " --same-verdict " + " ".join(name for other, _ in checks for name in other.names)
    parts = [
        "# Results: what the measured comparison shows",
        "",
        f"Generated by `gpattn report {sources} --page PAGE` from the run folders' `results.json`: no number on this "
        "page is typed by hand. Regenerate it with `make results` (its variables `RESULTS_RUNS` and `RESULTS_CHECKS` "
        "name the folders).",
        "",
        "## The question, declared before the run",
        "",
        declaration_text(),
        "",
        "## What was run",
        "",
        *_runs_summary(runs),
        "",
        headline_text(runs.records, declaration=False, ece_bins=runs.ece_bins),
        *_checks_text(checks),
        "## Full tables",
        "",
        markdown_table(runs.records, runs.ece_bins),
        "## Figures",
        "",
        *[line for figure in figure_lines for line in (figure, "")],
        "## Machine",
        "",
        *machines,
        "## What it does not show",
        "",
        *caveats,
        "",
    ]
    return "\n".join(parts)


def _codes_lines(codes: list[dict[str, Any]], environment: dict[str, Any]) -> list[str]:
    """A line naming the code that made the folder's runs, where it is not only the report writer's (``--resume``
    kept runs of other code), else nothing."""
    writer = {"gpattn": environment.get("gpattn"), "git_commit": environment.get("git_commit")}
    if not codes or (len(codes) == 1 and codes[0].get("code") == writer):
        return []
    groups = "; ".join(f"{code_label(group.get('code'))}: {len(group.get('runs', []))} runs" for group in codes)
    return [f"* the runs were made by other code than the report's: {groups}"]


def _checks_text(checks: list[tuple[RunFolders, list[str]]]) -> list[str]:
    # the section of the page that repeats the primary verdict on other runs: the same protocol under a perturbation
    # that changes float rounding (--threads 2) or the seeds (another seed block)
    if not checks:
        return []
    lines = [
        "## The primary verdict on other runs",
        "",
        "The same comparison run again under a perturbation (another thread count changes only float rounding; "
        "another seed block changes the seeds), and whether the primary verdict stays the same "
        "(`gpattn report ... --same-verdict`; the secondaries' decisions are listed for information):",
        "",
    ]
    for other, check in checks:
        lines += [f"`{' '.join(other.names)}`: {check[0]}", "", *[f"* {line}" for line in check[1:]], ""]
    return lines


def compare_verdicts(first: RunFolders, second: RunFolders) -> tuple[bool, list[str]]:
    """Whether the primary verdict of two runs is the same (:func:`~gpattn.comparison.headline.verdict`'s kind:
    lower, higher, no difference), e.g. for two runs that differ only in float rounding (``--threads 1`` and ``2``).

    :return: ``(holds, lines)``: the lines give both verdicts, each secondary's decision at the family-wise level in
        both runs (informative: the check is on the primary; ``no test``, ``not stated``, or ``stated, higher`` /
        ``stated, lower`` with the sign of reference - other, so that a difference stated in opposite directions
        differs), and the settings in which the runs' configs differ.
    """
    kinds, lines = [], []
    for runs in (first, second):
        primary, _, _ = measured_endpoints(runs.records, runs.ece_bins)
        kind, sentence = verdict(estimate_endpoint(runs.records, primary))
        kinds.append(kind)
        lines.append(f"{', '.join(runs.names)}: {sentence}")
    holds = kinds[0] == kinds[1] and "missing" not in kinds
    state = "holds" if holds else ("cannot be checked" if "missing" in kinds else "differs")
    lines.insert(0, f"The primary verdict {state} ({kinds[0]} / {kinds[1]}).")
    secondaries = [estimate_secondaries(runs.records, runs.ece_bins) for runs in (first, second)]
    for estimate, other in zip(*secondaries, strict=True):
        left, right = _stated(estimate), _stated(other)
        mark = "same" if left == right else "DIFFERS"
        lines.append(f"secondary {estimate.endpoint.label}: {left} / {right} ({mark})")
    changed = _changed_settings(first.configs, second.configs)
    lines.append("settings that differ: " + (", ".join(changed) if changed else "none"))
    return holds, lines


def _stated(estimate: EndpointEstimate) -> str:
    # a statement is a direction: reference - other higher or lower (a stated difference has a mean of its sign)
    if math.isnan(estimate.holm):
        return "no test"
    if estimate.holm > FAMILY_WISE_LEVEL:
        return "not stated"
    return "stated, higher" if estimate.mean > 0 else "stated, lower"


def _changed_settings(first: list[dict], second: list[dict]) -> list[str]:
    left = {key: value for config in first for key, value in config.items() if key not in SCHEDULING}
    right = {key: value for config in second for key, value in config.items() if key not in SCHEDULING}
    return [f"{key}: {left.get(key)!r} / {right.get(key)!r}" for key in sorted(set(left) | set(right))
            if left.get(key) != right.get(key)]  # fmt: skip
