"""Validation-split sweep of KEP-SVGP's rank ``s``, KSVD weight ``eta`` and KL weight ``beta`` on digits.

One factor at a time around the comparison's defaults (rank s = 10, eta 1, beta 1), plus softmax and SGPA references,
each over several seeds, with the comparison's model and training loop (:mod:`gpattn.comparison.runs`; every row
with its own training recipe, so SGPA anneals its KL as in ``gpattn compare``).
Everything is measured on the VALIDATION split, never the test split, so the table can be used to choose settings.
Results go to ``benchmarks/results/kep_sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path

import torch

from gpattn.comparison import CompareConfig, TaskData, build_model, classification_metrics, load_task, make_train_config
from gpattn.methods import get_method
from gpattn.training import evaluate, train_model

SETTINGS = [
    ("kep_svgp", {}),
    ("kep_svgp", {"num_inducing": 4}),
    ("kep_svgp", {"num_inducing": 16}),
    ("kep_svgp", {"ksvd_weight": 0.1}),
    ("kep_svgp", {"ksvd_weight": 10.0}),
    ("kep_svgp", {"beta": 0.1}),
    ("kep_svgp", {"beta": 10.0}),
    ("kep_svgp", {"beta": 0.01}),
    # one posterior sample at evaluation: no Monte Carlo averaging of the predictive probabilities
    ("kep_svgp", {"eval_samples": 1}),
    ("softmax", {}),
    ("sgpa", {}),
]


def run(name: str, overrides: dict, seed: int, data: TaskData, base: CompareConfig) -> dict[str, float]:
    config = replace(base, **overrides)
    method = get_method(name)
    hyperparameters = config.hyperparameters("digits", method, data.num_inducing)
    torch.manual_seed(seed)
    model = build_model(method, hyperparameters, data.num_classes, data.model_kwargs)
    train_config = make_train_config(config, method, hyperparameters, seed)
    train_model(model, data.train, data.val, train_config)
    torch.manual_seed(seed)
    probabilities = evaluate(model, data.val, num_samples=config.eval_samples)
    # the comparison's metrics ("confidence", the mean top-label probability: below the accuracy = under-confident)
    return asdict(classification_metrics(probabilities, data.val.labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/kep_sweep.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = CompareConfig(progress=False)
    data = load_task("digits")
    results = []
    header = ("val acc", "val conf", "val NLL", "val ECE")
    print(f"{'attention':<10} {'setting':<16} " + " ".join(f"{name:>15}" for name in header))
    for name, overrides in SETTINGS:
        runs = [run(name, overrides, seed, data, base) for seed in args.seeds]
        results.append({"attention": name, "overrides": overrides, "runs": runs})
        cells = []
        for key, scale in (("accuracy", 100), ("confidence", 100), ("nll", 1), ("ece", 100)):
            values = [entry[key] * scale for entry in runs]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.fmean(values):7.3f} ± {spread:5.3f}")
        label = ", ".join(f"{key}={value}" for key, value in overrides.items()) or "default"
        print(f"{name:<10} {label:<16} " + " ".join(f"{cell:>15}" for cell in cells), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seeds": args.seeds, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
