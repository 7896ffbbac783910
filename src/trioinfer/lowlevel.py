"""What plugin authors work with: the engine's objects as plugins see them, and tools for backends.

Application code needs none of this; it uses [`trioinfer`][trioinfer]. A
plugin implements a contract from [`trioinfer.abc`][trioinfer.abc] and
annotates what the engine hands it with the names here:

```python
from trioinfer.abc import Batcher
from trioinfer.lowlevel import Request, RequestQueue


class OneAtATime:
    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        ...
```

- What the engine hands a plugin, as Protocols (it makes every one of them;
  its own classes refuse construction): [`Request`][trioinfer.lowlevel.Request]
  and its [`Status`][trioinfer.lowlevel.Status], the
  [`RequestQueue`][trioinfer.lowlevel.RequestQueue] a batcher takes from, the
  [`SchedulerContext`][trioinfer.lowlevel.SchedulerContext] and
  [`FallbackContext`][trioinfer.lowlevel.FallbackContext] that attachable
  schedulers and fallbacks get, the
  [`BatcherContext`][trioinfer.lowlevel.BatcherContext] an attachable batcher gets, the
  [`SequenceContext`][trioinfer.lowlevel.SequenceContext] a sequence batcher gets, and the
  [`Execution`][trioinfer.lowlevel.Execution] and
  [`Replica`][trioinfer.lowlevel.Replica] a fallback works with.
- For backends: the [`Placement`][trioinfer.lowlevel.Placement] that ``load``
  gets, a [`WorkerThread`][trioinfer.lowlevel.WorkerThread] to run blocking
  calls on, [`wait_on_callback()`][trioinfer.lowlevel.wait_on_callback] (and
  [`CallbackWaiter`][trioinfer.lowlevel.CallbackWaiter], its cheaper form for
  one caller at a time) for runtimes that report through callbacks, and
  [`numpy_dtype()`][trioinfer.lowlevel.numpy_dtype] for ONNX type names, and
  [`current_batch_deadline()`][trioinfer.lowlevel.current_batch_deadline]
  for backends that send a batch's remaining time along with it, and
  [`inline_slice_spent()`][trioinfer.lowlevel.inline_slice_spent] /
  [`restart_inline_slice()`][trioinfer.lowlevel.restart_inline_slice] for
  backends that run executions on the event loop's thread within a time budget.
- For backends whose instances run tasks beyond one call (a decoupled
  model's executions beside the reading of their streams):
  [`current_model_tasks()`][trioinfer.lowlevel.current_model_tasks], the
  model's own task group ([`ModelTasks`][trioinfer.lowlevel.ModelTasks]),
  which the engine ends after the model's instances closed.
- For backends whose models read request parameters (Triton's parameters
  extension): each request's ``parameters`` (an instance that takes an
  execution's requests, ``RequestsInstance``, reads them there), and
  [`current_stream_parameters()`][trioinfer.lowlevel.current_stream_parameters]
  for the stream a decoupled model is producing
  ([`current_stream_request()`][trioinfer.lowlevel.current_stream_request]:
  that stream's whole request), and
  [`caller_request_id()`][trioinfer.lowlevel.caller_request_id] for the id
  a request's caller gave (``""`` where the engine made one, as Triton's
  ``request_id()`` is);
  [`set_response_parameters()`][trioinfer.lowlevel.set_response_parameters]
  for models whose answers carry parameters (Triton's response parameters).
- For backends whose models call other models of their engine (the
  ``python`` backend's ``models``, as Triton's BLS):
  [`current_engine()`][trioinfer.lowlevel.current_engine] (the engine loading
  the model) and [`infer_follow_up()`][trioinfer.lowlevel.infer_follow_up]
  (``engine.infer`` for a request made on behalf of an accepted one, also
  while the engine drains, with its deadline:
  [`current_callers_deadline()`][trioinfer.lowlevel.current_callers_deadline]),
  and [`infer_stream_follow_up()`][trioinfer.lowlevel.infer_stream_follow_up]
  (``engine.infer_stream`` alike, for a decoupled model's responses).
- For backends whose models declare their own metrics (the ``python``
  backend's ``metrics``):
  [`current_model_metrics()`][trioinfer.lowlevel.current_model_metrics], the
  [`ModelMetrics`][trioinfer.ModelMetrics] of the model being loaded.
- For backends whose work runs elsewhere, tracing:
  [`current_trace_context()`][trioinfer.lowlevel.current_trace_context]
  (the W3C context to send with a traced call) and
  [`record_span()`][trioinfer.lowlevel.record_span] (the remote side's
  timings, recorded as child spans by the engine's tracer).

- For plugins' options:
  [`check_seconds()`][trioinfer.lowlevel.check_seconds], the one check of a
  duration (the range every duration key and flag of trioinfer accepts, and its
  message).

To make requests for a plugin's own tests, use
[`trioinfer.testing.make_request()`][trioinfer.testing.make_request].
"""

from ._bounds import check_seconds as check_seconds
from ._config import Placement as Placement
from ._custom_metrics import current_model_metrics as current_model_metrics
from ._engine import current_engine as current_engine
from ._engine import infer_follow_up as infer_follow_up
from ._engine import infer_stream_follow_up as infer_stream_follow_up
from ._inline import inline_slice_spent as inline_slice_spent
from ._inline import restart_inline_slice as restart_inline_slice
from ._model_tasks import current_model_tasks as current_model_tasks
from ._remote_trace import current_trace_context as current_trace_context
from ._remote_trace import record_span as record_span
from ._request import caller_request_id as caller_request_id
from ._request import set_response_parameters as set_response_parameters
from ._stream import current_stream_parameters as current_stream_parameters
from ._stream import current_stream_request as current_stream_request
from ._tensors import numpy_dtype as numpy_dtype
from ._threads import CallbackWaiter as CallbackWaiter
from ._threads import WorkerThread as WorkerThread
from ._threads import current_batch_deadline as current_batch_deadline
from ._threads import current_callers_deadline as current_callers_deadline
from ._threads import wait_on_callback as wait_on_callback
from .abc import BatcherContext as BatcherContext
from .abc import Execution as Execution
from .abc import FallbackContext as FallbackContext
from .abc import ModelTasks as ModelTasks
from .abc import Replica as Replica
from .abc import Request as Request
from .abc import RequestQueue as RequestQueue
from .abc import SchedulerContext as SchedulerContext
from .abc import SequenceContext as SequenceContext
from .abc import Status as Status
