"""Summarize `bench_kernels.py` JSON lines: per kernel shape, the fastest implementation of
each family (cuBLAS, each GEMV form), with its fraction of the HBM copy rate.

  python scripts/bench_kernels.py --only quant --quant-rows 1 | python scripts/best_kernels.py
"""

from __future__ import annotations

import json
import re
import sys


def family(impl: str) -> str:
    """An implementation's family: its name without the tile sizes."""
    return re.sub(r"\s+", " ", re.sub(r"\b(split|[nkws])?\d+(x\d+)?\b", "", impl)).strip()


def main() -> None:
    best: dict[tuple, dict] = {}
    for line in sys.stdin:
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "ms" not in row or "impl" not in row:
            if "error" in row:
                print("error:", json.dumps(row)[:300])
            continue
        shape = tuple((k, row[k]) for k in ("kernel", "n", "k", "bits", "rows") if k in row)
        key = (shape, family(row["impl"]))
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = row
    for (shape, fam), row in sorted(best.items(), key=lambda kv: (kv[0][0], kv[1]["ms"])):
        dims = " ".join(f"{k}={v}" for k, v in shape)
        print(f"{dims:40s} {fam:28s} {row['ms']:.4f} ms  {row.get('frac_hbm', '')}  "
              f"{row['impl']}")


if __name__ == "__main__":
    main()
