"""trioinfer: AI inference inside Trio (and anyio) applications, with structured concurrency.

``async with open_engine() as engine`` opens a task group that owns every
queue, batch loop and backend call; ``await engine.infer(...)`` runs under the
caller's own cancel scope, whose deadline travels with the request.

This namespace is for applications: the engine, configuration, signatures,
statistics and errors. Plugin authors also use [`trioinfer.abc`][trioinfer.abc]
(the contracts) and [`trioinfer.lowlevel`][trioinfer.lowlevel] (what the engine
hands a plugin, and tools for backends); test writers use
[`trioinfer.testing`][trioinfer.testing].
"""

# First of all, before the imports that take a second (importlib.metadata's alone takes
# a tenth): importing it holds a SIGINT or SIGTERM at the start of `trioinfer serve` for
# its server's watcher.
from . import _start_signals  # noqa: F401  # imported for that

# isort: split
import importlib.metadata as _metadata

from ._config import Device as Device
from ._config import Instance as Instance
from ._config import ModelConfig as ModelConfig
from ._custom_metrics import CounterMetric as CounterMetric
from ._custom_metrics import CustomMetricFamily as CustomMetricFamily
from ._custom_metrics import CustomMetricSample as CustomMetricSample
from ._custom_metrics import GaugeMetric as GaugeMetric
from ._custom_metrics import HistogramMetric as HistogramMetric
from ._custom_metrics import MetricFamily as MetricFamily
from ._custom_metrics import ModelMetrics as ModelMetrics
from ._dispatch import ReplicaStatistics as ReplicaStatistics
from ._engine import Engine as Engine
from ._engine import EngineStatistics as EngineStatistics
from ._engine import InferenceResult as InferenceResult
from ._engine import ModelInfo as ModelInfo
from ._engine import open_engine as open_engine
from ._examples import digits_samples as digits_samples
from ._examples import example_repository as example_repository
from ._exceptions import BackendError as BackendError
from ._exceptions import BackendUnavailable as BackendUnavailable
from ._exceptions import CircuitOpen as CircuitOpen
from ._exceptions import ConfigError as ConfigError
from ._exceptions import DeadlineExceeded as DeadlineExceeded
from ._exceptions import EngineClosed as EngineClosed
from ._exceptions import InvalidInput as InvalidInput
from ._exceptions import InvalidMetric as InvalidMetric
from ._exceptions import ModelNotFound as ModelNotFound
from ._exceptions import PluginContractError as PluginContractError
from ._exceptions import PluginError as PluginError
from ._exceptions import PluginLoadError as PluginLoadError
from ._exceptions import QueueFull as QueueFull
from ._exceptions import SequenceError as SequenceError
from ._exceptions import StreamClosed as StreamClosed
from ._exceptions import TrioInferError as TrioInferError
from ._registry import PluginInfo as PluginInfo
from ._registry import Registry as Registry
from ._resources import ResourcePoolStatistics as ResourcePoolStatistics
from ._runner import Histogram as Histogram
from ._runner import ModelStatistics as ModelStatistics
from ._sequence import SequenceConfig as SequenceConfig
from ._sequence import SequenceFlags as SequenceFlags
from ._sequence import SequenceState as SequenceState
from ._stream import ResponseStream as ResponseStream
from ._tensors import InputLimits as InputLimits
from ._tensors import ModelSignature as ModelSignature
from ._tensors import TensorSpec as TensorSpec
from ._warmup import Warmup as Warmup
from ._warmup import WarmupInput as WarmupInput

try:
    __version__ = _metadata.version("trioinfer")
except (
    _metadata.PackageNotFoundError
):  # pragma: no cover  # running from a source tree without install
    __version__ = "0+unknown"
