"""The backend's options: the `OPTIONS` table and the checks of a model's ``backend_options``."""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Mapping
from typing import Any, Final

import attrs

from trioinfer import ConfigError, ModelConfig
from trioinfer.lowlevel import Placement

from ._tuning import TUNE_OVERHEAD_S, TUNE_TOLERANCE

_DISPATCH: Final = ("thread", "ort_async", "inline", "auto")
_OPT_LEVELS: Final = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}
#: The default ``inline_budget_us``. A hop to a worker thread and back costs
#: 100-150 us of CPU on a small machine; an execution of up to about two hops
#: is cheaper on the loop's thread than handed off (a 32-row batch of the
#: digits MLP costs about 100 us there, its caches cold from the loop's other
#: work), and holds the loop no longer than a few hops would.
DEFAULT_INLINE_BUDGET_US: Final = 250
#: The largest ``inline_budget_us``: 10 s of the event loop's thread per execution is
#: no longer "cheaper than a thread hop" in any sense, and every other task of the loop
#: waits that long; past it (or infinite) is a typo or a misunderstanding.
MAX_INLINE_BUDGET_US: Final = 10_000_000
#: Most intra-op (an instance's ``threads``) or inter-op threads one session may ask
#: for. ONNX Runtime starts them all at load: 100000 held a load for minutes, and a
#: count past a C int failed with a TypeError; either is a typo, or a client's load
#: override trying to exhaust the server.
MAX_THREADS: Final = 1024
#: Every ``backend_options`` key this backend accepts, with what it means.
OPTIONS: Final[Mapping[str, str]] = {
    "dispatch": "'thread': session.run on the instance's worker thread (default on a GPU); "
    "'ort_async': ONNX Runtime's run_async (needs threads >= 2); "
    "'inline': on the event loop's thread, for models far cheaper than a thread hop, "
    "within inline_budget_us; 'auto' (default on the CPU, a GPU instance fallen back to it "
    "too): measure on the thread, "
    "go inline if cheap enough",
    "inline_budget_us": "execution time, in microseconds, allowed on the event loop's thread "
    "(moving average; one run may take up to 10x) before an 'inline' or 'auto' instance "
    f"moves to its worker thread (default {DEFAULT_INLINE_BUDGET_US}; greater than 0, at most "
    f"{MAX_INLINE_BUDGET_US})",
    "inter_op_threads": "threads for running independent nodes in parallel (0: ORT default; "
    f"at most {MAX_THREADS})",
    "graph_optimization_level": "'disable', 'basic', 'extended' or 'all' (default)",
    "execution_mode": "'sequential' (default) or 'parallel'",
    "enable_mem_arena": "use ORT's CPU memory arena (default true)",
    "enable_mem_pattern": "let ORT plan memory from the first run's pattern (default true)",
    "provider_options": "a table passed to the GPU execution provider "
    "(e.g. gpu_mem_limit, trt_fp16_enable, trt_engine_cache_path)",
    "log_severity": "ORT log level for the session, 0 (verbose) to 4 (fatal); default 3",
    "pipeline_depth": "executions the engine may hand one instance at once (default 1); with 2 "
    "the next batch waits on the worker thread while one runs, so compute never waits for the "
    "loop, but that batch has left the engine's queue (a caller that leaves aborts it there)",
    "allow_spinning": "let idle intra-op threads spin for new work (default true, as in ORT); "
    "false saves CPU on a shared machine, at some latency",
    "tune_batch_sizes": "batch sizes the model's first instance times when it loads, e.g. "
    "[1, 2, 4, 8, 16, 32] (default []: none); the smallest whose rows/s (charged "
    f"{TUNE_OVERHEAD_S * 1e6:.0f} us per execution) is within {TUNE_TOLERANCE:.0%} of the best "
    "becomes the model's preferred batch size, which the dynamic batcher cuts batches at "
    "unless its preferred_batch_sizes is set",
    "inputs": "sizes the graph leaves open that the model fixes: a list of tables "
    "{ name, shape }, shape with every dimension (the batch one too) as an int, a name, "
    "or -1 to keep the graph's; a fixed size narrows a symbolic or open one in the "
    "signature (metadata, and the engine refuses requests of another size), and one the "
    "graph fixes otherwise is refused at load (a config.pbtxt's dims arrive here). "
    "With reshape (a list of fixed sizes, the first -1 for the batch dimension where "
    "shape's is), shape is what clients send and reshape what the graph takes, the same "
    "elements (Triton's reshape); optional = true: the graph gives the input a value "
    "(an initializer) that a request may override by sending it or leave to the graph "
    "by leaving it out (a batch holds requests that send the same inputs); refused at "
    "load where the graph needs the input",
    "outputs": "as inputs, for outputs: an answer of another size fails (BackendError); "
    "where ONNX shape inference proves the graph computes the sizes, that check is spared; "
    "with reshape, the graph computes reshape and clients receive shape",
}


@attrs.frozen
class Declared:
    """The ``inputs`` or ``outputs`` option: what the config says of a kind's tensors.

    Attributes:
        graph: Each declared tensor's shape in the graph's terms (its ``reshape``
            where it has one), -1 for a size the graph keeps.
        clients: The shape clients see of each reshaped tensor (``shape``), -1 first
            for the batch dimension.
        optional: The inputs that requests may leave out.
    """

    graph: Mapping[str, tuple[int | str, ...]] = attrs.field(factory=dict)
    clients: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)
    optional: frozenset[str] = frozenset()


def default_dispatch(kind: str) -> str:
    """The ``dispatch`` of an instance on a device of *kind* whose options name none."""
    # Inline is measured and bounded on the CPU; on a GPU it has not been tried here.
    return "auto" if kind == "cpu" else "thread"


def _check_options(config: ModelConfig, placement: Placement) -> dict[str, Any]:
    options = dict(config.backend_options)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        hints = "".join(
            f"; did you mean {close[0]!r} for {key!r}?"
            for key in unknown
            if (close := difflib.get_close_matches(key, OPTIONS, n=1))
        )
        raise ConfigError(
            f"model {config.name!r}: onnxruntime backend has no option "
            f"{', '.join(map(repr, unknown))}; it knows {', '.join(sorted(OPTIONS))}{hints}"
        )
    options.setdefault("dispatch", default_dispatch(placement.device.kind))
    if options["dispatch"] not in _DISPATCH:
        raise ConfigError(
            f"model {config.name!r}: dispatch must be one of {', '.join(map(repr, _DISPATCH))}, "
            f"got {options['dispatch']!r}"
        )
    depth = options.setdefault("pipeline_depth", 1)
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= 8:
        raise ConfigError(
            f"model {config.name!r}: pipeline_depth must be an integer from 1 to 8, got {depth!r}"
        )
    budget = options.setdefault("inline_budget_us", DEFAULT_INLINE_BUDGET_US)
    # inf (TOML's too) held the loop for ever: an inline instance never moved to its
    # thread, nor yielded to other tasks; nan compares false with everything, as inf.
    if (
        not isinstance(budget, (int, float))
        or isinstance(budget, bool)
        or not 0 < budget <= MAX_INLINE_BUDGET_US
    ):
        raise ConfigError(
            f"model {config.name!r}: inline_budget_us must be a number of microseconds "
            f"greater than 0 and at most {MAX_INLINE_BUDGET_US} "
            f"({MAX_INLINE_BUDGET_US / 1e6:g} s), got {budget!r}"
        )
    if options["dispatch"] == "ort_async" and placement.threads == 1:
        raise ConfigError(
            f"model {config.name!r}: dispatch 'ort_async' runs on ONNX Runtime's intra-op "
            "thread pool, which needs threads >= 2 (or 0 for ORT's default); got threads = 1"
        )
    level = options.setdefault("graph_optimization_level", "all")
    # A TOML list or table is unhashable: asked of the dict, it would raise TypeError.
    if not isinstance(level, str) or level not in _OPT_LEVELS:
        raise ConfigError(
            f"model {config.name!r}: graph_optimization_level must be one of "
            f"{', '.join(map(repr, _OPT_LEVELS))}, got {level!r}"
        )
    mode = options.setdefault("execution_mode", "sequential")
    if mode not in ("sequential", "parallel"):
        raise ConfigError(
            f"model {config.name!r}: execution_mode must be 'sequential' or 'parallel', "
            f"got {mode!r}"
        )
    for key in ("inter_op_threads", "log_severity"):
        value = options.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(
                f"model {config.name!r}: {key} must be an integer >= 0, got {value!r}"
            )
    if options.get("inter_op_threads", 0) > MAX_THREADS:
        raise ConfigError(
            f"model {config.name!r}: inter_op_threads must be at most {MAX_THREADS}, "
            f"got {options['inter_op_threads']}"
        )
    if placement.threads > MAX_THREADS:
        raise ConfigError(
            f"model {config.name!r} instance {placement.index}: threads must be at most "
            f"{MAX_THREADS} for the onnxruntime backend, got {placement.threads}"
        )
    severity = options.setdefault("log_severity", 3)
    if not 0 <= severity <= 4:
        raise ConfigError(
            f"model {config.name!r}: log_severity must be an integer from 0 (verbose) to 4 "
            f"(fatal), got {severity!r}"
        )
    for key in ("enable_mem_arena", "enable_mem_pattern", "allow_spinning"):
        if not isinstance(options.setdefault(key, True), bool):
            raise ConfigError(f"model {config.name!r}: {key} must be true or false")
    sizes = options.setdefault("tune_batch_sizes", [])
    if (
        not isinstance(sizes, list | tuple)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)
        or any(a >= b for a, b in itertools.pairwise(sizes))
    ):
        raise ConfigError(
            f"model {config.name!r}: tune_batch_sizes must be a list of strictly increasing "
            f"positive integers (batch sizes to time), e.g. [1, 2, 4, 8, 16, 32]; got {sizes!r}"
        )
    options["tune_batch_sizes"] = list(sizes)
    _check_tune_fits_batcher(config, options["tune_batch_sizes"])
    provider_options = options.setdefault("provider_options", {})
    if not isinstance(provider_options, Mapping):
        raise ConfigError(f"model {config.name!r}: provider_options must be a table")
    if "device_id" in provider_options:
        # It would win over the instance's device: a session on GPU 1 that metadata,
        # statistics and placement call cuda:0.
        raise ConfigError(
            f"model {config.name!r}: provider_options may not set device_id "
            f"(got {provider_options['device_id']!r}); the instance's device picks it: "
            'give the instance device = "cuda:N"'
        )
    for kind in ("inputs", "outputs"):
        options[kind] = _declared_shapes(config.name, kind, options.get(kind, []))
    return options


def _declared_shapes(model: str, kind: str, value: object) -> Declared:
    # The inputs or outputs option: {name: shape}, -1 for a size left as the graph says;
    # reshaped tensors' client shapes, and optional inputs, beside.
    where = f"model {model!r}: backend option {kind}"
    if not isinstance(value, list | tuple):
        raise ConfigError(
            f"{where} must be a list of tables {{ name, shape }}, got {type(value).__name__}"
        )
    keys = (
        {"name", "shape", "reshape", "optional"}
        if kind == "inputs"
        else {"name", "shape", "reshape"}
    )
    shapes: dict[str, tuple[int | str, ...]] = {}
    clients: dict[str, tuple[int, ...]] = {}
    optional: set[str] = set()
    for item in value:
        if not isinstance(item, Mapping) or not {"name", "shape"} <= set(item) <= keys:
            raise ConfigError(
                f"{where}: each entry must be a table of name and shape (and "
                f"{' or '.join(sorted(keys - {'name', 'shape'}))}), got {item!r}"
            )
        name, shape = item["name"], item["shape"]
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: a tensor name must be a non-empty string, got {name!r}")
        if name in shapes or name in optional:
            raise ConfigError(f"{where}: {name!r} is declared twice")
        if not isinstance(shape, list | tuple) or not all(
            (isinstance(d, int) and not isinstance(d, bool) and d >= -1)
            or (isinstance(d, str) and d)
            for d in shape
        ):
            raise ConfigError(
                f"{where}: the shape of {name!r} must be a list of sizes >= 0, names or -1 "
                f"(the graph's), got {shape!r}"
            )
        if item.get("optional", False) is not False:
            if item["optional"] is not True:
                raise ConfigError(f"{where}: optional of {name!r} must be true or false")
            if "reshape" in item:
                raise ConfigError(f"{where}: {name!r} is optional and reshaped; it can be one")
            optional.add(name)
        if "reshape" in item:
            clients[name] = _fixed(where, name, "shape", shape)
            shapes[name] = _fixed(where, name, "reshape", item["reshape"])
            ends = (clients[name][:1] == (-1,), shapes[name][:1] == (-1,))
            if ends[0] != ends[1] or math.prod(clients[name][ends[0] :]) != math.prod(
                shapes[name][ends[1] :]
            ):
                raise ConfigError(
                    f"{where}: {name!r} has shape {list(clients[name])} and reshape "
                    f"{list(shapes[name])}: they must hold the same elements (with -1 first "
                    "in both, or in neither, for the batch dimension)"
                )
        else:
            shapes[name] = tuple(shape)
    return Declared(shapes, clients, frozenset(optional))


def _fixed(where: str, name: str, what: str, shape: object) -> tuple[int, ...]:
    # A reshaped tensor's shape or reshape: fixed sizes, -1 first for the batch dimension.
    if (
        not isinstance(shape, list | tuple)
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
        or any(d < 0 for d in shape[1:])
        or (shape and shape[0] < -1)
    ):
        raise ConfigError(
            f"{where}: the {what} of reshaped {name!r} must be a list of fixed sizes >= 0 "
            f"(the first may be -1, the batch dimension), got {shape!r}"
        )
    return tuple(shape)


def _check_tune_fits_batcher(config: ModelConfig, sizes: list[int]) -> None:
    # What the measurement is for: sizes a batcher can form. The first-party
    # batchers are known here; a third-party one may read the sizes as it likes.
    if not sizes:
        return
    if config.batcher == "none":
        raise ConfigError(
            f"model {config.name!r}: tune_batch_sizes needs a batcher that forms batches "
            "(batcher = 'dynamic'); with batcher 'none' every execution is one request"
        )
    if config.batcher == "dynamic":
        largest = config.batcher_options.get("max_batch_size", 32)
        if isinstance(largest, int) and sizes[-1] > largest:
            raise ConfigError(
                f"model {config.name!r}: tune_batch_sizes holds {sizes[-1]}, more than the "
                f"batcher's max_batch_size {largest}; list only sizes up to {largest}"
            )
