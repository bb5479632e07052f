"""Synthetic Criteo generation speed: ours (vectorised, Arrow writer) vs a plain Python writer.

Both write the same planted world to disk in ONE run; the plain writer draws the same
per-row quantities with Python's ``random`` and formats each line with str.join.
Absolute numbers on shared 2-core machines are noise; read the ratio.

    python benchmarks/bench_synthetic.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from ctr_lightning.datamodules import SyntheticCriteo, SyntheticCriteoSpec
from ctr_lightning.datamodules.synthetic_criteo import _DENSE_MISSING, _SPARSE_MISSING


def plain_python_writer(gen: SyntheticCriteo, path: Path, rows: int) -> None:
    rnd = random.Random(0)
    cards = gen.cardinalities.tolist()
    s = gen.spec.zipf_exponent
    with open(path, "w") as f:
        for _ in range(rows):
            fields = ["1" if rnd.random() < gen.spec.click_rate else "0"]
            for j in range(13):
                fields.append("" if rnd.random() < _DENSE_MISSING[j] else str(int(rnd.lognormvariate(1.0, 1.5))))
            for c in range(26):
                if rnd.random() < _SPARSE_MISSING[c]:
                    fields.append("")
                    continue
                n1 = cards[c] + 1
                rank = int(((n1 ** (1 - s) - 1) * rnd.random() + 1) ** (1 / (1 - s))) - 1
                fields.append(f"{(rank * 2654435761 + c) & 0xFFFFFFFF:08x}")
            f.write("\t".join(fields) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--plain-rows", type=int, default=100_000, help="rows for the slow plain writer")
    args = parser.parse_args()
    gen = SyntheticCriteo(SyntheticCriteoSpec(seed=0, max_cardinality=1_000_000))
    gen.bias  # calibrated once per world, outside the timed region
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        gen.write(Path(tmp) / "ours.tsv", args.rows)
        ours = args.rows / (time.perf_counter() - t)
        t = time.perf_counter()
        plain_python_writer(gen, Path(tmp) / "plain.tsv", args.plain_rows)
        plain = args.plain_rows / (time.perf_counter() - t)
    print(f"{'writer':<24}{'rows/s':>14}")
    print(f"{'plain Python':<24}{plain:>14,.0f}")
    print(f"{'ctr-lightning':<24}{ours:>14,.0f}")
    print(f"ratio ours / plain: {ours / plain:.1f}x   (target: >= 200,000 rows/s)")


if __name__ == "__main__":
    main()
