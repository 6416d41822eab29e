"""The official layout's weight files (spec 6.1): safetensors headers, the single file or the index of
shards, and a streaming writer. Nothing here holds more than one tensor at a time."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(RuntimeError):
    """A checkpoint that does not fit the model: the message lists every problem at once."""


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}


def read_header(path: str | Path) -> dict[str, dict]:
    """{key: {"dtype", "shape", "data_offsets"}} of one safetensors file, without reading tensors."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def has_weights(ckpt_dir: str | Path) -> bool:
    d = Path(ckpt_dir)
    return (d / SINGLE_FILE).is_file() or (d / INDEX_FILE).is_file()


def checkpoint_files(ckpt_dir: str | Path) -> dict[str, Path]:
    """{key: the safetensors file holding it}: the single file, or the index's `weight_map` (spec 6.1)."""
    d = Path(ckpt_dir)
    if (d / SINGLE_FILE).is_file():
        return {k: d / SINGLE_FILE for k in read_header(d / SINGLE_FILE)}
    if (d / INDEX_FILE).is_file():
        weight_map = read_json(d / INDEX_FILE)["weight_map"]
        files = {k: d / name for k, name in weight_map.items()}
        for shard in sorted(set(files.values())):  # the index must agree with the shards
            if not shard.is_file():
                raise CheckpointError(f"{INDEX_FILE} names {shard.name}, which does not exist in {d}")
            in_shard = set(read_header(shard))
            absent = [k for k, f in files.items() if f == shard and k not in in_shard]
            if absent:
                raise CheckpointError(f"{INDEX_FILE} maps {len(absent)} key(s) to {shard.name} that it does "
                                      f"not hold: {absent[:10]}")
        return files
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {d}")


def tensor_shapes(ckpt_dir: str | Path) -> dict[str, list[int]]:
    """{key: shape} of every checkpoint tensor, from the headers only."""
    headers = {f: read_header(f) for f in set(checkpoint_files(ckpt_dir).values())}
    return {k: list(v["shape"]) for h in headers.values() for k, v in h.items()}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """safetensors file written tensor by tensor (no full in-memory copy of the model): 8-byte header
    length, JSON header padded to 8 bytes, then the raw little-endian data in header order."""
    header, offset = {}, 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            f.write(_tensor_bytes(tensors[name]))


def shard_groups(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    """Keys in sorted order, cut into consecutive groups of at most shard_bytes (a bigger tensor alone)."""
    groups, current, size = [], [], 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if current and size + n > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        groups.append(current)
    return groups

