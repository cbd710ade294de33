"""Runs and tuning trials as Ray tasks (gpattn/comparison/ray_executor.py), on one local Ray instance of 2 CPUs
started once for the module: the records equal those of local runs bit for bit, a task whose worker dies is retried
and the grid completes, a task that fails twice is named and the finished runs are kept, ``--resume`` after an
interrupted Ray grid trains only the missing runs, and an unreachable ``--ray-address`` is one line, exit status 1,
before anything trains."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

import pytest

from gpattn.cli import main
from gpattn.comparison import CompareConfig
from gpattn.comparison.local_executor import TaskFailedError
from gpattn.comparison.ray_executor import RayExecutor, RayUnavailableError, check_ray_address
from gpattn.comparison.runner import RunFailedError, RunsInterrupted, run_comparison, run_name

ray = pytest.importorskip("ray")

TINY = dict(tasks=("pointer",), pointer_epochs=1, eval_samples=2, fidelity_sequences=0, progress=False)
GRID = CompareConfig(attentions=("softmax", "kep_svgp"), seeds=(0, 1), **TINY)
SMALL = CompareConfig(attentions=("softmax",), seeds=(0, 1), **TINY)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray instance for the module (starting one costs seconds); every executor here joins it."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def _run_files(folder) -> dict[str, dict]:
    """The run files of ``folder/runs``, without the wall time (which depends on the machine's load)."""
    files = {}
    for path in sorted((folder / "runs").glob("*.json")):
        content = json.loads(path.read_text())
        content["record"]["train"].pop("seconds")
        files[path.name] = content
    return files


@pytest.fixture(scope="module")
def local_grid(tmp_path_factory):
    """The run files of GRID trained in this process, one run after the other."""
    out = tmp_path_factory.mktemp("local")
    run_comparison(GRID, out=out)
    return _run_files(out)


def test_ray_records_equal_local_records_bit_for_bit(local_grid, tmp_path):
    run_comparison(GRID, out=tmp_path, executor=RayExecutor(jobs=2))
    ray_files = _run_files(tmp_path)
    assert sorted(ray_files) == sorted(f"{run_name(*run)}.json" for run in _grid_runs(GRID))
    assert ray_files == local_grid  # every number of every record, the identity and the settings


def _grid_runs(config: CompareConfig) -> list[tuple[str, str, int]]:
    return [(task, row, seed) for task in config.tasks for row in config.attentions for seed in config.seeds]


class _Wrapped(RayExecutor):
    """A RayExecutor whose tasks run ``self.wrap(key, fn)`` in place of ``fn`` (a closure, pickled by value into
    the Ray worker), and which lists the keys submitted."""

    def __init__(self, wrap=None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.wrap, self.submitted = wrap, []

    def submit(self, key, fn, *args):
        self.submitted.append(key)
        super().submit(key, fn if self.wrap is None else self.wrap(key, fn), *args)


def test_a_task_whose_worker_dies_is_retried_and_the_grid_completes(local_grid, tmp_path):
    marker = tmp_path / "crashed"

    def crash_first_attempt(key, fn):
        def run(*args):
            if key == ("pointer", "softmax", 1) and not marker.exists():
                marker.touch()
                os._exit(1)  # the worker process dies mid-run, as a killed process does
            return fn(*args)

        return run

    run_comparison(SMALL, out=tmp_path / "out", executor=_Wrapped(crash_first_attempt, jobs=2))
    assert marker.exists()  # the first attempt did die
    assert _run_files(tmp_path / "out") == {name: local_grid[name] for name in _run_files(tmp_path / "out")}
    assert len(_run_files(tmp_path / "out")) == 2


def test_a_task_failing_twice_is_named_and_the_finished_runs_are_kept(tmp_path):
    attempts, out = tmp_path / "attempts", tmp_path / "out"
    finished = out / "runs" / "pointer-softmax-0.json"

    def fail(key, fn):
        def run(*args):
            if key != ("pointer", "softmax", 1):
                return fn(*args)
            with open(attempts, "a") as handle:
                handle.write("attempt\n")
            deadline = time.monotonic() + 120
            while not finished.exists() and time.monotonic() < deadline:  # fail once the other run is written
                time.sleep(0.1)
            raise ValueError("boom")

        return run

    kept = r"the 1 run finished before is kept in .*runs, and the same command with --resume continues from there$"
    with pytest.raises(RunFailedError, match=rf"^run pointer-softmax-1 failed: boom; {kept}"):
        run_comparison(SMALL, out=out, executor=_Wrapped(fail, jobs=2))
    assert attempts.read_text().count("attempt") == 2  # retried once
    assert sorted(path.name for path in (out / "runs").glob("*.json")) == ["pointer-softmax-0.json"]


def _fail(message):
    raise ValueError(message)


def test_a_task_that_returned_comes_before_a_failure_beside_it():
    """Tasks finished together: the one that returned is handed back before the failure (which stops the
    comparison), so its record is written; ``jobs`` and ``threads`` are checked when the executor is made."""
    with RayExecutor(jobs=2) as executor:
        executor.submit("bad", _fail, "boom")  # first in the list that ray.wait answers in order
        executor.submit("good", abs, -2)
        ray.wait(list(executor._refs), num_returns=2)  # both finished (the failure retried once)
        assert executor.next_result() == ("good", 2)
        with pytest.raises(TaskFailedError, match="bad: boom"):
            executor.next_result()
        with pytest.raises(RuntimeError, match="no task is pending"):
            executor.next_result()
        executor.submit("late", abs, -3)  # finished, not handed back: what Ctrl-C's path collects
        ray.wait(list(executor._refs), num_returns=1)
        assert executor.finished_results() == [("late", 3)] and executor.pending == 0
    for arguments in ({"jobs": 0}, {"jobs": True}, {"threads": 1.5}):
        with pytest.raises(ValueError, match=next(iter(arguments))):
            RayExecutor(**arguments)


class _InterruptedAfter(_Wrapped):
    """Ctrl-C in the driver once ``after`` runs came back."""

    def __init__(self, after: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.after, self.returned = after, 0

    def next_result(self):
        if self.returned == self.after:
            raise KeyboardInterrupt
        self.returned += 1
        return super().next_result()


def test_resume_after_an_interrupted_ray_grid_trains_only_the_missing_runs(local_grid, tmp_path):
    with pytest.raises(RunsInterrupted) as interrupted:
        run_comparison(SMALL, out=tmp_path, executor=_InterruptedAfter(1, jobs=2))
    # the run handed back before the signal, and the other one too if it finished by then (kept, not lost)
    finished = interrupted.value.finished
    assert interrupted.value.total == 2 and finished in (1, 2)
    kept = {path.stem for path in (tmp_path / "runs").glob("*.json")}
    assert len(kept) == finished
    resumed = _Wrapped(jobs=2)
    run_comparison(SMALL, out=tmp_path, resume=True, executor=resumed)
    missing = [run for run in _grid_runs(SMALL) if run_name(*run) not in kept]
    assert resumed.submitted == missing and len(missing) == 2 - finished  # the missing run only, once
    files = _run_files(tmp_path)
    assert files == {name: local_grid[name] for name in files} and len(files) == 2


TUNE = ["tune", "--tasks", "pointer", "--rows", "softmax", "--trials", "2", "--pointer-epochs", "1"]
TUNE += ["--eval-samples", "2", "--no-progress"]


def _trial_files(folder) -> dict[str, dict]:
    files = {}
    for path in sorted((folder / "trials").glob("*.json")):
        content = json.loads(path.read_text())
        del content["seconds"], content["cpu_seconds"]
        files[path.name] = content
    return files


def test_tune_trials_as_ray_tasks_equal_local_trials(tmp_path, capsys):
    """Two trials in flight on Ray draw the parameters that one local worker draws (TPE's random start-up trials are
    seeded by the trial's slot), and train the same numbers."""
    assert main([*TUNE, "--out", str(tmp_path / "local")]) == 0
    assert main([*TUNE, "--out", str(tmp_path / "ray"), "--executor", "ray", "--jobs", "2"]) == 0
    assert "(executor ray, jobs 2, threads 1)" in capsys.readouterr().out
    local, remote = _trial_files(tmp_path / "local"), _trial_files(tmp_path / "ray")
    assert sorted(remote) == ["pointer-softmax-0.json", "pointer-softmax-1.json"]
    assert remote == local
    tuned = [json.loads((tmp_path / name / "tuned" / "pointer.json").read_text()) for name in ("local", "ray")]
    assert tuned[0]["rows"]["softmax"]["best_val_nll"] == tuned[1]["rows"]["softmax"]["best_val_nll"]


# -- the address, checked before anything trains ------------------------------------------------------------------
def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # free once closed: nothing listens there


@pytest.mark.parametrize("command", [["compare", "--tasks", "pointer", "--quick"], TUNE])
def test_an_unreachable_ray_address_is_one_line_and_status_1_before_anything(command, tmp_path, capsys):
    port = _closed_port()
    start = time.perf_counter()
    status = main([*command, "--executor", "ray", "--ray-address", f"127.0.0.1:{port}", "--out", str(tmp_path / "o")])
    seconds = time.perf_counter() - start
    error = capsys.readouterr().err
    assert status == 1 and seconds < 10
    assert error.count("\n") == 1 and f"no Ray cluster answers at 127.0.0.1:{port}" in error
    assert error.startswith(f"gpattn {command[0]}: error: --ray-address 127.0.0.1:{port}: ")
    assert not (tmp_path / "o").exists()  # no folder made, nothing trained


class _Server:
    """A TCP server on 127.0.0.1 answering every connection with ``answer`` (after reading what the client sends
    first), saying nothing (``None``) or closing it at once (``b""``); the server's ``port`` while in a ``with``
    block."""

    def __init__(self, answer: bytes | None) -> None:
        self.answer, self.socket = answer, socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen()
        self.port = self.socket.getsockname()[1]
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:  # closed
                return
            self.connections.append(connection)
            if self.answer == b"":  # closes the connection at once
                connection.close()
            elif self.answer is not None:
                connection.recv(64)
                connection.sendall(self.answer)

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc_info) -> None:
        for connection in [self.socket, *self.connections]:
            connection.close()


#: what a gRPC server sends first: a SETTINGS frame (9-byte header, type 4) with one setting
GRPC_ANSWER = bytes([0, 0, 6, 4, 0, 0, 0, 0, 0]) + bytes([0, 3, 0, 0, 0, 100])


def test_the_address_forms(monkeypatch):
    gcs = ray.get_runtime_context().gcs_address  # the module's Ray instance: a real cluster's GCS answers
    host, port = gcs.rsplit(":", 1)
    assert check_ray_address(gcs) == (host, int(port))
    with _Server(GRPC_ANSWER) as server:
        port = server.port
        assert check_ray_address(f"127.0.0.1:{port}") == ("127.0.0.1", port)
        assert check_ray_address(f"ray://127.0.0.1:{port}") == ("127.0.0.1", port)
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        assert check_ray_address("auto") == ("127.0.0.1", port)
    closed = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed}")
    with pytest.raises(RayUnavailableError, match=rf"^--ray-address auto \(127\.0\.0\.1:{closed}\): no Ray cluster"):
        check_ray_address("auto")
    with pytest.raises(RayUnavailableError, match=r"answers at 127\.0\.0\.1:10001 "):
        check_ray_address("ray://127.0.0.1")  # Ray Client's default port
    for malformed in ("http://head:6379", "head:port", ":6379"):
        with pytest.raises(ValueError, match="expected host:port, ray://host:port or auto"):
            check_ray_address(malformed)


def test_another_service_at_the_address_is_refused_before_ray_init_hangs_on_it(monkeypatch):
    """ray.init waits on a port where a web server listens (measured: more than 90 s); the check answers in well
    under a second, or after its timeout when the service says nothing."""
    with _Server(b"HTTP/1.0 400 Bad request\r\n\r\n") as web:
        start = time.perf_counter()
        with pytest.raises(RayUnavailableError) as refused:
            check_ray_address(f"127.0.0.1:{web.port}")
        assert time.perf_counter() - start < 2
        assert str(refused.value) == (
            f"--ray-address 127.0.0.1:{web.port}: the service at 127.0.0.1:{web.port} is not a Ray cluster (it "
            "answered b'HTTP/1.0 '; a cluster's GCS, port 6379 by default, and the Ray Client server, "
            "ray://host:10001, answer as gRPC servers); check the host and port"
        )
    with _Server(None) as silent:
        with pytest.raises(RayUnavailableError, match=r"is not a Ray cluster \(no gRPC answer within 0\.5 s, or it"):
            check_ray_address(f"127.0.0.1:{silent.port}", timeout=0.5)
        with _Server(b"") as closing, pytest.raises(RayUnavailableError, match=r"is not a Ray cluster \(no gRPC"):
            check_ray_address(f"127.0.0.1:{closing.port}", timeout=0.5)
        monkeypatch.setenv("RAY_USE_TLS", "1")  # the port speaks TLS first: only the connection is checked
        assert check_ray_address(f"127.0.0.1:{silent.port}", timeout=0.5) == ("127.0.0.1", silent.port)


def test_ray_address_without_the_ray_executor_is_a_bad_option(capsys):
    assert main(["compare", "--quick", "--ray-address", "127.0.0.1:6379"]) == 2
    assert "--ray-address needs --executor ray" in capsys.readouterr().err


def test_without_ray_the_ray_executor_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails, as without the extra
    assert main(["compare", "--quick", "--executor", "ray", "--out", str(tmp_path / "o")]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.endswith("pip install 'gpattn[ray]'\n")
    assert not (tmp_path / "o").exists()
