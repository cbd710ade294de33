"""KEP-SVGP against softmax attention on a busy CPU (issue 25): one training step of each, interleaved, in two
conditions measured in one run, one after the other:

* ``idle``: 1 torch thread, nothing started beside it;
* ``busy``: ``--threads`` torch threads (2) beside ``--competitors`` busy processes (1) that this script starts and
  stops: each runs a Python loop, or with ``--competitor torch`` one-thread matrix products; the timing starts once
  every competitor has said it is running (after its imports) and ``--settle-s`` more seconds have passed.

With many small operators, every multi-threaded one waits for its worker threads, which a competing process
deschedules: the ratio KEP / softmax then grows with the operator count. The issue's target is a busy ratio within
1.5x of the idle one. The load average is printed with every timing (the machine's other work counts too).

Run ``python benchmarks/busy_cpu.py --help`` for the options; the results go to ``benchmarks/results/busy_cpu.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
import torch  # noqa: E402

SCALING_SCRIPT = Path(__file__).resolve().with_name("attention_scaling.py")
ROWS = ("softmax", "kep_svgp")
#: what a competing process runs: a Python loop (pure CPU), or one-thread float32 matrix products (CPU and memory
#: traffic, like a training run of ``gpattn compare`` or ``gpattn tune`` beside the measurement)
COMPETITORS = {
    "python": "print('ready', flush=True)\nwhile True: pass",
    "torch": (
        "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nprint('ready', flush=True)\n"
        "while True: a = torch.tanh(a @ a)"
    ),
}


def start_competitors(kind: str, count: int) -> list[subprocess.Popen]:
    """``count`` processes running ``COMPETITORS[kind]``, returned once each has printed its ready line (after its
    imports); one that exits before is an error (with its standard error), and the others are stopped."""
    processes = []
    try:
        for _ in range(count):
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", COMPETITORS[kind]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True,
                )
            )  # fmt: skip
        for process in processes:
            if process.stdout.readline().strip() != "ready":
                process.wait()
                last = (process.stderr.read().strip().splitlines() or ["no message"])[-1]
                raise RuntimeError(f"a {kind} competitor exited before it ran: {last}")
    except BaseException:
        stop_competitors(processes)
        raise
    return processes


def stop_competitors(processes: list[subprocess.Popen]) -> None:
    """Kill the competitors and wait for them (their pipes closed)."""
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()
        process.stdout.close()
        process.stderr.close()


def _bench():
    spec = importlib.util.spec_from_file_location("attention_scaling_for_busy_cpu", SCALING_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return f"load average {os.getloadavg()[0]:.2f}"


def _condition(bench, label: str, threads: int, competitors: int, args: argparse.Namespace) -> dict:
    """Medians (ms) of interleaved steps of every row at ``threads`` torch threads beside ``competitors`` busy
    processes, with the uptime before and after."""
    busy = start_competitors(args.competitor, competitors)
    try:
        time.sleep(args.settle_s)  # let the competitors take their share of the cores
        torch.set_num_threads(threads)
        before = _uptime()
        x = torch.randn(args.batch, args.length, args.embed_dim)
        torch.manual_seed(0)
        cpu = torch.device("cpu")
        layers = {row: bench._build(row, args.embed_dim, args.num_heads, args.rank, cpu) for row in ROWS}
        steps = {row: (lambda layer=layer: bench._step(layer, x)) for row, layer in layers.items()}
        timing = argparse.Namespace(warmup=2, min_reps=args.min_reps, max_reps=args.max_reps, budget_s=args.budget_s)
        times = bench._interleaved_medians(steps, timing, torch.device("cpu"))
        after = _uptime()
    finally:
        stop_competitors(busy)
    ratio = times["kep_svgp"] / times["softmax"]
    cells = ", ".join(f"{row} {ms:.1f} ms" for row, ms in times.items())
    kind = f" ({args.competitor})" if competitors else ""
    line = f"{label}: {threads} threads, {competitors} busy processes{kind}: {cells}; kep/softmax {ratio:.2f}"
    print(line, flush=True)
    print(f"    uptime before: {before}\n    uptime after:  {after}", flush=True)
    uptime = [before, after]
    return {"threads": threads, "competitors": competitors, "times_ms": times, "ratio": ratio, "uptime": uptime}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=256, help="N (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--embed-dim", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--rank", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the busy condition")
    parser.add_argument("--competitors", type=int, default=1, help="busy processes of the busy condition")
    parser.add_argument(
        "--competitor", choices=sorted(COMPETITORS), default="python",
        help="what each busy process runs: a Python loop, or one-thread torch matrix products (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--min-reps", type=int, default=5)
    parser.add_argument("--max-reps", type=int, default=21)
    parser.add_argument("--budget-s", type=float, default=20.0, help="seconds of repetitions per condition")
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--out", default="benchmarks/results/busy_cpu.json")
    args = parser.parse_args(argv)
    bench = _bench()
    idle = _condition(bench, "idle", 1, 0, args)
    busy = _condition(bench, "busy", args.threads, args.competitors, args)
    factor = busy["ratio"] / idle["ratio"]
    print(f"busy / idle ratio of kep/softmax: {factor:.2f} (target <= 1.5)", flush=True)
    results = {"config": vars(args), "idle": idle, "busy": busy, "busy_over_idle": factor}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
