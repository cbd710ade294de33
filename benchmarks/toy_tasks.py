"""Test accuracy of every attention on the directed toy sequence tasks, over training steps and seeds.

A 2-block :class:`~gpattn.models.Transformer` (width 32, 2 heads, rank / inducing sizes 4) with the attention under
test in both blocks is trained with :class:`~gpattn.mlls.AttentionELBO` and Adam on each task of
:mod:`gpattn.data.toy_sequences`; the test accuracy (4 Monte Carlo samples, probabilities averaged) is recorded at
several step counts, so that the table shows how fast each attention learns the direction of the relation, not only
whether it gets there. Results go to ``benchmarks/results/toy_tasks.json``; the printed table gives mean and standard
deviation over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gpattn.attention import attention_arguments, attention_names
from gpattn.data import make_pointer_task, make_successor_task
from gpattn.mlls import AttentionELBO
from gpattn.models import Transformer, predict_probabilities

TASKS = {
    "pointer": lambda seed: make_pointer_task(2048, 0, 512, length=8, seed=seed, vocab_size=8, min_length=4),
    "successor": lambda seed: make_successor_task(2048, 0, 512, length=8, seed=seed),
}


def _accuracy(model: Transformer, dataset) -> float:
    probabilities = predict_probabilities(model, dataset.tokens, mask=dataset.mask, num_samples=4)
    return (probabilities.argmax(dim=-1) == dataset.labels).double().mean().item()


def train(name: str, splits, seed: int, checkpoints: list[int], batch: int, lr: float) -> dict[int, float]:
    """Train one model; return the test accuracy at each checkpoint step."""
    torch.manual_seed(seed)
    sizes = {key: 4 for key in ("num_inducing",) if key in attention_arguments(name)}
    model = Transformer(
        splits.train.num_classes,
        embed_dim=32,
        depth=2,
        num_heads=2,
        attention=name,
        gp_layers=2,
        vocab_size=splits.train.vocab_size,
        max_len=splits.train.tokens.shape[1],
        **sizes,
    )
    loss_fn = AttentionELBO(model, num_data=len(splits.train))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    accuracies = {}
    for step in range(1, max(checkpoints) + 1):
        model.train()
        index = torch.randint(0, len(splits.train), (batch,), generator=generator)
        mask = None if splits.train.mask is None else splits.train.mask[index]
        loss = loss_fn(model(splits.train.tokens[index], mask=mask), splits.train.labels[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in checkpoints:
            accuracies[step] = _accuracy(model, splits.test)
    return accuracies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--attentions", nargs="+", default=attention_names(), choices=attention_names())
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[100, 200, 400])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny matrices: 1 is fastest)")
    parser.add_argument("--out", default="benchmarks/results/toy_tasks.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoints = sorted(args.checkpoints)
    results: dict = {"config": vars(args), "accuracy": {}}
    for task in args.tasks:
        results["accuracy"][task] = {}
        for name in args.attentions:
            start = time.perf_counter()
            runs = [train(name, TASKS[task](seed), seed, checkpoints, args.batch, args.lr) for seed in args.seeds]
            results["accuracy"][task][name] = runs
            cells = []
            for step in checkpoints:
                values = [run[step] for run in runs]
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                cells.append(f"{step}: {statistics.mean(values):.3f} ± {spread:.3f}")
            print(f"{task:<10} {name:<13} " + "  ".join(cells) + f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
