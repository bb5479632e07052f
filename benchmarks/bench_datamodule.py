"""Criteo log reading speed: CriteoDataModule vs a plain Python parser vs torchrec's reader.

All three read the same synthetic Criteo file (>= 2M rows) in ONE run, each in the same
number of processes (2 workers, and 1 process), for the same number of passes, in
alternated order (a round runs every reader once; odd rounds run them backwards):
  - ctr-lightning CriteoDataModule: parse + hash + KJT, end to end, its DataLoader
    workers started anew each pass
  - a plain Python line-by-line parser that does the same work (split, int, hex, hash)
  - torchrec.datasets.criteo.criteo_kaggle (csv reader + its row mapper; no hashing, no KJT)
Ours reads the whole file each pass. The slow readers read --sample-rows rows a pass,
cut beforehand (untimed) into one part file a process; a pass forks its processes and
counts until the last one joins. Ratios are medians over the rounds, with their range.
Read the ratios, not the absolute rates.

    python benchmarks/bench_datamodule.py [--rows 2000000 --rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing
import time
from pathlib import Path

import numpy as np

from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo


def plain_python(path: Path) -> int:
    rows = 0
    labels, dense, ids = [], [], []
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            labels.append(float(fields[0]))
            dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]])
            ids.append([hash((i, int(x, 16) if x else -1)) & (2**63 - 1) for i, x in enumerate(fields[14:])])
            rows += 1
    return rows


def torchrec_reader(path: Path) -> int:
    from torchrec.datasets.criteo import criteo_kaggle

    return sum(1 for _ in criteo_kaggle(str(path)))


def _count_into(reader, path: Path, queue) -> None:
    queue.put(reader(path))


def in_processes(reader, parts: list[Path]) -> float:
    """Rows/s of ``reader`` over ``parts``: one forked process a part, or in this
    process when there is one part."""
    start = time.perf_counter()
    if len(parts) == 1:
        rows = reader(parts[0])
    else:
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_count_into, args=(reader, part, queue)) for part in parts]
        for proc in procs:
            proc.start()
        rows = sum(queue.get() for _ in procs)
        for proc in procs:
            proc.join()
    return rows / (time.perf_counter() - start)


def datamodule(path: Path, workers: int) -> float:
    dm = CriteoDataModule(train_paths=[str(path)], batch_size=4096, num_workers=workers)
    dm.setup("fit")
    start = time.perf_counter()
    rows = sum(len(batch) for batch in dm.train_dataloader())
    return rows / (time.perf_counter() - start)


def cut_parts(path: Path, rows: int, processes: int) -> list[Path]:
    """The file's first ``rows`` lines in ``processes`` part files of equal line counts."""
    parts = [path.with_name(f"{path.stem}.first{rows}.part{k}of{processes}.tsv") for k in range(processes)]
    if not all(part.exists() for part in parts):
        with open(path) as src:
            for part in parts:
                part.write_text("".join(itertools.islice(src, rows // processes)))
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--sample-rows", type=int, default=200_000, help="rows a pass of a slow reader")
    parser.add_argument("--dir", default="bench_out")
    parser.add_argument("--rounds", type=int, default=3, help="passes of every reader, alternated")
    parser.add_argument("--workers", type=int, default=2, help="processes of the multi-process readers")
    args = parser.parse_args()
    path = Path(args.dir) / f"criteo-{args.rows}.tsv"
    if not path.exists():
        write_synthetic_criteo(path, rows=args.rows, seed=0)
    parts = {n: cut_parts(path, args.sample_rows, n) for n in (1, args.workers)}
    # The first epoch also loads the compiled parser into the process; it is reported
    # apart and not counted in the rounds.
    first = datamodule(path, workers=0)
    readers = {}
    for n in (args.workers, 1):
        where = f"{n} workers" if n > 1 else "1 process"
        readers[f"ours, {where}"] = lambda n=n: datamodule(path, workers=n if n > 1 else 0)
        readers[f"plain, {where}"] = lambda n=n: in_processes(plain_python, parts[n])
        readers[f"torchrec, {where}"] = lambda n=n: in_processes(torchrec_reader, parts[n])
    rates = {name: [] for name in readers}
    for round_ in range(args.rounds):
        order = list(readers) if round_ % 2 == 0 else list(reversed(readers))
        for name in order:
            rates[name].append(readers[name]())
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {rates[name][-1]:,.0f}" for name in readers), flush=True)
    print(f"file: {path} ({args.rows:,} rows, {path.stat().st_size / 2**20:.0f} MiB); slow readers "
          f"{args.sample_rows:,} rows a pass; {args.rounds} rounds")
    print(f"{'reader (rows/s, median of rounds)':<40}{'rows/s':>12}")
    for name, values in rates.items():
        print(f"{name:<40}{np.median(values):>12,.0f}")
    for n in (args.workers, 1):
        where = f"{n} workers" if n > 1 else "1 process"
        for anchor in ("plain", "torchrec"):
            ratios = sorted(o / a for o, a in zip(rates[f"ours, {where}"], rates[f"{anchor}, {where}"]))
            print(f"ours / {anchor}, {where}: {np.median(ratios):.1f}x ({ratios[0]:.1f}x-{ratios[-1]:.1f}x)"
                  + ("   (target >= 10x)" if anchor == "plain" and n > 1 else ""))
    ours = np.median(rates[f"ours, {args.workers} workers"])
    print(f"ours ({args.workers} workers): {ours / 1e6:.2f}M rows/s   (target >= 1M rows/s); first epoch in "
          f"process, with the one-time load of the compiled parser: {first / 1e6:.2f}M")


if __name__ == "__main__":
    main()
