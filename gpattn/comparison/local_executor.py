"""Where the comparison's runs execute on this machine (:class:`LocalExecutor`): in this process or in worker processes.

An *executor* is the small strategy object that :func:`~gpattn.comparison.execute_runs` hands its runs to; this one
and :class:`~gpattn.comparison.ray_executor.RayExecutor` share one interface:

* ``with executor:`` starts it (and stops the calls in flight when the block ends by an error or Ctrl-C);
* ``executor.submit(key, fn, *args)`` queues the call ``fn(*args)`` (``fn`` and ``args`` picklable);
* ``executor.next_result()`` waits for a call to finish and returns ``(key, result)``, or raises
  :class:`TaskFailedError` naming the call's ``key``;
* ``executor.pending`` is the number of calls submitted and not yet returned by ``next_result``.

Every process that runs calls uses ``threads`` torch threads and, on CUDA, deterministic kernels
(:func:`worker_environment`), so that a call gives the same result in any process.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any

import torch

from ..validation import check_int

__all__ = ["LocalExecutor", "TaskFailedError", "deterministic_cuda", "torch_threads", "worker_environment"]

QUIET_TRACKER = "ignore:resource_tracker:UserWarning"


class TaskFailedError(RuntimeError):
    """A call submitted to an executor raised (or its worker died): ``key`` is the call's key, ``cause`` the error.

    :ivar stopped: The keys of every call the failure stopped, ``key`` first: ``(key,)`` for a call that raised; for a
        worker process that died, every call that was in its pool (the pool cannot tell whose process it was: each
        of them was running or waiting to run there, and none returned).
    """

    def __init__(self, key: Hashable, cause: BaseException, stopped: tuple[Hashable, ...] = ()) -> None:
        super().__init__(f"{key}: {cause}")
        self.key, self.cause = key, cause
        self.stopped = (key, *(other for other in stopped if other != key))


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block, the previous count restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def deterministic_cuda(device: str) -> bool:
    """On a CUDA device: deterministic kernels (cuBLAS with a fixed workspace, set before the process's first cuBLAS
    call; PyTorch's deterministic algorithms, with a warning for an operator that has none) and the run's device made
    current, so that a run gives the same record in any process, alone or beside others on the GPU. The parent of the
    workers never touches CUDA (spawned workers start without its state). Returns whether it changed anything."""
    target = torch.device(device)
    if target.type != "cuda":
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if target.index is not None:
        torch.cuda.set_device(target)
    return True


@contextmanager
def worker_environment(threads: int, device: str) -> Iterator[None]:
    """The settings of the calls in this process, the previous ones restored after the block: ``threads`` torch
    threads and, on CUDA, deterministic kernels (as in every worker process)."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with torch_threads(threads):
        changed = deterministic_cuda(device)
        try:
            yield
        finally:
            if changed:
                torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _start_worker(threads: int, device: str) -> None:
    # Ctrl-C goes to the whole process group: the parent alone handles it (and stops the workers), so that a worker
    # prints no traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    deterministic_cuda(device)


class LocalExecutor:
    """Calls on this machine: one after the other in this process (``jobs == 1``, or a single call) or ``jobs`` at
    once in worker processes (``spawn`` start method; as many as there are calls when fewer), each with ``threads``
    torch threads. A call's result depends on its arguments and the thread count only, not on ``jobs``.

    :param jobs: Calls at the same time (worker processes): a positive integer.
    :param threads: Torch threads per call: a positive integer.
    :param device: ``"cpu"`` or ``"cuda[:index]"``: on CUDA, deterministic kernels in every process.
    :raises ValueError: ``jobs`` or ``threads`` is not a positive integer (a bool, a float, zero), naming it.
    """

    def __init__(self, jobs: int = 1, threads: int = 1, device: str = "cpu") -> None:
        self.jobs = check_int("jobs", jobs, where="LocalExecutor")
        self.threads = check_int("threads", threads, where="LocalExecutor")
        self.device = device
        self._queued: list[tuple[Hashable, Callable[..., Any], tuple]] = []
        self._futures: dict[concurrent.futures.Future, Hashable] = {}
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    @property
    def pending(self) -> int:
        """Calls submitted and not yet returned by :meth:`next_result`."""
        return len(self._queued) + len(self._futures)

    def __enter__(self) -> LocalExecutor:
        return self

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` under ``key`` (in a worker process once the pool runs)."""
        if self._pool is not None:
            self._futures[self._pool.submit(fn, *args)] = key
        else:
            self._queued.append((key, fn, args))

    def next_result(self) -> tuple[Hashable, Any]:
        """Wait for a call to finish (in this process: run the next one) and return ``(key, result)``.

        Of the calls finished at the same time, those that returned come before one that raised: the caller keeps
        their results before the failure stops it.

        :raises TaskFailedError: The call raised an ``Exception`` (Ctrl-C propagates as it is).
        :raises RuntimeError: No call is pending.
        """
        if not self.pending:
            raise RuntimeError("LocalExecutor.next_result: no call is pending (submit one first)")
        if self._pool is None and self.jobs > 1 and len(self._queued) > 1:
            self._start_pool()
        if self._pool is None:
            key, fn, args = self._queued.pop(0)
            with worker_environment(self.threads, self.device):
                try:
                    return key, fn(*args)
                except Exception as error:
                    raise TaskFailedError(key, error) from error
        done, _ = concurrent.futures.wait(self._futures, return_when=concurrent.futures.FIRST_COMPLETED)
        # a call that returned first: a failure found beside it would otherwise stop the executor and lose its result
        future = min(done, key=lambda finished: finished.exception() is not None)
        in_pool = list(self._futures.values())  # in submission order
        key = self._futures.pop(future)
        try:
            return key, future.result()
        except BrokenProcessPool as error:
            # a worker process died (killed, e.g. for memory, or crashed): every call of the pool ends with this
            # error, and which one's process it was is not known: all of them are named (in submission order), not
            # the first one met
            raise TaskFailedError(in_pool[0], error, stopped=tuple(in_pool)) from error
        except Exception as error:
            raise TaskFailedError(key, error) from error

    def finished_results(self) -> list[tuple[Hashable, Any]]:
        """``(key, result)`` of every call that has returned and was not yet handed back by :meth:`next_result`,
        without waiting; they leave :attr:`pending`. After Ctrl-C the caller keeps them before the calls in flight are
        stopped (a run that finished just before the signal). Calls that raised or still run are left."""
        returned = [future for future in self._futures if future.done() and not future.cancelled()]
        returned = [future for future in returned if future.exception() is None]
        return [(self._futures.pop(future), future.result()) for future in returned]

    def _start_pool(self) -> None:
        # multiprocessing's resource tracker starts with this interpreter's -W options: after Ctrl-C it would warn
        # about the pool's locks of the stopped workers (which it then unlinks itself), a traceback-like message for
        # nothing
        if QUIET_TRACKER not in sys.warnoptions:
            sys.warnoptions.append(QUIET_TRACKER)
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=min(self.jobs, len(self._queued)),
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(self.threads, self.device),
        )
        queued, self._queued = self._queued, []
        for key, fn, args in queued:
            self.submit(key, fn, *args)

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        pool, self._pool = self._pool, None
        self._queued, self._futures = [], {}
        if pool is None:
            return
        if exc_type is None:
            pool.shutdown(wait=True)
            return
        # Ctrl-C or a failed call: stop the calls in flight, start no other
        processes = list((getattr(pool, "_processes", None) or {}).values())
        # shutdown(wait=False) forgets the pool's manager thread without joining it, and the second shutdown then
        # cannot join it either: left running, it closed its wake-up pipe while concurrent.futures' exit handler
        # wrote to it (an OSError traceback at the interpreter's exit after Ctrl-C)
        manager = getattr(pool, "_executor_manager_thread", None)
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=10)
        if manager is not None:
            manager.join(timeout=10)  # it sees the stopped workers, marks the pool broken and ends
        pool.shutdown(wait=True)  # the pool, broken now, releases its queues (no leaked semaphore)
