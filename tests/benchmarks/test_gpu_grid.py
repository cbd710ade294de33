"""benchmarks/gpu_grid.py on CPU: one real smoke run of ``gpattn compare`` (the digits task, one epoch), the MPS
daemon's start and stop protocol against a stand-in ``nvidia-cuda-mps-control`` on the PATH, and the comparison of
the variants' records with stand-in compare commands. What it measures on a GPU is not tested here (CI has none)."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def grid(load_benchmark):
    return load_benchmark("gpu_grid", "gpu_grid_under_test")


@pytest.fixture
def stand_in_runs(monkeypatch):
    """For the tests whose compare commands are stand-ins: no data cache to warm (loading the tasks in a subprocess
    takes seconds; test_smoke_run_on_cpu and test_the_data_cache_is_warmed_... cover it)."""
    monkeypatch.setenv("GPATTN_CACHE_DIR", "off")


def _stand_in_mps(folder: Path, exit_code: int = 0) -> Path:
    """An executable ``nvidia-cuda-mps-control`` that appends its arguments, its standard input and its pipe folder
    to ``calls.log``."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-cuda-mps-control"
    log = folder / "calls.log"
    script.write_text(
        "#!/bin/sh\n"
        'input=""; if [ "$#" -eq 0 ]; then input=$(cat); fi\n'
        f'echo "args=$* stdin=$input pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "{log}"\n'
        f"exit {exit_code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return log


def test_smoke_run_on_cpu(grid, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPATTN_CACHE_DIR", str(tmp_path / "cache"))  # on, whatever the caller set
    out = tmp_path / "grid.json"
    results = grid.main(["--device", "cpu", "--smoke", "--variants", "plain", "--out", str(out)])
    plain = json.loads(out.read_text())["variants"]["plain"]
    assert plain["returncode"] == 0, plain["stderr_tail"]
    assert plain["runs"] == 2  # kep_svgp and softmax, digits, seed 0
    assert grid.succeeded(results)
    assert plain["seconds"] > 0 and "--jobs" in plain["command"] and results["device_name"] is None
    printed = capsys.readouterr().out
    assert "plain: 2 runs in" in printed
    assert results["data_cache"]["returncode"] == 0 and "data cache: digits loaded in" in printed


def test_the_data_cache_is_warmed_before_the_variants_unless_it_is_off(grid, monkeypatch):
    calls = []
    monkeypatch.delenv("GPATTN_CACHE_DIR", raising=False)
    monkeypatch.setattr(grid.subprocess, "run", lambda command, **kwargs: calls.append(command) or _Finished())
    args = grid.argparse.Namespace(tasks=["mnist1d", "digits"], seeds=[3, 4])
    warm = grid.warm_data_cache(args)
    assert warm["returncode"] == 0 and warm["seconds"] >= 0
    assert calls[0][:2] == [sys.executable, "-c"]
    assert calls[0][2].splitlines()[1:] == ["load_task('mnist1d', 3)", "load_task('digits', 3)"]
    monkeypatch.setenv("GPATTN_CACHE_DIR", "off")
    assert grid.warm_data_cache(args) == {"skipped": "GPATTN_CACHE_DIR=off"} and len(calls) == 1


class _Finished:
    returncode, stderr = 0, ""


def test_the_mps_daemon_starts_and_quits_with_its_own_folders(grid, tmp_path, monkeypatch):
    log = _stand_in_mps(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with grid.mps_daemon(tmp_path / "mps") as env:
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / "pipe")
        assert Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
        started = log.read_text().splitlines()
    assert started == [f"args=-d stdin= pipe={tmp_path / 'mps' / 'pipe'}"]
    assert log.read_text().splitlines()[1:] == [f"args= stdin=quit pipe={tmp_path / 'mps' / 'pipe'}"]


def test_a_daemon_that_does_not_start_is_an_error(grid, tmp_path, monkeypatch):
    _stand_in_mps(tmp_path / "bin", exit_code=3)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(RuntimeError, match=r"-d failed \(3\)"), grid.mps_daemon(tmp_path / "mps"):
        pass
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="not installed"), grid.mps_daemon(tmp_path / "mps"):
        pass


@pytest.mark.parametrize("same", [True, False])
def test_the_variants_records_are_compared_without_their_wall_times(
    grid, stand_in_runs, tmp_path, monkeypatch, capsys, same
):
    """Stand-in compare commands write one run file each: its wall time differs between the variants (ignored), its
    accuracy too unless ``same``; the MPS variant runs as a client of the (stand-in) daemon."""
    _stand_in_mps(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    writer = (
        "import json, os, pathlib, sys, time; out = pathlib.Path(sys.argv[1]) / 'runs'; out.mkdir(parents=True);"
        "mps = 'CUDA_MPS_PIPE_DIRECTORY' in os.environ;"
        "record = {'train': {'seconds': time.perf_counter()}, 'accuracy': 0.5 if (mps and not sys.argv[2]) else 0.9};"
        "(out / 'mnist1d-kep_svgp-0.json').write_text(json.dumps({'record': record, 'mps': False}))"
    )
    command = [sys.executable, "-c", writer]
    monkeypatch.setattr(grid, "compare_command", lambda args, out, compiled=False: [*command, str(out), "1" * same])
    results = grid.main(["--device", "cpu", "--out", str(tmp_path / "grid.json")])
    plain, mps = results["variants"]["plain"], results["variants"]["mps"]
    assert plain["runs"] == mps["runs"] == 1 and plain["identical_records"] is True
    assert mps["identical_records"] is same and grid.succeeded(results) is same
    assert "mps: 1 runs in" in capsys.readouterr().out


def _alive(pid: int, within: float = 5.0) -> bool:
    """Whether process ``pid`` still runs after up to ``within`` seconds (a zombie, exited but not yet reaped, does
    not): a signal is delivered after ``kill`` returns, so a process signalled a moment ago may still be seen running
    (a fresh-clone run under load once read it so)."""
    deadline = time.monotonic() + within
    while True:
        try:
            running = "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            running = False
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def test_a_variant_that_runs_too_long_is_stopped_and_recorded(grid, stand_in_runs, tmp_path, monkeypatch):
    """Past --timeout-s the compare command is stopped with the processes it started (its workers would otherwise go
    on using the GPU while the next variant is timed)."""
    pid_file = tmp_path / "worker.pid"
    sleeper = [
        sys.executable,
        "-c",
        "import subprocess, sys, time;"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']);"
        f"open({str(pid_file)!r}, 'w').write(str(worker.pid)); time.sleep(30)",
    ]
    monkeypatch.setattr(grid, "compare_command", lambda args, out, compiled=False: sleeper)
    out = str(tmp_path / "grid.json")
    results = grid.main(["--device", "cpu", "--variants", "plain", "--timeout-s", "1", "--out", out])
    plain = results["variants"]["plain"]
    assert plain["returncode"] == "timeout" and plain["runs"] == 0 and 1.0 <= plain["seconds"] < 20
    assert not grid.succeeded(results)
    worker = int(pid_file.read_text())
    assert not _alive(worker), "the compare command's worker outlived the timeout"


def test_sigterm_stops_the_variant_and_writes_the_variants_so_far(grid, stand_in_runs, tmp_path, monkeypatch):
    """SIGTERM (a job's time limit) while the MPS variant runs: its command is stopped, the daemon told to quit and
    the JSON written with the plain variant's results; the caller's SIGTERM handler is restored."""
    import signal

    log = _stand_in_mps(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    writer = (
        "import json, os, pathlib, signal, sys, time;"
        "out = pathlib.Path(sys.argv[1]) / 'runs'; out.mkdir(parents=True);"
        "(out / 'mnist1d-kep_svgp-0.json').write_text(json.dumps({'record': {}}));"
        "'CUDA_MPS_PIPE_DIRECTORY' in os.environ and os.kill(os.getppid(), signal.SIGTERM); time.sleep(30)"
        " if 'CUDA_MPS_PIPE_DIRECTORY' in os.environ else None"
    )
    monkeypatch.setattr(grid, "compare_command", lambda args, out, compiled=False: [sys.executable, "-c", writer, out])

    def guard(signum, frame):  # the default handler would end the test process
        raise AssertionError("SIGTERM reached the caller's handler: gpu_grid did not handle it")

    previous = signal.signal(signal.SIGTERM, guard)
    try:
        out = tmp_path / "grid.json"
        results = grid.main(["--device", "cpu", "--variants", "plain", "mps", "graphs", "--out", str(out)])
        assert signal.getsignal(signal.SIGTERM) is guard
    finally:
        signal.signal(signal.SIGTERM, previous)
    written = json.loads(out.read_text())
    assert written["stopped"].startswith("Stopped") and set(written["variants"]) == {"plain", "mps"}
    plain, mps = written["variants"]["plain"], written["variants"]["mps"]
    assert plain["returncode"] == 0 and plain["runs"] == 1 and plain["identical_records"] is True
    assert mps["returncode"] == "stopped" and mps["seconds"] < 20 and mps["runs"] == 1
    assert log.read_text().splitlines()[-1].startswith("args= stdin=quit")  # the daemon was told to quit
    assert not grid.succeeded(results)


def test_compiled_variants_compare_with_their_own_kind_and_with_eager(
    grid, stand_in_runs, tmp_path, monkeypatch, capsys
):
    """Stand-in compare commands: the compiled runs (``--compile`` in the command) round otherwise than the eager ones,
    the same in both compiled variants; each compiled variant's records equal the first compiled variant's, and its
    test metrics are compared with the eager runs'."""
    _stand_in_mps(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    writer = (
        "import json, pathlib, sys; out = pathlib.Path(sys.argv[1]) / 'runs'; out.mkdir(parents=True);"
        "compiled = sys.argv[2] == '--compile';"
        "test = {'accuracy': 0.75 if compiled else 0.875, 'nll': 0.625 if compiled else 0.5};"
        "(out / 'mnist1d-kep_svgp-0.json').write_text(json.dumps({'record': {'metrics': {'test': test}}}));"
        "(out / 'mnist1d-softmax-0.json').write_text(json.dumps({'record': {'metrics': {'test': {**test, 'nll': 1}}}}))"
    )
    commands, real_command = [], grid.compare_command

    def command(args, out, compiled=False):
        commands.append(real_command(args, out, compiled))
        return [sys.executable, "-c", writer, str(out), "--compile" if "--compile" in commands[-1] else ""]

    monkeypatch.setattr(grid, "compare_command", command)
    out = str(tmp_path / "grid.json")
    results = grid.main(["--device", "cpu", "--variants", "compiled", "plain", "mps-compiled", "--out", out])
    assert ["--compile" in line for line in commands] == [True, False, True]
    compiled, plain, mps = (results["variants"][name] for name in ("compiled", "plain", "mps-compiled"))
    assert compiled["identical_records"] and plain["identical_records"] and mps["identical_records"]
    assert grid.succeeded(results)
    assert compiled["metrics_vs_eager"] == mps["metrics_vs_eager"] == {"runs": 2, "accuracy": 0.125, "nll": 0.125}
    assert "metrics_vs_eager" not in plain
    assert "against eager: accuracy 0.125, NLL 0.125 at most" in capsys.readouterr().out


def test_metrics_vs_eager_reads_only_the_runs_in_both(grid):
    def run(accuracy: float, nll: float) -> dict:
        return {"record": {"metrics": {"test": {"accuracy": accuracy, "nll": nll}}}}

    eager = {"a.json": run(0.5, 1.0), "b.json": run(0.5, 1.0)}
    compiled = {"a.json": run(0.25, 1.5), "c.json": run(0.0, 9.0)}
    assert grid.metrics_vs_eager(compiled, eager) == {"runs": 1, "accuracy": 0.25, "nll": 0.5}
    assert grid.metrics_vs_eager({"c.json": run(0.0, 9.0)}, eager) is None
    # a metric written as null (not finite) is left out of the largest difference
    assert grid.metrics_vs_eager({"a.json": run(0.25, None)}, eager) == {"runs": 1, "accuracy": 0.25, "nll": None}


def test_graphs_variants_pass_cuda_graphs_and_compare_with_their_own_kind(
    grid, stand_in_runs, tmp_path, monkeypatch, capsys
):
    """``graphs`` and ``mps-graphs`` run ``gpattn compare --cuda-graphs`` (not ``--compile``); their records are
    compared with each other's (a graph's random draws are not the eager step's) and their metrics with eager's, and
    the runs that used the graphs are counted from the records."""
    _stand_in_mps(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    writer = (
        "import json, pathlib, sys; out = pathlib.Path(sys.argv[1]) / 'runs'; out.mkdir(parents=True);"
        "graphs = sys.argv[2] == '--cuda-graphs';"
        "test = {'accuracy': 0.75 if graphs else 0.875, 'nll': 0.5};"
        "record = lambda graphed: {'record': {'metrics': {'test': test}, 'train': {'cuda_graphs': graphed}}};"
        "(out / 'mnist1d-kep_svgp-0.json').write_text(json.dumps(record(graphs)));"
        "(out / 'mnist1d-sgpa-0.json').write_text(json.dumps(record(False)))"
    )
    commands, real_command = [], grid.compare_command

    def command(args, out, compiled=False, **options):
        commands.append(real_command(args, out, compiled, **options))
        return [sys.executable, "-c", writer, str(out), "--cuda-graphs" if "--cuda-graphs" in commands[-1] else ""]

    monkeypatch.setattr(grid, "compare_command", command)
    out = str(tmp_path / "grid.json")
    results = grid.main(["--device", "cpu", "--variants", "graphs", "plain", "mps-graphs", "--out", out])
    assert [("--cuda-graphs" in line, "--compile" in line) for line in commands] == [(True, False), (False, False)] + [
        (True, False)
    ]
    graphs, plain, mps = (results["variants"][name] for name in ("graphs", "plain", "mps-graphs"))
    assert graphs["identical_records"] and plain["identical_records"] and mps["identical_records"]
    assert graphs["metrics_vs_eager"] == mps["metrics_vs_eager"] == {"runs": 2, "accuracy": 0.125, "nll": 0.0}
    assert graphs["graphed_runs"] == mps["graphed_runs"] == 1 and "graphed_runs" not in plain  # SGPA's ran eagerly
    assert "1 of 2 runs in CUDA graphs" in capsys.readouterr().out


def test_a_daemon_that_hangs_is_given_up(grid, tmp_path, monkeypatch):
    """A start or a quit of the MPS daemon that does not return is given up after MPS_TIMEOUT_S (a quit that hung
    held the variant's results back for good)."""
    import time

    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "nvidia-cuda-mps-control"
    script.write_text('#!/bin/sh\nif [ "$#" -eq 0 ] || [ -e "$HANG_START" ]; then exec sleep 30; fi\nexit 0\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HANG_START", str(tmp_path / "no-such-file"))
    monkeypatch.setattr(grid, "MPS_TIMEOUT_S", 0.2)
    start = time.perf_counter()
    with grid.mps_daemon(tmp_path / "mps") as env:  # the quit hangs
        assert "CUDA_MPS_PIPE_DIRECTORY" in env
    assert time.perf_counter() - start < 10
    monkeypatch.setenv("HANG_START", str(script))  # the start hangs
    with pytest.raises(RuntimeError, match="-d did not return within 0.2 s"), grid.mps_daemon(tmp_path / "mps"):
        pass
