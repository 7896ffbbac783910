"""trioinfer: AI inference inside Trio (and anyio) applications, with structured concurrency.

``async with open_engine() as engine`` opens a task group that owns every
queue, batch loop and backend call; ``await engine.infer(...)`` runs under the
caller's own cancel scope, whose deadline travels with the request.
"""

import importlib.metadata as _metadata

from ._config import Device as Device
from ._config import Instance as Instance
from ._config import ModelConfig as ModelConfig
from ._config import Placement as Placement
from ._dispatch import Execution as Execution
from ._dispatch import FallbackContext as FallbackContext
from ._dispatch import Replica as Replica
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
from ._exceptions import ModelNotFound as ModelNotFound
from ._exceptions import PluginError as PluginError
from ._exceptions import PluginLoadError as PluginLoadError
from ._exceptions import QueueFull as QueueFull
from ._exceptions import TrioInferError as TrioInferError
from ._registry import PluginInfo as PluginInfo
from ._registry import Registry as Registry
from ._request import Request as Request
from ._request import Status as Status
from ._runner import Histogram as Histogram
from ._runner import ModelStatistics as ModelStatistics
from ._runner import RequestQueue as RequestQueue
from ._runner import SchedulerContext as SchedulerContext
from ._tensors import InputLimits as InputLimits
from ._tensors import ModelSignature as ModelSignature
from ._tensors import TensorSpec as TensorSpec
from ._tensors import numpy_dtype as numpy_dtype
from ._threads import WorkerThread as WorkerThread
from ._threads import wait_on_callback as wait_on_callback

try:
    __version__ = _metadata.version("trioinfer")
except (
    _metadata.PackageNotFoundError
):  # pragma: no cover  # running from a source tree without install
    __version__ = "0+unknown"
