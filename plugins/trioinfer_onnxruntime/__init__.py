"""The ONNX Runtime backend plugin: one InferenceSession per instance, on CPU, CUDA or TensorRT.

Entry point ``onnxruntime`` in group ``trioinfer.backends``. Before a session
is created on a GPU execution provider, the backend checks (once per device)
that the provider really works here, and says why in one line when it does
not; it then falls back to the CPU only if the model's config allows it.

Where compute runs is chosen by the ``dispatch`` backend option: ``"thread"``
runs ``session.run`` on the instance's own worker thread; ``"ort_async"`` uses
ONNX Runtime's ``run_async``, whose callback wakes the event loop; ``"inline"``
runs it on the event loop's thread within a time budget; ``"auto"`` (the
default on the CPU) measures on the thread and goes inline when that is
cheaper than the hop. Off the loop, a cancelled execution is aborted with
``RunOptions.terminate``.

With the ``tune_batch_sizes`` option an instance times the model at each of
those batch sizes when it loads and advertises the smallest that serves about
as many rows per second as the best (within ``TUNE_TOLERANCE``, counting
``TUNE_OVERHEAD_S`` per execution) as its ``preferred_batch_sizes``, which the
dynamic batcher then cuts batches at.
"""

from __future__ import annotations

from ._backend import OnnxRuntimeBackend as OnnxRuntimeBackend
from ._device import probe_device as probe_device
from ._instance import AUTO_SAMPLES as AUTO_SAMPLES
from ._instance import OnnxRuntimeInstance as OnnxRuntimeInstance
from ._options import OPTIONS as OPTIONS
from ._tuning import TUNE_OVERHEAD_S as TUNE_OVERHEAD_S
from ._tuning import TUNE_TOLERANCE as TUNE_TOLERANCE
from ._tuning import preferred_batch_size as preferred_batch_size

__all__ = [
    "AUTO_SAMPLES",
    "OPTIONS",
    "TUNE_OVERHEAD_S",
    "TUNE_TOLERANCE",
    "OnnxRuntimeBackend",
    "OnnxRuntimeInstance",
    "preferred_batch_size",
    "probe_device",
]
