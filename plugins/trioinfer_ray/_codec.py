"""The optional 8-bit wire codec for float tensors (``codec = "uint8"``).

Each float tensor travels as one byte per element plus its minimum and step:
``q = round((x - min) / step)`` with ``step = (max - min) / 255``, decoded as
``min + q * step``. Rounding to the nearest step bounds the error of every
element by half a step, ``(max - min) / 510``, plus the float rounding of the
decode (a few units in the last place of the tensor's dtype, see
`error_bound`). Tensors that are not floats, are empty, or hold a NaN or an
infinity travel as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np

#: Encoded tensors are tuples tagged with this, so that decoding needs no side channel.
TAG: Final = "trioinfer-u8"
#: Levels of one byte.
LEVELS: Final = 255

Array = np.ndarray[Any, Any]


def encode(arrays: Mapping[str, Array]) -> dict[str, Any]:
    """Encode every float tensor of *arrays* in 8 bits; others are passed as they are."""
    return {name: encode_array(value) for name, value in arrays.items()}


def decode(arrays: Mapping[str, Any]) -> dict[str, Array]:
    """Undo `encode`: tensors that were encoded come back in their dtype and shape."""
    return {name: decode_array(value) for name, value in arrays.items()}


def encode_array(value: Array) -> Any:
    """One tensor: a ``(TAG, bytes, min, step, dtype)`` tuple for floats, else *value* itself."""
    if value.dtype.kind != "f" or value.size == 0:
        return value
    low = float(np.min(value))
    high = float(np.max(value))
    if not (np.isfinite(low) and np.isfinite(high)):
        return value  # NaN or infinity: nothing to scale by, so send it exactly
    step = (high - low) / LEVELS
    if step == 0.0:
        codes = np.zeros(value.shape, np.uint8)
    else:
        scaled = (value.astype(np.float64) - low) / step
        codes = np.rint(scaled, out=scaled).astype(np.uint8)
    return (TAG, codes, low, step, value.dtype.str)


def decode_array(value: Any) -> Array:
    """One tensor from `encode_array`'s form (anything else is returned as it is)."""
    if not (isinstance(value, tuple) and len(value) == 5 and value[0] == TAG):
        return np.asarray(value)
    _, codes, low, step, dtype = value
    out = codes.astype(np.float64)
    out *= step
    out += low
    decoded: Array = out.astype(np.dtype(dtype))
    return decoded


def error_bound(value: Array) -> float:
    """The largest error `encode_array` then `decode_array` may make on any element of *value*.

    Half a step, plus the rounding of the decoded value to the tensor's dtype
    (one unit in the last place of the largest magnitude, which covers the
    float64 arithmetic of the decode too). ``0.0`` for tensors sent as they are.
    """
    if value.dtype.kind != "f" or value.size == 0:
        return 0.0
    low = float(np.min(value))
    high = float(np.max(value))
    if not (np.isfinite(low) and np.isfinite(high)):
        return 0.0
    ulp = float(np.spacing(value.dtype.type(max(abs(low), abs(high)))))
    return (high - low) / (2 * LEVELS) + ulp


def wire_bytes(value: Any) -> int:
    """Bytes the tensor data of one `encode` result (or raw arrays) occupies on the wire."""
    if isinstance(value, Mapping):
        return sum(wire_bytes(item) for item in value.values())
    if isinstance(value, tuple) and len(value) == 5 and value[0] == TAG:
        return int(value[1].nbytes) + 16  # the codes, plus min and step
    return int(np.asarray(value).nbytes)
