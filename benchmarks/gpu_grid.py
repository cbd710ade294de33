"""Issue 25's grid target: ``make main``'s runs on one GPU, with ``--jobs`` worker processes, without and with CUDA MPS.

Worker processes that share one GPU without MPS are time-sliced: each holds its own CUDA context and the GPU runs one
context's kernels at a time, so runs whose steps are small (the comparison's models: 20 tokens, width 32-64) do not
run concurrently (on one H200, four runs with ``--jobs 4`` took 37.3 s against 28.9 s one after another; 26.0
against 28.6 s in a second session). Under the
Multi-Process Service (MPS) the processes' kernels share the GPU at once. This script times the same slice of the grid
(``gpattn compare --main --device cuda --jobs J --seeds ...``, one subprocess per variant, each with a fresh CUDA
context) in the variants asked for:

* ``plain``: the runs as ``gpattn compare`` makes them;
* ``mps``: the same, after starting an MPS control daemon (``nvidia-cuda-mps-control -d``, with its pipe and log
  folders in a temporary folder passed to the runs through ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY``),
  which is stopped afterwards (``quit``); recorded as unavailable where the binary is missing or does not start;
* ``compiled`` and ``mps-compiled``: ``plain`` and ``mps`` with ``gpattn compare --compile`` (every model compiled,
  mode reduce-overhead on CUDA: a step's kernels replayed as CUDA graphs; each worker compiles its models, and the
  compile time counts). Not run unless asked for (``--variants``);
* ``graphs`` and ``mps-graphs``: ``plain`` and ``mps`` with ``gpattn compare --cuda-graphs`` (every full-size training
  step of a row whose layers support it captured once as a CUDA graph and replayed, and the validation's and the
  final evaluation's passes too; no compiler). Not run unless asked for; ``graphed_runs`` counts the runs whose
  records say they used the graphs (SGPA's rows run eagerly).

Before the variants, every task is loaded once, untimed, so that each variant reads its data from gpattn's disk
cache (``data_cache`` in the JSON: the seconds it took). Every variant's records are compared with those of the first
variant of its kind (eager, compiled, graphs) (``identical_records``: the run files without their wall times;
deterministic kernels make them equal on one device); a compiled or graphs variant's test accuracy and NLL are compared
with the eager reference's, run by run, where both ran (``metrics_vs_eager``: the largest absolute differences;
compiled kernels round otherwise, and a graph's random draws are not the eager step's).
Writes one JSON, after every variant and on Ctrl-C or SIGTERM (``timeout``, a job's time limit: the variant under way
is stopped, and the MPS daemon told to quit): the commands, the wall time of each variant, the load average before and
after, the device's name. A variant's command runs in its own session: past ``--timeout-s``, or when the script is
stopped, the command and the worker processes it started are stopped together.

Usage, from the repository root (on the GPU machine; see gpu_check.py for machines without pyro-ppl or mnist1d)::

    python benchmarks/gpu_grid.py --out benchmarks/results/gpu_grid.json                  # plain and mps, seeds 0-3
    python benchmarks/gpu_grid.py --variants mps mps-compiled --out benchmarks/results/gpu_grid.json
    python benchmarks/gpu_grid.py --device cpu --smoke --variants plain --out /dev/null    # the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("plain", "mps", "compiled", "mps-compiled", "graphs", "mps-graphs")
DEFAULT_VARIANTS = ("plain", "mps")
MPS_CONTROL = "nvidia-cuda-mps-control"
#: the most seconds the MPS control daemon's start or quit may take
MPS_TIMEOUT_S = 60.0


def _sibling(path: Path):
    """A fresh copy of the benchmark file ``path`` as the module ``<stem>_for_<this module's name>``."""
    spec = importlib.util.spec_from_file_location(f"{path.stem}_for_{__name__}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: the JSON results, written after every variant and on Ctrl-C or SIGTERM (shared with gpu_check.py)
RESULTS = _sibling(Path(__file__).resolve().with_name("_results_json.py"))
#: raised on SIGTERM, and by a variant that was stopped
Stopped = RESULTS.Stopped


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _device_name(device: str) -> str | None:
    # as gpu_check.py's _nvidia_smi (this script imports neither torch nor gpattn, so it does not load that one)
    if not device.startswith("cuda"):
        return None
    try:
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout.strip() else None


@contextlib.contextmanager
def mps_daemon(folder: Path):
    """An MPS control daemon for the block, its pipe and log folders under ``folder``: yields the environment variables
    that make a process its client, or raises ``RuntimeError`` when it cannot start. A start or quit that takes more
    than :data:`MPS_TIMEOUT_S` seconds is given up (a quit that hangs would otherwise hold the results back)."""
    if shutil.which(MPS_CONTROL) is None:
        raise RuntimeError(f"{MPS_CONTROL} is not installed")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    full = {**os.environ, **env}
    try:
        started = subprocess.run(
            [MPS_CONTROL, "-d"], env=full, capture_output=True, text=True, check=False, timeout=MPS_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{MPS_CONTROL} -d did not return within {MPS_TIMEOUT_S} s") from None
    if started.returncode != 0:
        raise RuntimeError(f"{MPS_CONTROL} -d failed ({started.returncode}): {started.stderr.strip()}")
    try:
        yield env
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [MPS_CONTROL],
                input="quit\n",
                env=full,
                capture_output=True,
                text=True,
                check=False,
                timeout=MPS_TIMEOUT_S,
            )


def _records(folder: Path) -> dict[str, dict]:
    """The run files of a compare folder without their wall times, by file name."""
    records = {}
    for path in sorted((folder / "runs").glob("*.json")):
        content = json.loads(path.read_text())
        content.get("record", {}).get("train", {}).pop("seconds", None)
        records[path.name] = content
    return records


def compare_command(args: argparse.Namespace, out: Path, compiled: bool = False, graphs: bool = False) -> list[str]:
    command = [sys.executable, "-m", "gpattn.cli", "compare", "--main", "--device", args.device]
    command += ["--jobs", str(args.jobs), "--seeds", *map(str, args.seeds), "--tasks", *args.tasks]
    command += ["--out", str(out), "--no-progress", "--overwrite", *(["--compile"] if compiled else [])]
    return [*command, *(["--cuda-graphs"] if graphs else []), *args.extra]


def _short(value: float | None) -> str:
    return "none" if value is None else f"{value:.3g}"


def _compiled(name: str) -> bool:
    return name.endswith("compiled")


def _kind(name: str) -> str:
    """``"compiled"``, ``"graphs"`` or ``"eager"``: the variants whose records must be identical."""
    return "compiled" if _compiled(name) else "graphs" if name.endswith("graphs") else "eager"


def metrics_vs_eager(records: dict[str, dict], eager: dict[str, dict]) -> dict | None:
    """The largest absolute differences of the test accuracy and NLL between the runs of ``records`` and the same
    runs (file names) of ``eager``; ``None`` when no run is in both."""
    shared = sorted(records.keys() & eager.keys())
    if not shared:
        return None

    def largest(metric: str) -> float | None:
        # a value the records wrote as null (not finite) is left out
        pairs = [(records[name], eager[name]) for name in shared]
        values = [[content["record"]["metrics"]["test"][metric] for content in pair] for pair in pairs]
        differences = [abs(one - two) for one, two in values if one is not None and two is not None]
        return max(differences) if differences else None

    return {"runs": len(shared), "accuracy": largest("accuracy"), "nll": largest("nll")}


def graphed_runs(records: dict[str, dict]) -> int:
    """How many of the run files say that their run used CUDA graphs (the record's ``train.cuda_graphs``)."""
    return sum(
        bool(((content.get("record") or {}).get("train") or {}).get("cuda_graphs")) for content in records.values()
    )


def warm_data_cache(args: argparse.Namespace) -> dict:
    """Load every task once in a subprocess, untimed, so that every variant reads its data from the disk cache
    (``gpattn.data.disk_cache``) instead of the first one generating them: MNIST-1D's sets take about 10 s to
    generate, which would otherwise count against whichever variant runs first. Skipped with
    ``GPATTN_CACHE_DIR=off`` (every variant then generates them alike)."""
    if os.environ.get("GPATTN_CACHE_DIR", "").strip().lower() == "off":
        return {"skipped": "GPATTN_CACHE_DIR=off"}
    code = "from gpattn.comparison.tasks import load_task\n" + "".join(
        f"load_task({task!r}, {args.seeds[0]})\n" for task in args.tasks
    )
    start = time.perf_counter()
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    return {
        "seconds": time.perf_counter() - start,
        "returncode": finished.returncode,
        "stderr_tail": finished.stderr[-2000:],
    }


def _stop_group(process: subprocess.Popen) -> None:
    """Stop ``process`` and every process it started (its session: the compare command's workers, which would
    otherwise go on using the GPU while the next variant is timed): SIGTERM, then SIGKILL after 10 s."""
    for signum, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        try:
            process.wait(timeout=wait)
            with contextlib.suppress(ProcessLookupError):  # workers that outlived their parent
                os.killpg(process.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def _run_command(command: list[str], env: dict, timeout: float) -> tuple[int | str, str]:
    """Run ``command`` in its own session: its exit status and standard error; past ``timeout`` seconds, or on Ctrl-C
    or SIGTERM, the command and the processes it started are stopped (``"timeout"``, ``"stopped"``)."""
    with tempfile.TemporaryFile("w+b") as errors:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True)
        try:
            returncode: int | str = process.wait(timeout=timeout)
            prefix = ""
        except subprocess.TimeoutExpired:  # the runs finished so far are still read back
            _stop_group(process)
            returncode, prefix = "timeout", f"stopped after {timeout} s; "
        except KeyboardInterrupt as error:
            _stop_group(process)
            returncode, prefix = "stopped", f"stopped ({type(error).__name__}: {error}); "
        errors.seek(0)
        return returncode, prefix + errors.read().decode(errors="replace")


def run_variant(name: str, args: argparse.Namespace, folder: Path) -> dict:
    """One variant: the compare command's exit status (``"timeout"`` past ``--timeout-s``, ``"stopped"`` on Ctrl-C or
    SIGTERM), its wall time, the load average before and after, its standard error's end and the run files it wrote
    (``records``); ``unavailable`` where an MPS daemon does not start."""
    out = folder / name
    options = {"graphs": True} if _kind(name) == "graphs" else {}
    command = compare_command(args, out, _compiled(name), **options)
    entry: dict = {"command": command, "load_before": _load()}
    with contextlib.ExitStack() as stack:
        env = dict(os.environ)
        if name.startswith("mps"):
            try:
                env.update(stack.enter_context(mps_daemon(folder / "mps")))
            except RuntimeError as error:
                return {**entry, "unavailable": str(error)}
        start = time.perf_counter()
        returncode, stderr = _run_command(command, env, args.timeout_s)
        entry["seconds"] = time.perf_counter() - start
    entry.update(returncode=returncode, load_after=_load(), stderr_tail=str(stderr)[-2000:])
    entry["records"] = _records(out)
    return entry


def compare_variants(variants: dict[str, dict], records: dict[str, dict[str, dict]]) -> None:
    """Each variant's ``runs``, ``identical_records`` (against the first variant of its kind that ran),
    ``metrics_vs_eager`` and ``graphed_runs`` from the run files of ``records`` (by variant), into its entry."""
    references = {}  # the records of the first variant of each kind that ran
    for name in variants:
        if name in records:
            references.setdefault(_kind(name), records[name])
    for name, entry in variants.items():
        if name not in records:
            continue
        found = records[name]
        entry["runs"] = len(found)
        entry["identical_records"] = bool(found) and found == references[_kind(name)]
        if _kind(name) != "eager" and "eager" in references:
            entry["metrics_vs_eager"] = metrics_vs_eager(found, references["eager"])
        if _kind(name) == "graphs":  # the rows whose layers read values on the host (SGPA's) run eagerly
            entry["graphed_runs"] = graphed_runs(found)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--jobs", type=int, default=8, help="worker processes (default 8)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3], help="seeds of the runs (default 0-3)")
    parser.add_argument("--tasks", nargs="+", default=["mnist1d"], help="tasks of the runs (default mnist1d)")
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS), help="default: plain mps"
    )
    parser.add_argument("--smoke", action="store_true", help="one seed of the digits task, one epoch, untuned, one job")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=1800.0,
        help="the most seconds of one variant: past it, its command and the processes it started are stopped (the "
        "runs it finished are still compared) (default %(default)s)",
    )
    parser.add_argument(
        "--out",
        default="benchmarks/results/gpu_grid.json",
        help="the JSON file, written after every variant and on Ctrl-C or SIGTERM (default %(default)s)",
    )
    args = parser.parse_args(argv)
    args.extra = ["--untuned", "--digits-epochs", "1", "--mnist1d-epochs", "1"] if args.smoke else []
    if args.smoke:
        args.seeds, args.tasks, args.jobs = [0], ["digits"], 1
    out = Path(args.out)
    results: dict = {"config": dict(vars(args)), "device_name": _device_name(args.device)}
    variants: dict[str, dict] = {}
    records: dict[str, dict[str, dict]] = {}

    def before_writing() -> None:  # stopped: every variant that ran, compared
        results.setdefault("variants", variants)
        compare_variants(variants, records)

    # the file is written after every variant, and on Ctrl-C or SIGTERM with the variants so far
    with RESULTS.kept_when_stopped(results, out, "variants", before_writing):
        RESULTS.write_results(results, out)
        results["data_cache"] = warm = warm_data_cache(args)
        if "seconds" in warm:
            failed = f" (failed, rc {warm['returncode']}: {warm['stderr_tail'][-300:]})" if warm["returncode"] else ""
            print(f"data cache: {', '.join(args.tasks)} loaded in {warm['seconds']:.1f} s, untimed{failed}", flush=True)
        results["variants"] = variants
        # the MPS daemon may still be writing its log when told to quit: a cleanup error must not lose the results
        with tempfile.TemporaryDirectory(prefix="gpu_grid_", ignore_cleanup_errors=True) as scratch:
            for name in args.variants:
                entry = variants[name] = run_variant(name, args, Path(scratch))
                if "records" in entry:
                    records[name] = entry.pop("records")
                compare_variants(variants, records)
                RESULTS.write_results(results, out)
                if entry.get("returncode") == "stopped":
                    raise Stopped(f"during the variant {name}")
    for name, entry in variants.items():
        line = f"{name}: " + (
            entry["unavailable"]
            if "unavailable" in entry
            else f"{entry['runs']} runs in {entry['seconds']:.1f} s (rc {entry['returncode']}, load "
            f"{entry['load_before']:.2f} -> {entry['load_after']:.2f}), identical records {entry['identical_records']}"
        )
        if "graphed_runs" in entry:
            line += f"; {entry['graphed_runs']} of {entry['runs']} runs in CUDA graphs"
        if entry.get("metrics_vs_eager"):
            differences = entry["metrics_vs_eager"]
            accuracy, nll = (_short(differences[metric]) for metric in ("accuracy", "nll"))
            line += f"; against eager: accuracy {accuracy}, NLL {nll} at most"
        print(line, flush=True)
    return results


def succeeded(results: dict) -> bool:
    """Every variant that ran finished (exit status 0) with the first variant's records; an unavailable MPS is not a
    failure (it is recorded)."""
    if "stopped" in results:
        return False
    variants = results.get("variants", {}).values()
    return all(entry.get("returncode", 0) == 0 and entry.get("identical_records", True) for entry in variants)


if __name__ == "__main__":
    sys.exit(0 if succeeded(main()) else 1)
