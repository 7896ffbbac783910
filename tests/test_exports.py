"""The public API: what trioinfer, .abc, .lowlevel, .testing, .server and .bench export."""

from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

import trioinfer
import trioinfer.abc
import trioinfer.bench
import trioinfer.lowlevel
import trioinfer.server
import trioinfer.testing

PUBLIC = {
    "trioinfer": {
        "BackendError", "BackendUnavailable", "CircuitOpen", "ConfigError", "DeadlineExceeded",
        "Device", "Engine", "EngineClosed", "EngineStatistics", "Histogram", "InferenceResult",
        "InputLimits", "Instance", "InvalidInput", "ModelConfig", "ModelInfo", "ModelNotFound",
        "ModelSignature", "ModelStatistics", "PluginContractError", "PluginError", "PluginInfo",
        "PluginLoadError", "QueueFull", "Registry", "ReplicaStatistics", "ResourcePoolStatistics",
        "ResponseStream",
        "TensorSpec", "SequenceConfig", "SequenceError", "SequenceFlags", "SequenceState",
        "Warmup", "WarmupInput",
        "CounterMetric", "CustomMetricFamily", "CustomMetricSample", "GaugeMetric",
        "HistogramMetric", "InvalidMetric", "MetricFamily", "ModelMetrics",
        "StreamClosed", "TrioInferError", "digits_samples", "example_repository", "open_engine",
    },
    "trioinfer.abc": {
        "AssemblingBatcher", "AttachableBatcher", "AttachableFallback", "AttachableScheduler",
        "Backend",
        "BackendInstance", "Batcher", "BoundedBatcher", "ConfigCompletingBackend", "Fallback",
        "InlineInstance", "OutputsInstance",
        "PipelinedInstance", "RecoveringFallback", "RequestsInstance",
        "Scheduler",
        "StreamingInstance", "TunedInstance", "SequenceBatcher",
    },
    "trioinfer.lowlevel": {
        "BatcherContext", "Execution", "FallbackContext", "Placement", "Replica", "Request",
        "RequestQueue",
        "SchedulerContext", "SequenceContext", "Status", "WorkerThread", "current_batch_deadline",
        "current_stream_parameters", "current_stream_request", "caller_request_id",
        "set_response_parameters",
        "current_callers_deadline",
        "current_trace_context", "numpy_dtype", "record_span",
        "wait_on_callback", "CallbackWaiter", "inline_slice_spent", "restart_inline_slice",
        "current_engine", "infer_follow_up", "infer_stream_follow_up", "current_model_metrics",
        "ModelTasks", "current_model_tasks", "check_seconds",
    },
    "trioinfer.testing": {
        "FakeBackend", "FakeInstance", "check_backend", "check_batcher", "check_fallback",
        "check_scheduler", "make_request",
        "FaultStatistics", "FaultyBackend", "FaultyInstance", "LedgerStatistics",
        "RequestLedger", "assert_all_ended", "assert_no_tasks_left",
        "SequenceAccumulator", "SimpleSequence", "simple_sequence_config",
    },
    "trioinfer.server": {
        "Limits", "Listening", "ModelRepository", "PayloadTooLarge", "RequestError",
        "ServerConfig", "ServerState", "TlsFiles", "UnsupportedEncoding", "VersionPolicy",
        "create_app", "serve_http", "status_for",
        # The V2 codec: what a client (trioinfer bench) needs to speak the protocol.
        "InferRequest", "RequestedOutput", "decode_infer_request", "encode_infer_request",
        "v2_datatype", "v2_numpy_dtype",
    },
    "trioinfer.bench": {
        "BenchError", "DEFAULT_MAX_CONNECTIONS", "GrpcTarget", "HttpTarget", "Modes", "PERCENTILES",
        "Plan", "Progress",
        "Result", "Run", "STABLE_WINDOWS", "Settings", "Tensor", "format_table", "is_stable",
        "iter_arrivals", "iter_intervals", "load_inputs", "open_local_model", "open_progress",
        "print_table",
        "random_inputs", "run_grpc", "run_http", "run_in_process", "write_csv", "write_json",
        "write_plot", "zero_inputs",
    },
}  # fmt: skip

MODULES = (
    trioinfer,
    trioinfer.abc,
    trioinfer.lowlevel,
    trioinfer.testing,
    trioinfer.server,
    trioinfer.bench,
)


def public_names(module: object) -> set[str]:
    names = getattr(module, "__all__", None) or dir(module)
    return {
        n
        for n in names
        if not n.startswith("_")
        and not inspect.ismodule(getattr(module, n))
        and n not in {"annotations", "TYPE_CHECKING"}
    }


def test_public_names_are_pinned() -> None:
    for module in MODULES:
        assert public_names(module) == PUBLIC[module.__name__], module.__name__


def test_every_public_name_has_a_docstring() -> None:
    for module in MODULES:
        for name in PUBLIC[module.__name__]:
            assert inspect.getdoc(getattr(module, name)), f"{module.__name__}.{name}"


def test_errors_share_one_base() -> None:
    errors = [getattr(trioinfer, n) for n in PUBLIC["trioinfer"] if n.endswith(("Error", "Full"))]
    errors += [trioinfer.ModelNotFound, trioinfer.InvalidInput, trioinfer.DeadlineExceeded]
    errors += [trioinfer.EngineClosed, trioinfer.BackendUnavailable, trioinfer.StreamClosed]
    assert all(issubclass(e, trioinfer.TrioInferError) for e in errors)


def test_every_package_the_wheel_ships_is_typed() -> None:
    # Without py.typed, a user's mypy skips the package ("missing library stubs or
    # py.typed marker"): failover.py's `from trioinfer_onnxruntime import ...` failed
    # mypy --strict in a reader's project, though it passed against our plugins/ path.
    root = Path(__file__).resolve().parent.parent
    wheel = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    packages = wheel["targets"]["wheel"]["packages"]
    assert [p for p in packages if not (root / p / "py.typed").is_file()] == []
