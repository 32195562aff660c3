"""A GGUF file's header, read in milliseconds: the key/value pairs and where each tensor's data
lies. The gguf package's reader builds a numpy view of every element of every array (the
49k-token vocabulary: seconds per read), where the model's shape needs only the scalars."""

from __future__ import annotations

import struct
from typing import Any, BinaryIO, NamedTuple

_MAGIC = b"GGUF"
# GGUF value types: struct format of the scalars (8 string, 9 array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """Not a GGUF file this reader understands (the caller may fall back to the package)."""


class TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]  # GGUF's order: the fastest-varying (a row's length) first
    type: int  # a gguf.GGMLQuantizationType value
    offset: int  # of its data, from the file's start


class Header(NamedTuple):
    meta: dict[str, Any]
    tensors: list[TensorInfo]


def read_header(path: str, skip: tuple[str, ...] = ()) -> Header:
    """Every key of the header as a plain value (arrays as lists), except arrays whose key ends
    with one of `skip`; and the tensors' places."""
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise GGUFHeaderError(f"{path} is not a GGUF file")
        version, tensors, count = struct.unpack("<IQQ", f.read(20))
        if version not in (2, 3):  # 1 had 32-bit counts; a byte-swapped file reads huge here
            raise GGUFHeaderError(f"{path}: GGUF version {version} is not read here")
        # The three the gguf package reports as fields too.
        meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensors,
                                "GGUF.kv_count": count}
        for _ in range(count):
            key = _string(f)
            (kind,) = struct.unpack("<I", f.read(4))
            if kind == _ARRAY and key.endswith(skip):
                _skip_array(f)
            else:
                meta[key] = _value(f, kind)
        infos = []
        for _ in range(tensors):
            name = _string(f)
            (n_dims,) = struct.unpack("<I", f.read(4))
            dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            kind, offset = struct.unpack("<IQ", f.read(12))
            infos.append((name, dims, kind, offset))
        # The data begins at the next multiple of the alignment; offsets count from there.
        align = int(meta.get("general.alignment", 32))
        start = -(-f.tell() // align) * align
        return Header(meta, [TensorInfo(n, d, k, start + o) for n, d, k, o in infos])


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, n = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            fmt = _SCALARS[item]
            return list(struct.unpack(f"<{n}{fmt[1]}", f.read(n * struct.calcsize(fmt))))
        return [_value(f, item) for _ in range(n)]
    if kind not in _SCALARS:
        raise GGUFHeaderError(f"unknown GGUF value type {kind}")
    fmt = _SCALARS[kind]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _skip_array(f: BinaryIO) -> None:
    item, n = struct.unpack("<IQ", f.read(12))
    if item in _SCALARS:
        f.seek(n * struct.calcsize(_SCALARS[item]), 1)
    elif item == _STRING:
        for _ in range(n):
            (length,) = struct.unpack("<Q", f.read(8))
            f.seek(length, 1)
    else:  # arrays of arrays: rare, and small
        for _ in range(n):
            _value(f, item)
