"""The backend the entry point names, and the driver's side of one remote instance.

`RayBackend.load` connects to Ray (or starts a local one), creates an async
actor with the instance's resources and placement, has it build its ONNX
Runtime session, and hands back a `RayInstance`, which sends each batch to
the actor with the batch's remaining time and waits for the answer without
blocking the event loop.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import ipaddress
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, final

import anyio
import numpy as np

from trioinfer import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    DeadlineExceeded,
    ModelConfig,
    ModelSignature,
    TrioInferError,
)
from trioinfer.lowlevel import (
    Placement,
    current_batch_deadline,
    current_trace_context,
    record_span,
    wait_on_callback,
)

from . import _codec
from ._actor import ModelActor, clock_id
from ._options import DEFAULT_START_TIMEOUT_S, RayOptions, address_problem, check_options

log = logging.getLogger("trioinfer.ray")

#: Seconds ``aclose`` gives an actor to close its session before it is killed anyway.
CLOSE_TIMEOUT_S: Final = 2.0

_connect_lock = threading.Lock()
_actor_class: Any = None


#: How to get Ray, said where it is missing.
_INSTALL_RAY: Final = (
    "install trioinfer with the 'ray' extra (and cpu or gpu), e.g. pip install -e "
    "'.[ray,cpu]' in a clone"
)
_NO_RAY: Final = f"Ray is not installed: {_INSTALL_RAY}"


def _ray() -> Any:
    # Imported on first use: Ray is an extra, and importing it takes a second.
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise BackendUnavailable(
            f"the ray backend needs Ray, which does not import here ({exc}): {_INSTALL_RAY}"
        ) from exc


def connect(address: str | None, timeout: float = DEFAULT_START_TIMEOUT_S) -> None:
    """Connect this process to Ray once: to *address*, or to a local Ray on 127.0.0.1.

    Blocking (starting a local Ray takes seconds): call it off the event loop.
    A process already connected keeps its connection, whatever *address* says.
    An address of the form ``host:port`` (or ``ray://host:port``, or
    ``"auto"`` where ``RAY_ADDRESS`` names one, or where the last
    ``ray start --head`` on this machine noted one) is tried first with a plain
    TCP connection of at most *timeout* seconds, and what answers must speak
    gRPC (HTTP/2), as Ray's GCS and Ray Client servers do: where nothing
    listens, or something else does (an HTTP server, a port that accepts and
    says nothing), ``ray.init`` would retry for minutes before it gives up.

    Raises:
        BackendUnavailable: Ray is not installed, nothing answers at
            *address* (or something that is not Ray does), or Ray refused the
            connection (or failed to start).
    """
    ray = _ray()
    with _connect_lock:
        if ray.is_initialized():
            return
        if address is None:
            # A cluster of our own making: this machine only, and no reports home.
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            log.info("starting a local Ray on 127.0.0.1 for the ray backend")
            try:
                ray.init(
                    address="local",
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    log_to_driver=False,
                    configure_logging=False,
                )
            except Exception as exc:
                raise BackendUnavailable(
                    f"could not start a local Ray: {type(exc).__name__}: {exc}"
                ) from exc
            return
        _probe(address, timeout)
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except Exception as exc:
            raise BackendUnavailable(
                f"could not connect to the Ray cluster at {address!r}: {type(exc).__name__}: {exc}"
            ) from exc


def _probe(address: str, timeout: float) -> None:
    # Only host:port addresses, and "auto" where it resolves to one as ray.init resolves
    # it: RAY_ADDRESS first, else the address the last `ray start --head` noted (which
    # a head that died without `ray stop` leaves behind: ray.init retried it for ten
    # minutes). Otherwise "auto" is looked up by Ray itself, which fails at once.
    shown = address  # as the errors name it
    if address == "auto":
        address = shown = os.environ.get("RAY_ADDRESS", "")
        problem = address_problem(address)
        if problem is not None:
            raise BackendUnavailable(f"address 'auto' takes RAY_ADDRESS, and {problem}")
        if not address:
            address, note = _noted_address()
            shown = f"{address} (noted in {note} by the last 'ray start --head' on this machine)"
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    hint = (
        "is the cluster's head node running (ray start --head), and is this its address "
        "(host:6379 for its GCS, ray://host:10001 for Ray Client)?"
    )
    target = host if address.startswith("ray://") else _ray_host(host)
    if target != host:
        # ray.init connects to a GCS at a loopback address through the machine's own
        # address: a head started with --node-ip-address 127.0.0.1 (or under
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) is not there, and ray.init retried it
        # for ten minutes.
        hint = (
            f"Ray connects to {host} through this machine's address, {target}; a head "
            "started with --node-ip-address 127.0.0.1 or RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 "
            "listens on loopback alone: set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in this "
            "process's environment too, or start the head on the machine's address"
        )
        host = target
    try:
        connection = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except OSError as exc:
        raise BackendUnavailable(
            f"no Ray at {shown}: connecting to {host}:{port} failed ({exc}); {hint}"
        ) from exc
    with connection:
        if _tls():
            return  # a TLS handshake first: left to ray.init, which has the certificates
        wait = min(timeout, _HANDSHAKE_S)
        try:
            connection.settimeout(wait)
            connection.sendall(_H2_PREFACE)
            first = _read_frame_header(connection)
        except TimeoutError:
            raise BackendUnavailable(
                f"no Ray at {shown}: {host}:{port} accepted the connection but sent "
                f"nothing in {wait:g} s, where Ray's gRPC server answers at once; {hint}"
            ) from None
        except OSError as exc:
            raise BackendUnavailable(
                f"no Ray at {shown}: {host}:{port} accepted the connection, then failed "
                f"({exc}); {hint}"
            ) from exc
    if len(first) < _FRAME_HEADER or first[3] != _SETTINGS:
        said = f"answered {first[:24]!r}" if first else "closed the connection unanswered"
        raise BackendUnavailable(
            f"no Ray at {shown}: {host}:{port} {said}, which is not gRPC (HTTP/2), as "
            f"Ray's GCS and Ray Client servers speak; another server listens there; {hint}"
        )


def _ray_host(host: str) -> str:
    # The host ray.init connects to for a GCS address's *host*: Ray's own rule, which
    # swaps a loopback host for the machine's address unless Ray keeps to loopback
    # (then *host* itself: the probe of the address as given stands).
    try:
        services = importlib.import_module("ray._private.services")
        target = str(services.resolve_ip_for_localhost(host.strip("[]")))
        if ipaddress.ip_address(target).is_loopback:
            return host
    except Exception:  # another Ray's internals, or no address: probe the host as given
        return host
    return target


def _noted_address() -> tuple[str, str]:
    # The address `ray start --head` noted for "auto" (Ray's own lookup, so that the
    # probe tries the address ray.init will), and the file it is in; ("", "") if none.
    try:
        utils = importlib.import_module("ray._private.utils")
        return utils.read_ray_address(None) or "", str(utils.get_ray_address_file(None))
    except Exception:  # another Ray's internals: ray.init is left to find it
        return "", ""


#: The HTTP/2 client preface and an empty SETTINGS frame: a gRPC server answers it
#: (Ray's GCS sends its SETTINGS even unasked) with a SETTINGS frame of its own.
_H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_FRAME_HEADER: Final = 9
_SETTINGS: Final = 0x04
#: At most this long for the server's first frame: a gRPC server sends it at once, and
#: a port that accepts and says nothing would otherwise hold the load for the whole
#: start_timeout (60 s by default).
_HANDSHAKE_S: Final = 10.0


def _read_frame_header(connection: socket.socket) -> bytes:
    # The first 9 bytes the server sends (fewer if it closes first); TimeoutError if
    # they do not come in time.
    data = b""
    while len(data) < _FRAME_HEADER:
        chunk = connection.recv(_FRAME_HEADER - len(data))
        if not chunk:
            break
        data += chunk
    # An HTTP/1 server answers with text: a little more of it says what it is.
    if data[:4] == b"HTTP":
        connection.settimeout(0.5)
        with contextlib.suppress(OSError):
            data += connection.recv(64)
    return data


def _tls() -> bool:
    # Ray's own switch for TLS between its processes (gRPC over TLS).
    return os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true")


def _actor() -> Any:
    global _actor_class
    if _actor_class is None:
        _actor_class = _ray().remote(ModelActor)
    return _actor_class


async def wait_ref(ref: Any, *, abort: Callable[[], object] | None = None) -> Any:
    """Wait for a Ray ObjectRef without blocking the event loop, and return its value.

    Ray completes the ref's future on one of its own threads, and the
    callback wakes the event loop (Trio's token or asyncio's
    ``call_soon_threadsafe``). When the waiting task is cancelled, *abort* is
    called (``ray.cancel(ref)`` by default), the ref's outcome is still waited
    for, and then the cancellation propagates: nothing is left running.

    The ref is let go when the wait ends: an error raised here keeps this
    frame alive (in a traceback, or a cycle that waits for the garbage
    collector), and must not keep the ref's object pinned in Ray meanwhile.

    Raises:
        Exception: What ``ray.get`` would raise.
    """
    ray = _ray()
    held = [ref]
    del ref

    def start(resolve: Callable[[Any, BaseException | None], None]) -> None:
        def done(future: Any) -> None:
            # The error is read, not raised: raised here, its traceback would hold this
            # frame, the future and its ref in a cycle until the garbage collector ran.
            try:
                error = future.exception()
            except BaseException as exc:  # the future itself was cancelled
                resolve(None, exc)
                return
            if error is None:
                resolve(future.result(), None)
            else:
                resolve(None, error)

        held[0].future().add_done_callback(done)

    def cancel() -> None:
        if held:
            ray.cancel(held[0])

    try:
        return await wait_on_callback(start, abort=abort or cancel)
    finally:
        held.clear()


def remote_error(exc: BaseException, label: str) -> BaseException:
    """Turn what a call on an actor raised into the engine's error for it.

    The actor's own errors come back as they are (a ``DeadlineExceeded`` it
    refused with, a ``BackendError`` from ONNX Runtime); an actor, worker or
    node that is gone becomes ``BackendUnavailable``, which the circuit
    breaker treats as a dead instance; other Ray errors, ``BackendError``.
    """
    ray = _ray()
    errors = ray.exceptions
    if isinstance(exc, errors.RayTaskError):
        cause = exc.cause
        if isinstance(cause, TrioInferError):
            return cause
        return BackendError(f"{label} failed: {type(cause).__name__}: {cause}")
    if _is_gone(exc):
        # Ray's message: a headline, the actor's details (indented: class, id,
        # namespace, pid) and then why it died ("its node has died", "it was
        # cancelled before it started running", ...). The why is what tells an
        # operator a lost node from a driver the cluster would not talk to.
        lines = [line.strip() for line in str(exc).splitlines() if line[:1] not in ("\t", " ")]
        text = " ".join(line for line in lines if line)
        return BackendUnavailable(f"{label} is gone ({type(exc).__name__}): {text}")
    return BackendError(f"{label} failed: {type(exc).__name__}: {exc}")


def _is_gone(exc: BaseException) -> bool:
    # Whether *exc* says the actor, its worker or its node is gone (Ray's own errors).
    errors = _ray().exceptions
    gone = (
        errors.RayActorError,
        errors.NodeDiedError,
        errors.WorkerCrashedError,
        errors.ObjectLostError,
        errors.OwnerDiedError,
        errors.LocalRayletDiedError,
    )
    return isinstance(exc, gone)


@final
class RayBackend:
    """Loads each instance of a model into an async Ray actor on a cluster node."""

    __slots__ = ()

    @staticmethod
    def missing_requirements() -> str | None:
        """Ray, if it is not installed here (for ``trioinfer plugins``); else None.

        Looks Ray up without importing it, which takes a second.
        """
        if importlib.util.find_spec("ray") is None:
            return _NO_RAY
        return None

    async def load(self, config: ModelConfig, placement: Placement) -> RayInstance:
        """Create the instance's actor where its options place it, and its session there.

        Raises:
            ConfigError: Unknown or invalid ``backend_options`` (by their own
                checks, or Ray's when it makes the actor), or a Python model's
                file (``.py``: the actors run ONNX models).
            BackendUnavailable: Ray is not installed, the cluster at ``address``
                does not answer (or refuses this driver), or no node took the
                actor (or loaded the model) within ``start_timeout``.
            BackendError: The model could not be loaded on the node (the message
                names the node: a model file missing there, say).
        """
        options = check_options(config, placement)
        path = config.model_file("the .onnx file its actors load")
        if path.suffix == ".py":  # on the node, ONNX Runtime's "Protobuf parsing failed"
            raise ConfigError(
                f"model {config.name!r}: the ray backend runs ONNX models (an ONNX Runtime "
                f"session in each actor), and {path} is a Python model: serve it with "
                "backend = 'python', in this process"
            )
        if options.address is None and "ray" not in sys.modules:
            # A Ray we may start ourselves: Ray reads this when imported, and then
            # runs every process of it on 127.0.0.1 alone.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        _ray()  # say which extra is missing before anything else
        label = f"model {config.name!r} instance {placement.index} (ray)"
        sigterm = _python_sigterm()
        try:
            await anyio.to_thread.run_sync(connect, options.address, options.start_timeout)
        except BackendUnavailable as exc:
            raise BackendUnavailable(f"{label}: {exc}") from exc
        finally:
            _restore_sigterm(sigterm)
        model_bytes = None
        if options.ship_model:
            try:
                model_bytes = await anyio.Path(path).read_bytes()
            except OSError as exc:
                raise BackendError(f"{label}: cannot read {path}: {exc}") from exc
        try:
            actor = _create_actor(options)
        except ValueError as exc:  # Ray's own checks of the amounts asked for
            raise ConfigError(
                f"model {config.name!r}: Ray refuses the ray backend options "
                f"({_asks(options)}): {exc}"
            ) from exc
        # No CPU pinning on a node this process does not know; everything else as asked.
        remote_placement = Placement(
            placement.device,
            placement.index,
            placement.threads,
            None,
            placement.cpu_fallback,
            placement.capacity,
        )
        ref = actor.load.remote(
            config.name,
            str(path),
            model_bytes,
            options.ort_options,
            config.batcher,
            dict(config.batcher_options),
            remote_placement,
            options.codec,
            clock_id(),
        )
        ray = _ray()
        try:
            with anyio.fail_after(options.start_timeout):
                # Killing the actor ends a load that cannot be placed (no node has the
                # resources), which a cancel of its pending call would not.
                info = await wait_ref(ref, abort=lambda: ray.kill(actor))
        except TimeoutError:
            del ref  # not pinned by this frame, which the traceback keeps
            raise BackendUnavailable(
                f"{label}: no Ray node took the actor and loaded the model within "
                f"{options.start_timeout:g}s (it asks for {_asks(options)})"
            ) from None
        except BaseException as exc:
            del ref
            ray.kill(actor)
            if isinstance(exc, Exception):
                raise remote_error(exc, label) from exc
            raise
        log.info(
            "%s: actor on node %s (%s), device %s",
            label,
            info["node_id"],
            info["node_ip"],
            info["device"],
        )
        instance = RayInstance(actor, info, options, label, config.name)
        instance._watch(actor.watch.remote())
        return instance


def _python_sigterm() -> Any:
    # The process's Python-level SIGTERM handler (a server's graceful stop), where this
    # thread may read and set it (the main thread), else None.
    if threading.current_thread() is not threading.main_thread():
        return None
    handler = signal.getsignal(signal.SIGTERM)
    return handler if callable(handler) else None


def _restore_sigterm(handler: Any) -> None:
    # ray.init installs Ray's crash handler for SIGTERM in the driver (absl's): it
    # prints "*** SIGTERM received ..." with a stack, and the process that then stops
    # gracefully through its own handler aborts at exit (status 134, not 0). A process
    # that handles SIGTERM itself gets its handler back; crash signals keep Ray's.
    if handler is not None:
        signal.signal(signal.SIGTERM, handler)


def _create_actor(options: RayOptions) -> Any:
    strategy: Any = "DEFAULT"
    if options.node_id is not None:
        scheduling = importlib.import_module("ray.util.scheduling_strategies")
        strategy = scheduling.NodeAffinitySchedulingStrategy(options.node_id, soft=False)
    return (
        _actor()
        .options(
            num_cpus=options.num_cpus,
            num_gpus=options.num_gpus,
            resources=options.resources,
            scheduling_strategy=strategy,
            # A dead actor is replaced by the engine (the circuit breaker re-creates
            # its instance), never behind its back by Ray with a fresh session.
            max_restarts=0,
            max_task_retries=0,
        )
        .remote()
    )


def _asks(options: RayOptions) -> str:
    parts = [f"num_cpus={options.num_cpus:g}", f"num_gpus={options.num_gpus:g}"]
    parts += [f"{name}={amount:g}" for name, amount in options.resources.items()]
    if options.node_id is not None:
        parts.append(f"node {options.node_id}")
    return ", ".join(parts)


@final
class RayInstance:
    """One model instance held by a Ray actor on a cluster node.

    Its ``device`` names the node: ``"cpu@<node id>"`` (the first 12 hex digits),
    so that statistics and metrics show which node serves each instance.
    """

    __slots__ = (
        "_actor",
        "_codec",
        "_device",
        "_gone",
        "_label",
        "_model",
        "_signature",
        "_watching",
        "node_id",
        "node_ip",
        "pid",
        "pipeline_depth",
        "preferred_batch_sizes",
        "round_trip",
    )

    def __init__(
        self, actor: Any, info: Mapping[str, Any], options: RayOptions, label: str, model: str
    ) -> None:
        self._actor: Any = actor
        self._model = model
        self._codec = options.codec
        self._signature: ModelSignature = info["signature"]
        self._device = f"{info['device']}@{info['node_id'][:12]}"
        self._label = label
        self._gone: str | None = None
        # The actor's pending ModelActor.watch call, whose failure says it died.
        self._watching: Any = None
        #: The Ray node id (hex) of the node the actor runs on.
        self.node_id: str = info["node_id"]
        #: That node's IP address.
        self.node_ip: str = info["node_ip"]
        #: The actor's process id on that node.
        self.pid: int = info["pid"]
        #: Batches the engine may have in flight on this actor at once
        #: (the ``onnxruntime`` option ``pipeline_depth``).
        self.pipeline_depth: int = options.pipeline_depth
        #: The remote instance's preferred batch sizes (when tuned).
        self.preferred_batch_sizes: tuple[int, ...] = tuple(info["preferred_batch_sizes"])
        #: The least seconds a call answered by the actor spent outside it, there and
        #: back (from sending to its answer here, less the time the actor held it: a
        #: span on each side's clock, so none needs the other's; a call the actor
        #: refused as too late counts whole, so that a long first trip cannot refuse
        #: every later batch); ``inf`` before the first answer. Each batch carries it:
        #: an actor whose clock is not this machine's takes it off the batch's time left.
        self.round_trip: float = math.inf

    @property
    def signature(self) -> ModelSignature:
        """The model's inputs and outputs, as the remote session reports them."""
        return self._signature

    @property
    def device(self) -> str:
        """The remote device and node, e.g. ``"cpu@3f1c0a9be2d4"``."""
        return self._device

    @property
    def actor(self) -> Any:
        """The Ray actor handle (``None`` once closed)."""
        return self._actor

    @property
    def gone(self) -> str | None:
        """Why the actor can serve no more (it, its process or its node died), or None.

        Known as soon as Ray fails the actor's pending `ModelActor.watch` call
        (or a batch sent to it), with no batch needed: the engine then reports
        the instance out of service and, with no other instance serving, the
        model not ready; it sends the instance no more batches. Ray does not
        restart the actor (``max_restarts=0``): the ``resilient`` fallback with
        a breaker re-creates the instance, else loading the model again does.
        """
        return self._gone

    def _watch(self, ref: Any) -> None:
        # The actor's watch() call: it ends when the actor closes, and fails when it dies.
        self._watching = ref

        def done(future: Any) -> None:  # on one of Ray's threads
            try:
                error = future.exception()
            except BaseException as exc:  # the future itself was cancelled
                error = exc
            if error is not None:
                self._lost(error)

        ref.future().add_done_callback(done)

    def _lost(self, error: BaseException) -> None:
        # Note why the actor is gone, where *error* says it is (and it was not closed).
        if self._gone is None and self._actor is not None and _is_gone(error):
            lost = remote_error(error, f"{self._label} on node {self.node_id[:12]}")
            self._gone = str(lost)
            log.warning("%s", lost)

    async def execute(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        """Send one batch to the actor with its remaining time, and wait for its outputs.

        The time left is measured as the call leaves, with the time it leaves
        on this process's monotonic clock: an actor on this machine counts
        its deadline from then (the hop included), one elsewhere from when it
        takes the call, less `round_trip` (the least time a call spent on
        the way there and back). A caller that
        leaves cancels the remote call (``ray.cancel``), which aborts the ONNX
        Runtime run there, or drops the call unrun where it waits in the
        actor; the call's end is waited for.

        Raises:
            BackendUnavailable: The actor or its node is gone.
            DeadlineExceeded: The batch's deadline passed before the actor got to
                it: nothing was computed.
            BackendError: The remote run failed.
        """
        actor = self._actor
        if actor is None:
            raise BackendError(f"{self._label} is closed")
        deadline = current_batch_deadline()
        sent = time.monotonic()
        remaining = deadline - anyio.current_time() if deadline != math.inf else math.inf
        allowance = self.round_trip if self.round_trip != math.inf else 0.0
        payload = _codec.encode(inputs) if self._codec else inputs
        # A traced batch carries its trace context to the actor, which sends its times back.
        trace_context = current_trace_context()
        timings: Mapping[str, Any] | None = None
        try:
            if not trace_context:
                outputs, held = await wait_ref(
                    actor.execute.remote(payload, remaining, sent, allowance)
                )
            else:
                outputs, timings = await wait_ref(
                    actor.execute_traced.remote(payload, remaining, trace_context, sent, allowance)
                )
                held = timings["held"]
        except Exception as exc:
            self._lost(exc)
            error = remote_error(exc, f"{self._label} on node {self.node_id[:12]}")
            if isinstance(error, DeadlineExceeded):
                # Refused uncomputed: the whole call is a round trip (and the little the
                # actor held it), so it bounds the least one. Without it, a first trip
                # measured long (a cold actor, a busy driver) was taken off every later
                # batch: each with less time than that was refused, and none answered to
                # measure a shorter trip, for as long as the instance lived.
                self._trip(time.monotonic() - sent)
                raise error from None
            raise error from exc
        self._trip(time.monotonic() - sent - held)
        if timings is not None:
            try:
                self._record(trace_context, timings)
            except Exception:
                # A batch computed is answered: a tracing fault must not fail it (nor
                # count against the instance); it is logged.
                log.exception("%s: could not record the remote spans", self._label)
        return _codec.decode(outputs) if self._codec else outputs

    def _trip(self, seconds: float) -> None:
        # A call's time outside the actor, there and back: `round_trip` is the least seen.
        if 0 <= seconds < self.round_trip:
            self.round_trip = seconds

    def _record(self, parent: Mapping[str, str], timings: Mapping[str, Any]) -> None:
        # The actor's times (its node's clock) as children of the compute span:
        # the call in the actor, its wait for the session, and the ONNX Runtime run.
        node = {
            "trioinfer.ray.node_id": self.node_id,
            "trioinfer.ray.node_ip": self.node_ip,
            "trioinfer.ray.pid": self.pid,
        }
        remote = record_span(
            f"ray actor {self._model}",
            timings["received"],
            timings["replied"],
            parent,
            {**node, "trioinfer.ray.in_flight": timings["in_flight"]},
        )
        if timings["queued"]:
            record_span(
                f"actor queue {self._model}", timings["received"], timings["run_start"], remote
            )
        record_span(
            f"onnxruntime {self._model}",
            timings["run_start"],
            timings["run_end"],
            remote,
            {"trioinfer.device": self._device},
        )

    async def remote_statistics(self) -> dict[str, Any]:
        """The actor's counters (see `ModelActor`), for tests and diagnostics.

        ``computed``, ``expired``, ``cancelled``, ``aborted``,
        ``last_remaining`` (seconds the last batch had left when it was sent),
        ``last_hop`` (seconds it took to reach the actor; ``nan`` where the
        actor's node is not this machine), ``last_allowance`` (elsewhere: the
        `round_trip` it came with, taken off its time left; ``nan`` on this
        machine), and ``in_flight`` (calls in the actor now).

        Raises:
            BackendUnavailable: The actor or its node is gone.
        """
        if self._actor is None:
            raise BackendError(f"{self._label} is closed")
        try:
            stats: dict[str, Any] = await wait_ref(self._actor.statistics.remote())
        except Exception as exc:
            raise remote_error(exc, self._label) from exc
        return stats

    async def aclose(self) -> None:
        """Close the session in the actor (briefly), then kill the actor. Idempotent.

        The kill comes whatever happened before it, also when the caller is
        cancelled: no actor outlives its instance.
        """
        actor, self._actor = self._actor, None
        self._watching = None  # ends with the actor: let go of it
        if actor is None:
            return
        ray = _ray()
        try:
            with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await wait_ref(actor.close.remote(), abort=lambda: ray.kill(actor))
        except Exception as exc:  # a dead actor has nothing left to close
            log.debug("%s: closing the actor's session failed: %s", self._label, exc)
        finally:
            ray.kill(actor, no_restart=True)
