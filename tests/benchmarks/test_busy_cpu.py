"""The busy-CPU benchmark's own logic (not its timings): both conditions run and are recorded, the ratio is the one
printed, and the competing processes it starts are gone afterwards."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("busy_cpu", "busy_cpu_under_test")


@pytest.fixture
def started(monkeypatch) -> list[subprocess.Popen]:
    """Every process started through ``subprocess.Popen`` while the test runs, in order."""
    processes = []
    popen = subprocess.Popen

    def recording(*args, **kwargs):
        process = popen(*args, **kwargs)
        processes.append(process)
        return process

    monkeypatch.setattr(subprocess, "Popen", recording)
    return processes


@pytest.mark.parametrize("competitor", ["python", "torch"])
def test_both_conditions_are_measured_and_the_competitors_stopped(bench, tmp_path, started, competitor):
    threads = torch.get_num_threads()
    out = tmp_path / "busy.json"
    argv = ["--length", "8", "--batch", "2", "--embed-dim", "16", "--num-heads", "2", "--rank", "4"]
    argv += ["--min-reps", "1", "--max-reps", "2", "--budget-s", "0.05", "--settle-s", "0", "--out", str(out)]
    try:
        results = bench.main([*argv, "--competitors", "2", "--competitor", competitor])
    finally:
        torch.set_num_threads(threads)
    saved = json.loads(out.read_text())
    assert saved["busy_over_idle"] == pytest.approx(results["busy"]["ratio"] / results["idle"]["ratio"])
    assert (saved["idle"]["threads"], saved["idle"]["competitors"]) == (1, 0)
    assert (saved["busy"]["threads"], saved["busy"]["competitors"]) == (2, 2)
    for condition in ("idle", "busy"):
        times = saved[condition]["times_ms"]
        assert set(times) == {"softmax", "kep_svgp"} and all(value > 0 for value in times.values())
        assert saved[condition]["ratio"] == pytest.approx(times["kep_svgp"] / times["softmax"])
    # the script started exactly the two competitors of the busy condition, running its code, and stopped them
    uptimes = [process for process in started if process.args[0] == "uptime"]
    competitors = [process for process in started if process not in uptimes]
    assert len(competitors) == 2 and all(process.args[-1] == bench.COMPETITORS[competitor] for process in competitors)
    assert all(process.poll() is not None for process in competitors)


@pytest.mark.parametrize("competitor", ["python", "torch"])
def test_a_competitor_is_running_when_it_is_returned_and_gone_when_stopped(bench, competitor):
    (process,) = bench.start_competitors(competitor, 1)  # returns after its ready line: its imports are done
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=1.0)
    finally:
        bench.stop_competitors([process])
    assert process.poll() is not None and process.stdout.closed


def test_a_competitor_that_fails_is_an_error_with_its_message(bench, monkeypatch, started):
    monkeypatch.setitem(bench.COMPETITORS, "broken", "import no_such_module_for_the_benchmark")
    with pytest.raises(
        RuntimeError,
        match="broken competitor exited before it ran: ModuleNotFoundError: .*no_such_module_for_the_benchmark",
    ):
        bench.start_competitors("broken", 2)
    assert len(started) == 2 and all(process.poll() is not None for process in started)  # none left running


def test_an_unknown_competitor_is_a_usage_error(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--competitor", "fork-bomb"])
    assert exit_info.value.code == 2 and "fork-bomb" in capsys.readouterr().err
