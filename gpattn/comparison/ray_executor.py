"""Runs and tuning trials as Ray tasks (:class:`RayExecutor`), on this machine or on a Ray cluster.

The executor has the interface of :class:`~gpattn.comparison.local_executor.LocalExecutor` (``submit``,
``next_result``, ``pending``, a ``with`` block): each call is one Ray task asking for the resources it needs
(``threads`` CPUs; with a CUDA device, ``1 / jobs`` of a GPU, so that ``jobs`` runs share each GPU as ``--jobs`` runs
share one GPU locally), retried once when it raises or its worker dies (Ray's ``max_retries=1`` and
``retry_exceptions=True``). Results come back to the calling process, which writes the records: the workers need no
shared file system, only gpattn installed.

Ray is an optional dependency (``pip install 'gpattn[ray]'``), imported by this module only when an executor starts.
Connecting to an address where no Ray cluster answers makes ``ray.init`` retry for minutes, and to a port where another
service listens (a web server, SSH) hang, so the address is checked first with one TCP connection that must answer as
a gRPC (HTTP/2) server, as a cluster's GCS and the Ray Client server do (:func:`check_ray_address`, a few seconds at
most).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Hashable, Iterator
from typing import Any
from urllib.parse import urlsplit

import torch

from ..validation import check_int
from .local_executor import TaskFailedError, deterministic_cuda

__all__ = ["CONNECT_TIMEOUT", "RayExecutor", "RayUnavailableError", "check_ray_address"]

#: Seconds that :func:`check_ray_address` waits for the cluster's port to answer.
CONNECT_TIMEOUT = 5.0
#: Default ports: a cluster's GCS (``ray start --head``) and the Ray Client server (``ray://``).
GCS_PORT, CLIENT_PORT = 6379, 10001
#: The start of an HTTP/2 connection (RFC 9113, section 3.4): the client's preface and an empty SETTINGS frame. A
#: gRPC server answers with its own SETTINGS frame (a 9-byte header whose fourth byte, the frame type, is 4).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


class RayUnavailableError(RuntimeError):
    """Ray is not installed, or no Ray cluster answers at the given address (the message says what to do)."""


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise RayUnavailableError(f"--executor ray needs Ray ({error}): pip install 'gpattn[ray]'") from None
    return ray


def _resolve_auto() -> str:
    """The address ``auto`` stands for: ``RAY_ADDRESS`` when set, else the cluster last started on this machine
    (``ray start``), as ``ray.init(address="auto")`` finds it."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    from ray._private.services import canonicalize_bootstrap_address

    try:
        found = canonicalize_bootstrap_address("auto")
    except ConnectionError:
        found = None
    if not found:
        raise RayUnavailableError(
            "--ray-address auto: no running Ray cluster found on this machine (start one with `ray start --head`, "
            "set RAY_ADDRESS, or leave --ray-address out to start a local Ray instance)"
        )
    return found


def check_ray_address(address: str, timeout: float = CONNECT_TIMEOUT) -> tuple[str, int]:
    """Check that a Ray cluster's port answers at ``address`` before ``ray.init`` (which retries an unreachable
    address for minutes, and hangs on a port where another service listens): one TCP connection, at most ``timeout``
    seconds to connect and ``timeout`` more for the answer to an HTTP/2 preface, which a gRPC server (a cluster's GCS,
    the Ray Client server) gives at once. With ``RAY_USE_TLS`` set the answer is not read (the port speaks TLS first).

    :param address: ``host[:port]`` (a cluster's GCS, port 6379 by default), ``ray://host[:port]`` (Ray Client, port
        10001 by default) or ``auto`` (``RAY_ADDRESS``, else the cluster started on this machine).
    :return: ``(host, port)`` that answered.
    :raises ValueError: ``address`` is not of one of these forms.
    :raises RayUnavailableError: Nothing answers there, or not as a gRPC server (or ``auto`` finds no cluster); one
        line, with what to do.
    """
    shown = address
    if address == "auto":
        address = _resolve_auto()
    client = address.startswith("ray://")
    if "://" in address and not client:
        raise ValueError(f"--ray-address: expected host:port, ray://host:port or auto, got {shown!r}")
    parts = urlsplit(address if client else f"//{address}")
    try:
        host, port = parts.hostname, parts.port or (CLIENT_PORT if client else GCS_PORT)
    except ValueError:  # a port that is not a number in 0-65535
        host = None
    if not host:
        raise ValueError(f"--ray-address: expected host:port, ray://host:port or auto, got {shown!r}")
    resolved = "" if shown == address else f" ({address})"
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            answer = None if _uses_tls() else _http2_answer(connection)
    except OSError as error:
        reason = "no answer" if isinstance(error, TimeoutError) else (error.strerror or str(error))
        raise RayUnavailableError(
            f"--ray-address {shown}{resolved}: no Ray cluster answers at {host}:{port} ({reason}, {timeout:g} s "
            "timeout); start one there with `ray start --head`, or leave --ray-address out to start a local Ray "
            "instance"
        ) from None
    if answer is not None and not (len(answer) == 9 and answer[3] == 4):
        said = (
            f"it answered {answer!r}" if answer else f"no gRPC answer within {timeout:g} s, or it closed the connection"
        )
        raise RayUnavailableError(
            f"--ray-address {shown}{resolved}: the service at {host}:{port} is not a Ray cluster ({said}; a cluster's "
            f"GCS, port {GCS_PORT} by default, and the Ray Client server, ray://host:{CLIENT_PORT}, answer as gRPC "
            "servers); check the host and port"
        )
    return host, port


def _uses_tls() -> bool:
    """Whether Ray connects with TLS (``RAY_USE_TLS``, as Ray reads it)."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def _http2_answer(connection: socket.socket) -> bytes:
    """Send the HTTP/2 preface on ``connection`` and return the first 9 bytes of the answer (fewer when the peer
    closes the connection or says nothing before its timeout)."""
    answer = b""
    try:
        connection.sendall(_HTTP2_PREFACE)
        while len(answer) < 9:
            chunk = connection.recv(9 - len(answer))
            if not chunk:
                break
            answer += chunk
    except (TimeoutError, ConnectionError):  # no answer in time, or the peer closed (reset, broken pipe)
        pass
    return answer


def _call(threads: int, device: str, fn: Callable[..., Any], *args: Any) -> Any:
    """A Ray task: ``fn(*args)`` with ``threads`` torch threads and, on CUDA, deterministic kernels (as in a local
    worker process; Ray assigns the GPU, the device is ``cuda``)."""
    torch.set_num_threads(threads)
    deterministic_cuda(device)
    return fn(*args)


class RayExecutor:
    """Calls as Ray tasks: on a new local Ray instance of ``jobs * threads`` CPUs (no ``address``), or on the cluster
    at ``address``, or on the Ray instance this process already joined (``ray.init`` called before; it is left
    running). The address is checked (:func:`check_ray_address`) when the executor is made, before anything runs.

    :param jobs: Calls at the same time on a local instance (its CPUs are ``jobs * threads``); with a CUDA device,
        calls sharing each GPU. On a cluster its resources decide how many run at once.
    :param threads: Torch threads per call, and the CPUs each Ray task asks for.
    :param device: ``"cpu"`` or ``"cuda"`` (Ray assigns the GPU: an index is refused).
    :param address: A Ray cluster (:func:`check_ray_address`), or ``None`` for a local instance.
    :raises RayUnavailableError: Ray is not installed, or nothing answers at ``address``.
    :raises ValueError: A malformed address, or a device with an index; ``jobs`` or ``threads`` not a positive
        integer (a bool, a float, zero), naming it.
    """

    def __init__(self, jobs: int = 1, threads: int = 1, device: str = "cpu", address: str | None = None) -> None:
        target = torch.device(device)
        if target.type == "cuda" and target.index is not None:
            raise ValueError(f"--executor ray: expected --device cuda (Ray assigns each task its GPU), got {device!r}")
        self.ray = _import_ray()
        if address is not None:
            check_ray_address(address)
        self.jobs = check_int("jobs", jobs, where="RayExecutor")
        self.threads = check_int("threads", threads, where="RayExecutor")
        self.device, self.address = device, address
        self._started = False
        self._remote: Any = None
        self._refs: dict[Any, Hashable] = {}

    @property
    def pending(self) -> int:
        """Calls submitted and not yet returned by :meth:`next_result`."""
        return len(self._refs)

    @property
    def capacity(self) -> int:
        """How many calls can run at once: ``jobs`` on a local instance, the cluster's CPUs over ``threads`` on a
        cluster (at least 1)."""
        if self.address is None and self._started:
            return self.jobs
        return max(1, int(self.ray.cluster_resources().get("CPU", 1)) // self.threads)

    def __enter__(self) -> RayExecutor:
        ray = self.ray
        if not ray.is_initialized():
            options = dict(include_dashboard=False, logging_level=logging.WARNING)
            if self.address is None:  # "local": a new instance even when RAY_ADDRESS is set
                ray.init(address="local", num_cpus=self.jobs * self.threads, **options)
            else:
                ray.init(address=self.address, **options)
            self._started = True
        gpus = 1.0 / self.jobs if torch.device(self.device).type == "cuda" else 0
        self._remote = ray.remote(_call).options(
            num_cpus=self.threads, num_gpus=gpus, max_retries=1, retry_exceptions=True
        )
        return self

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        """Submit ``fn(*args)`` under ``key`` as a Ray task (``fn`` and ``args`` are pickled)."""
        self._refs[self._remote.remote(self.threads, self.device, fn, *args)] = key

    def next_result(self) -> tuple[Hashable, Any]:
        """Wait for a task to finish and return ``(key, result)``.

        Of the tasks finished by then, those that returned come before one that failed: the caller keeps their
        results before the failure stops it.

        :raises TaskFailedError: The task failed twice (the error it raised, or the death of its worker).
        :raises RuntimeError: No task is pending.
        """
        if not self._refs:
            raise RuntimeError("RayExecutor.next_result: no task is pending (submit one first)")
        ray = self.ray
        ray.wait(list(self._refs), num_returns=1)
        failure = None
        for ref, result, error in self._finished_now():
            if error is None:
                return self._refs.pop(ref), result
            failure = failure or (ref, error)
        ref, error = failure
        key = self._refs.pop(ref)
        if isinstance(error, ray.exceptions.RayTaskError):
            cause = error.cause if isinstance(error.cause, BaseException) else error
            raise TaskFailedError(key, cause) from None
        # the worker died (twice), the node was lost, ...
        raise TaskFailedError(key, RuntimeError(" ".join(str(error).split()))) from None

    def finished_results(self) -> list[tuple[Hashable, Any]]:
        """``(key, result)`` of every task that has returned and was not yet handed back by :meth:`next_result`,
        without waiting; they leave :attr:`pending` (after Ctrl-C the caller keeps them before the tasks in flight are
        cancelled). Tasks that failed or still run are left."""
        returned = [(ref, result) for ref, result, error in self._finished_now() if error is None]
        return [(self._refs.pop(ref), result) for ref, result in returned]

    def _finished_now(self) -> Iterator[tuple[Any, Any, BaseException | None]]:
        # (ref, result, None) or (ref, None, error) of each pending task finished by now, read one at a time (nothing
        # popped: the callers decide which leave the pending ones)
        if not self._refs:
            return
        ray = self.ray
        finished, _ = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        for ref in finished:
            try:
                yield ref, ray.get(ref), None
            except ray.exceptions.RayError as error:
                yield ref, None, error

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        refs, self._refs = list(self._refs), {}
        for ref in refs:  # Ctrl-C or a failed call: stop the tasks in flight
            self.ray.cancel(ref, force=True)
        if self._started:
            self.ray.shutdown()
            self._started = False
