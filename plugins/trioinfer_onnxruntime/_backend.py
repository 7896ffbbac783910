"""The backend the entry point names: loading a model into one instance.

`OnnxRuntimeBackend.load` checks the options, starts the instance's worker
thread, creates the session there (on the placed device if the probe finds it
usable, else on the CPU where the config allows), tunes batch sizes when
asked, and hands back an `OnnxRuntimeInstance`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, final

from trioinfer import BackendError, BackendUnavailable, ConfigError, Device, ModelConfig
from trioinfer.lowlevel import Placement, WorkerThread

from ._device import _providers, probe_device
from ._instance import OnnxRuntimeInstance, _compute_clock
from ._options import _OPT_LEVELS, _check_options, default_dispatch
from ._ort import (
    _check_optional,
    _narrowed,
    _one_line,
    _ort,
    _reshaped,
    _signature,
    log,
    missing_ort,
)
from ._proof import Unproved, file_stamp, outputs_unproved
from ._tuning import _mtime, _tune, _tuned


@final
class OnnxRuntimeBackend:
    """Loads ONNX models into ONNX Runtime sessions, one per instance."""

    __slots__ = ()

    @staticmethod
    def missing_requirements() -> str | None:
        """ONNX Runtime, if it is not installed here (for ``trioinfer plugins``); else None."""
        return missing_ort()

    async def load(self, config: ModelConfig, placement: Placement) -> OnnxRuntimeInstance:
        """Create the instance's worker thread and its session on the placed device.

        Raises:
            ConfigError: Unknown or invalid ``backend_options``, or no ``path``.
            BackendUnavailable: The device is not usable and ``cpu_fallback`` is off.
            BackendError: The model file is missing, ONNX Runtime refuses it, or the
                instance's worker thread cannot be started (out of file descriptors).
        """
        options = _check_options(config, placement)
        path = config.model_file("the .onnx file to load")
        name = f"trioinfer-{config.name}-{placement.index}"
        try:
            worker = await WorkerThread.start(name, cpu_affinity=placement.cpu_affinity)
        except OSError as exc:
            if placement.cpu_affinity is None:
                # Not the configuration: the process is out of threads or file descriptors.
                raise BackendError(
                    f"model {config.name!r} instance {placement.index}: cannot start its "
                    f"worker thread: {exc}"
                ) from exc
            raise ConfigError(
                f"model {config.name!r} instance {placement.index}: cpu_affinity "
                f"{list(placement.cpu_affinity)} cannot be applied here: {exc}"
            ) from exc
        label = f"model {config.name!r} instance {placement.index}"
        threads = _compute_threads(placement)
        rates: dict[int, float] = {}
        try:
            # Before ONNX Runtime reads the file: the proof below reads it again, and
            # must not judge another file put there meanwhile.
            read = await worker.run_sync(file_stamp, path)
            session, device = await worker.run_sync(
                _create_session, config, path, placement, options
            )
            # The graph's signature narrowed by the sizes the config fixes (a
            # config.pbtxt's dims): what is proved and tuned below; clients see
            # reshaped tensors in their own shapes (Triton's reshape).
            inputs, outputs = options["inputs"], options["outputs"]
            _check_optional(session, inputs.optional, config.name, inputs.graph)
            graph = _signature(session, inputs.optional)
            graph = _narrowed(graph, inputs.graph, outputs.graph, config.name)
            signature = _reshaped(graph, inputs.clients, outputs.clients)
            # The engine reads the first instance's figures; others would only
            # disturb its measurement by running at the same time.
            if options["tune_batch_sizes"] and placement.index == 0:
                key = (str(path), _mtime(path), device, threads)
                key += tuple(options["tune_batch_sizes"])
                clock = _compute_clock(device, threads)
                sizes = options["tune_batch_sizes"]
                rates = _tuned.get(key) or await _tune(worker, session, graph, label, sizes, clock)
                _tuned[key] = rates
            unproved = (
                Unproved("its file could not be read before its session was made")
                if read is None
                else await worker.run_sync(outputs_unproved, path, graph, read)
            )
        except BaseException:
            await worker.aclose()
            raise
        dispatch = options["dispatch"]
        if device != str(placement.device) and "dispatch" not in config.backend_options:
            # Fallen back to the CPU: the CPU's default, not the one picked for the GPU.
            dispatch = default_dispatch("cpu")
        instance = OnnxRuntimeInstance(
            session,
            device,
            worker,
            dispatch,
            options["inline_budget_us"] / 1e6,
            label,
            options["pipeline_depth"],
            threads,
            rates,
            checks_outputs=unproved is None,
            signature=signature,
            reshape_inputs={name: inputs.graph[name] for name in inputs.clients},
            reshape_outputs=outputs.clients,
        )
        if placement.index == 0:
            # Said once per model at load: which output check its answers get. A graph at
            # odds with its own declaration answers what its metadata does not say: each
            # such answer fails (BackendError), which the operator should know of.
            if unproved is None:
                log.info(
                    "%s: ONNX shape inference proves its outputs' shapes; the engine "
                    "checks each answer's output names and rows only",
                    label,
                )
            else:
                log.log(
                    logging.WARNING if unproved.contradicts else logging.INFO,
                    "%s: its graph does not prove its outputs' shapes (%s); the engine checks "
                    "each answer against the declared signature",
                    label,
                    unproved.reason,
                )
        if rates:
            log.info(
                "%s: rows/s by batch size: %s; preferred batch size %d",
                label,
                ", ".join(f"{size}: {rate:,.1f}" for size, rate in rates.items()),
                instance.preferred_batch_sizes[0],
            )
        return instance


def _directory_as_path(path: Path) -> str:
    """What is wrong with a directory given as a model's path, and the file likely meant."""
    # A version's directory (<N>/model.onnx), or a repository's model directory
    # (<model>/<N>/model.onnx, the highest version as the repository would serve).
    found: Path | None = None
    if (path / "model.onnx").is_file():
        found = path / "model.onnx"
    else:
        versions = [
            int(child.name)
            for child in path.iterdir()
            # ASCII digits only, as the repository's versions: int() refuses "²".
            if child.name.isascii() and child.name.isdigit() and (child / "model.onnx").is_file()
        ]
        found = path / str(max(versions)) / "model.onnx" if versions else None
    example = f", e.g. {found}" if found is not None else ""
    return f"{path} is a directory; path names the model's .onnx file{example}"


def _create_session(
    config: ModelConfig, path: Path, placement: Placement, options: dict[str, Any]
) -> tuple[Any, str]:
    ort = _ort()
    if path.is_dir():
        raise BackendError(f"model {config.name!r}: {_directory_as_path(path)}")
    if not path.is_file():
        raise BackendError(f"model {config.name!r}: no model file at {path}")
    device = placement.device
    reason = probe_device(device)
    if reason is not None:
        if not placement.cpu_fallback:
            raise BackendUnavailable(
                f"model {config.name!r} instance {placement.index}: {device} is not usable: "
                f"{reason} (set cpu_fallback = true to run on the CPU instead)"
            )
        log.warning(
            "model %r instance %d: %s is not usable (%s); running on the CPU",
            config.name,
            placement.index,
            device,
            reason,
        )
        device = Device("cpu")
    so = ort.SessionOptions()
    affinity = placement.cpu_affinity
    threads = _compute_threads(placement)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = options.get("inter_op_threads", 0)
    so.graph_optimization_level = getattr(
        ort.GraphOptimizationLevel, _OPT_LEVELS[options["graph_optimization_level"]]
    )
    so.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL
        if options["execution_mode"] == "parallel"
        else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    so.enable_cpu_mem_arena = options["enable_mem_arena"]
    so.enable_mem_pattern = options["enable_mem_pattern"]
    so.log_severity_level = options["log_severity"]
    if not options["allow_spinning"]:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if affinity is not None and threads > 1:
        # ORT pins intra-op threads 2..N itself; the first is the worker thread, pinned already.
        cpus = ",".join(map(str, affinity))
        so.add_session_config_entry(
            "session.intra_op_thread_affinities", ";".join([cpus] * (threads - 1))
        )
    try:
        session = ort.InferenceSession(str(path), so, providers=_providers(device, options))
    except Exception as exc:
        raise BackendError(
            f"model {config.name!r}: ONNX Runtime could not load {path}: {_one_line(exc)}"
        ) from exc
    return session, str(device)


def _compute_threads(placement: Placement) -> int:
    # With CPUs named but no thread count, one compute thread per named CPU; 0: ORT chooses.
    affinity = placement.cpu_affinity
    return placement.threads or (len(affinity) if affinity else 0)
