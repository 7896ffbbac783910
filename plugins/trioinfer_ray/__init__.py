"""The Ray backend plugin: each model instance an async Ray actor on a cluster node.

Entry point ``ray`` in group ``trioinfer.backends``; needs the ``ray`` extra
(``pip install -e '.[ray,cpu]'`` in a clone). The engine keeps its queue, scheduler,
batcher and fallbacks in this process (the driver); each instance of a model
with ``backend = "ray"`` is an actor holding an ONNX Runtime session (the
``onnxruntime`` backend's instance, run as it runs locally) on whichever node
its ``backend_options`` place it: by resources (``num_cpus``, ``num_gpus``,
custom ``resources``, ``model_resource`` for a node that advertises
``model:<name>``) or on an explicit ``node_id``.

- Each batch carries its remaining time (the latest deadline of its rows),
  measured as it leaves; the actor counts it on its own clock (from when the
  call left where the driver shares the actor's machine, else from arrival,
  less the least time a call of that actor took on the way there and back,
  as the driver measured it) and refuses a batch whose time ran out on the
  way, or while it waited in the actor for the run before it
  ([`DeadlineExceeded`][trioinfer.DeadlineExceeded]), before it computes.
- A batch whose callers all left is cancelled remotely (``ray.cancel``),
  which aborts the ONNX Runtime run there (``RunOptions.terminate``).
- An actor or node that is gone turns calls into
  [`BackendUnavailable`][trioinfer.BackendUnavailable], and the instance's
  ``gone`` says why as soon as Ray knows: the engine takes it out of service
  (later batches go to the model's other instances); the ``resilient``
  fallback fails over the batch it was running, and with a breaker re-creates
  the instance (a new actor) once a node can take it.
- Instances' ``device`` names their node (``"cpu@<node id>"``), so that
  statistics and metrics show where each one runs.
- ``aclose`` kills the actor: nothing an engine created outlives it.
- ``codec = "uint8"`` sends float tensors in 8 bits (see `encode`, `error_bound`).
"""

from __future__ import annotations

from ._actor import ModelActor as ModelActor
from ._backend import CLOSE_TIMEOUT_S as CLOSE_TIMEOUT_S
from ._backend import RayBackend as RayBackend
from ._backend import RayInstance as RayInstance
from ._backend import connect as connect
from ._backend import remote_error as remote_error
from ._backend import wait_ref as wait_ref
from ._codec import decode as decode
from ._codec import encode as encode
from ._codec import error_bound as error_bound
from ._codec import wire_bytes as wire_bytes
from ._options import DEFAULT_START_TIMEOUT_S as DEFAULT_START_TIMEOUT_S
from ._options import MODEL_RESOURCE_SHARE as MODEL_RESOURCE_SHARE
from ._options import OPTIONS as OPTIONS

__all__ = [
    "CLOSE_TIMEOUT_S",
    "DEFAULT_START_TIMEOUT_S",
    "MODEL_RESOURCE_SHARE",
    "OPTIONS",
    "ModelActor",
    "RayBackend",
    "RayInstance",
    "connect",
    "decode",
    "encode",
    "error_bound",
    "remote_error",
    "wait_ref",
    "wire_bytes",
]
