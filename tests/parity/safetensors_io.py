"""Minimal safetensors reader/writer for Loom's parity tests.

Why this exists: the `safetensors` package is not installed on the machines Loom is
tested on, and the format is small enough that a self-contained implementation is
simpler than a dependency.  It is also an independent check of Loom's own C++
safetensors code: both sides implement the published format, neither borrows the
other's code.

Format (https://github.com/huggingface/safetensors):

    [8 bytes]  N, little-endian u64: length of the JSON header
    [N bytes]  JSON: {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
                      optionally "__metadata__": {str: str}}
    [rest]     raw little-endian tensor data; offsets are relative to the start of this section

Only the dtypes Loom uses are supported: F32, F64, BF16, F16, I32, I64 (plus I8/U8/BOOL,
which cost nothing).  The writer emits tensors sorted by name, packed back to back with
no gaps, and pads the header with spaces to a multiple of 8 bytes so that the data
section is 8-byte aligned (what the reference implementation does too).

Usage:
    tensors, metadata = read_safetensors(path)          # dict[str, torch.Tensor], dict[str, str]
    write_safetensors(path, tensors, metadata=None)
"""

from __future__ import annotations

import json
import struct
import sys
from typing import Dict, Mapping, Optional, Tuple

import torch

# safetensors dtype string <-> torch dtype.  Element sizes are checked against the
# header's byte ranges on read, so a wrong table entry cannot go unnoticed.
_DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES: Dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}

# The header length field itself is bounded by the reference implementation (100 MB);
# a larger value means a corrupt or non-safetensors file, not a big header.
_MAX_HEADER = 100_000_000

if sys.byteorder != "little":  # the data section is little-endian; we copy raw bytes
    raise RuntimeError("safetensors_io assumes a little-endian host")


class SafetensorsError(ValueError):
    """A malformed file or an unsupported tensor; the message names the file and tensor."""


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_safetensors(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Read every tensor of a safetensors file.

    Returns (tensors, metadata).  Each tensor owns a private, writable copy of its
    bytes (torch.frombuffer over a bytearray), so callers may modify them freely.
    Raises SafetensorsError with the file and tensor name on any inconsistency
    (bad header, unknown dtype, byte range that does not match the shape, overlap).
    """
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise SafetensorsError(f"{path}: file too short ({len(blob)} bytes) for a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > _MAX_HEADER or 8 + n > len(blob):
        raise SafetensorsError(f"{path}: header length {n} does not fit a file of {len(blob)} bytes")
    try:
        header = json.loads(blob[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")

    data = memoryview(blob)[8 + n :]
    tensors: Dict[str, torch.Tensor] = {}
    ranges = []
    for name, info in header.items():
        try:
            dtype_s, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} needs dtype, shape, data_offsets") from None
        if dtype_s not in _DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype_s!r}")
        dtype = _DTYPES[dtype_s]
        numel = 1
        for d in shape:
            if not isinstance(d, int) or d < 0:
                raise SafetensorsError(f"{path}: tensor {name!r} has bad shape {shape}")
            numel *= d
        nbytes = numel * _element_size(dtype)
        if not (0 <= begin <= end <= len(data)) or end - begin != nbytes:
            raise SafetensorsError(
                f"{path}: tensor {name!r} ({dtype_s}{shape}, {nbytes} bytes) has data_offsets "
                f"[{begin}, {end}] in a data section of {len(data)} bytes"
            )
        ranges.append((begin, end, name))
        if nbytes == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            buf = bytearray(data[begin:end])  # private copy: frombuffer needs it writable
            tensors[name] = torch.frombuffer(buf, dtype=dtype).reshape(shape)

    ranges.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise SafetensorsError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    return tensors, dict(metadata)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a CPU tensor, in row-major order."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16: reinterpret the same 2-byte words as int16.
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def write_safetensors(
    path: str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Optional[Mapping[str, str]] = None,
) -> None:
    """Write tensors (sorted by name) to a safetensors file.

    Tensors keep their dtype; convert before calling if a particular dtype is wanted.
    The header is padded with spaces to a multiple of 8 bytes.
    """
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _NAMES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {t.dtype}")
        raw = _tensor_bytes(t)
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-len(hjson) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for raw in chunks:
            f.write(raw)


if __name__ == "__main__":
    # Self-check: round trip every supported dtype through a temporary file.
    import os
    import tempfile

    g = torch.Generator().manual_seed(0)
    src = {
        "f32": torch.randn(3, 5, generator=g),
        "f64": torch.randn(7, generator=g, dtype=torch.float64),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "i32": torch.arange(-4, 8, dtype=torch.int32).reshape(3, 4),
        "i64": torch.tensor([[-1, 2**40]], dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.safetensors")
        write_safetensors(p, src, {"format": "pt"})
        got, meta = read_safetensors(p)
        with open(p, "rb") as f:
            (hn,) = struct.unpack("<Q", f.read(8))
        assert hn % 8 == 0, hn
    assert meta == {"format": "pt"}, meta
    assert set(got) == set(src)
    for k, v in src.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k
    got["f32"].add_(1)  # must be writable
    print("safetensors_io: round trip OK")
