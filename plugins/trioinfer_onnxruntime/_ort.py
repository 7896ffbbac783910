"""What every part of the backend shares: ONNX Runtime itself, imported on first use.

Also how a session's inputs and outputs read as a `ModelSignature`, how ONNX
Runtime's errors read in one line, and the plugin's logger.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Final

from trioinfer import BackendUnavailable, ModelSignature, TensorSpec
from trioinfer.lowlevel import numpy_dtype

log = logging.getLogger("trioinfer.onnxruntime")


#: How to get ONNX Runtime, said where it is missing.
_INSTALL_ORT: Final = (
    "install trioinfer with the 'cpu' extra (onnxruntime) or the 'gpu' extra "
    "(onnxruntime-gpu), one of them, e.g. pip install -e '.[cpu]' in a clone"
)


def _ort() -> Any:
    # Imported on first use so that listing plugins stays cheap. ONNX Runtime is not a
    # dependency of the core: the cpu or gpu extra picks its build.
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailable(
            f"the onnxruntime backend needs ONNX Runtime, which does not import here ({exc}): "
            f"{_INSTALL_ORT}"
        ) from exc
    return onnxruntime


def missing_ort() -> str | None:
    """ONNX Runtime, if it is not installed here; else None. Imports nothing."""
    if importlib.util.find_spec("onnxruntime") is None:
        return f"ONNX Runtime is not installed: {_INSTALL_ORT}"
    return None


def _signature(session: Any) -> ModelSignature:
    def spec(arg: Any) -> TensorSpec:
        shape = tuple(d if isinstance(d, (int, str)) else None for d in arg.shape)
        # ONNX strings are UTF-8 text: the engine decodes bytes elements for it.
        utf8 = arg.type == "tensor(string)"
        return TensorSpec(arg.name, numpy_dtype(arg.type), shape, arg.type, utf8=utf8)

    return ModelSignature(
        tuple(spec(a) for a in session.get_inputs()),
        tuple(spec(a) for a in session.get_outputs()),
    )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # ORT prefixes "[ONNXRuntimeError] : 1 : FAIL : "; the rest is the message.
    if text.startswith("[ONNXRuntimeError]"):
        text = text.split(" : ", 3)[-1]
    return text.splitlines()[0] if text else type(exc).__name__
