"""Trajectory payloads: msgpack maps with arrays as raw bytes, no pickle.

An array travels as `{"dtype", "shape", "data"}` with little-endian bytes, so
any peer decodes it with numpy alone and the broker never needs to. The
payload is opaque to the broker, which stores and forwards it as one frame
beside the trajectory's metadata (docs/protocol.md, *Trajectory payload*).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlbus.common.protocol import pack, unpack

PAYLOAD_VERSION = 1
_ALLOWED = {"int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"}


def encode_array(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}


def decode_array(d: dict[str, Any]) -> np.ndarray:
    if not isinstance(d, dict) or d.get("dtype") not in _ALLOWED:
        raise ValueError(f"not an encoded array (dtype must be one of {sorted(_ALLOWED)})")
    dtype = np.dtype(d["dtype"]).newbyteorder("<")
    shape = tuple(int(x) for x in d["shape"])
    data = d["data"]
    if len(data) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ValueError(f"array data of {len(data)} bytes does not match shape {shape} of {dtype.name}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def encode_payload(arrays: dict[str, np.ndarray], extra: dict[str, Any] | None = None) -> bytes:
    """One trajectory's payload frame: named arrays plus msgpack-able extras."""
    body: dict[str, Any] = {"v": PAYLOAD_VERSION, **(extra or {})}
    for name, arr in arrays.items():
        body[name] = encode_array(arr)
    return pack(body)


def decode_payload(frame: bytes | memoryview) -> dict[str, Any]:
    """Inverse of encode_payload: encoded arrays come back as numpy arrays (read-only views)."""
    body = unpack(frame)
    if not isinstance(body, dict) or body.get("v") != PAYLOAD_VERSION:
        raise ValueError(f"unsupported trajectory payload version {body.get('v') if isinstance(body, dict) else '?'}")
    for key, value in body.items():
        if isinstance(value, dict) and "dtype" in value and "data" in value:
            body[key] = decode_array(value)
    return body
