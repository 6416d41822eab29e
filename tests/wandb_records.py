"""What an offline W&B run holds, read back from its `run-<id>.wandb` file: W&B's header (":W&B", magic
0xBEE1, version 0), then LevelDB log records (32 KiB blocks; each record a 7-byte header of CRC32C,
length and type FULL/FIRST/MIDDLE/LAST) that carry serialised `wandb_internal_pb2.Record` protobufs."""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), "not a W&B run file"
    out, pos, pending = [], 7, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:          # the block's tail is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += room            # zero padding to the end of the block
            continue
        payload = data[pos + HEADER: pos + HEADER + length]
        pos += HEADER + length
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def logged(run_dir: str | Path) -> tuple[dict, dict]:
    """(history: key -> every logged value, summary: key -> value) of the offline run in `run_dir`."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    history, summary = {}, {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                history.setdefault(key, []).append(json.loads(item.value_json))
        elif kind == "summary":
            for item in rec.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, summary
