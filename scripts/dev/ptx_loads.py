"""Global loads by width in every Triton kernel compiled on this machine (its cache's PTX files).

    python3 scripts/dev/ptx_loads.py [CACHE_DIR]      # default: $TRITON_CACHE_DIR or ~/.triton/cache

Why: Triton only knows an integer argument's divisibility when it is a multiple of 16, so a kernel whose
rows are, say, 72 elements apart loads one element per instruction unless told (tl.multiple_of); a
memory-bound kernel can then be limited by instructions. Narrow loads per kernel show where to look
(the counts are static: loads in a loop body count once).
"""
from __future__ import annotations

import os
import re
import sys
from collections import Counter
from pathlib import Path

LOAD = re.compile(r"\bld\.global[\w.]*")


def load_widths(ptx: str) -> Counter:
    """Bytes per load instruction -> how many such instructions."""
    widths = Counter()
    for op in LOAD.findall(ptx):  # e.g. ld.global.L1::evict_last.v4.b32
        parts = op.split(".")
        lanes = next((int(p[1]) for p in parts if re.fullmatch(r"v[248]", p)), 1)
        bits = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bfsu]\d+", p)), 0)
        widths[lanes * bits // 8] += 1
    return widths


def main() -> None:
    cache = Path(sys.argv[1] if len(sys.argv) > 1 else
                 os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    rows = []
    for path in cache.rglob("*.ptx"):
        ptx = path.read_text()
        name = re.search(r"\.entry\s+(\w+)", ptx)
        rows.append((name.group(1) if name else path.stem, load_widths(ptx)))
    print(f"{len(rows)} kernels in {cache}; global loads by bytes per instruction")
    for name, widths in sorted(rows, key=lambda r: (-sum(n for b, n in r[1].items() if b <= 2), r[0])):
        narrow = sum(n for b, n in widths.items() if b <= 2)
        print(f"{narrow:5d} of {sum(widths.values()):5d} narrow (<= 2 bytes)  "
              + " ".join(f"{b}B x{n}" for b, n in sorted(widths.items())) + f"  {name}")


if __name__ == "__main__":
    main()
