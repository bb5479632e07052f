"""Log reading speed: CriteoDataModule vs a plain Python parser vs torchrec's reader; and
(``--case delimited``) DelimitedDataModule vs the Criteo reader (on a Criteo file of as many
rows), pandas.read_csv and Python's csv module.

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

``--case delimited`` (issue 40) writes a CSV with a header (a label, 4 dense columns with
empties, 8 categorical ones, integers and strings, one of them quoted with the delimiter
inside, a multi-hot list, a user and an event time) and reads all of it in one process,
every reader each round, alternated:
  - ours, format: DelimitedFormat's read + decode (labels, dense floats, hashed ids)
  - ours, DataModule: DelimitedDataModule end to end (batches with their KJT), no workers
  - pandas.read_csv (C parser, inferred types; no hashing): the fast anchor
  - a plain Python csv-module parser doing our work (floats, hashes, lists split)

    python benchmarks/bench_datamodule.py --case delimited [--rows 200000 --rounds 3]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import multiprocessing
import time
from pathlib import Path

import numpy as np

from ctr_lightning.datamodules import (CriteoDataModule, DelimitedDataModule, DelimitedFormat,
                                      write_synthetic_criteo)
from ctr_lightning.datamodules.sources import FileSlice


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


DELIMITED_ROLES = dict(label_column="click", dense_columns=["price", "bid", "age", "count"],
                       categorical_columns=["ad", "campaign", "slot", "os", "site", "app", "device", "city"],
                       multi_hot_columns=["tags"], group_column="user", event_time_column="when")


def write_delimited(path: Path, rows: int, seed: int = 0) -> None:
    """A CSV ad log with a header, of the roles in DELIMITED_ROLES (and one unused column)."""
    rng = np.random.default_rng(seed)
    columns = ["click", *DELIMITED_ROLES["dense_columns"], *DELIMITED_ROLES["categorical_columns"], "tags", "user",
               "when", "note"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            price = np.round(rng.random(n) * 100, 3).astype(str)
            price[rng.random(n) < 0.1] = ""
            bid = np.round(rng.random(n), 5).astype(str)
            age = rng.integers(18, 80, n).astype(str)
            count = rng.integers(0, 1000, n).astype(str)
            count[rng.random(n) < 0.2] = ""
            ints = [rng.integers(0, m, n).astype(str) for m in (10**9, 10**5, 50, 8)]
            strings = [np.char.add(p, rng.integers(0, m, n).astype(str)) for p, m in
                       (("site", 10**4), ("app", 10**3), ("dev", 10**6))]
            city = np.char.add("city ", rng.integers(0, 300, n).astype(str))
            city = np.char.add(city, ", region")  # the delimiter inside: written quoted
            tags = ["|".join(f"t{x}" for x in rng.integers(0, 500, k)) for k in rng.integers(0, 6, n)]
            user = rng.integers(0, 10**5, n).astype(str)
            when = (1_796_000_000 + rng.integers(0, 86_400, n)).astype(str)
            click = (rng.random(n) < 0.2).astype(int).astype(str)
            writer.writerows(zip(click, price, bid, age, count, *ints, *strings, city, tags, user, when,
                                 ["x"] * n))


def delimited_format(path: Path) -> int:
    fmt = DelimitedFormat(**DELIMITED_ROLES)
    return sum(len(fmt.decode(block)) for block in fmt.read(FileSlice(str(path), header_lines=1), lambda row: "skip"))


def delimited_datamodule(path: Path) -> int:
    dm = DelimitedDataModule(train_paths=[str(path)], batch_size=4096, **DELIMITED_ROLES)
    dm.setup("fit")
    return sum(len(batch) for batch in dm.train_dataloader())


def criteo_datamodule(path: Path) -> int:
    """The Criteo reader end to end on a Criteo file of as many rows (no workers): the
    speed the delimited reader is held to."""
    dm = CriteoDataModule(train_paths=[str(path)], batch_size=4096, num_workers=0)
    dm.setup("fit")
    return sum(len(batch) for batch in dm.train_dataloader())


def pandas_read_csv(path: Path) -> int:
    import pandas

    return len(pandas.read_csv(path))


def csv_module(path: Path) -> int:
    """Our work, in plain Python: labels, dense floats (empty: 0), a salted hash per
    categorical value and multi-hot item."""
    names = DELIMITED_ROLES
    rows = 0
    labels, dense, ids, bags, groups, times = [], [], [], [], [], []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        at = {name: header.index(name) for name in header}
        d = [at[c] for c in names["dense_columns"]]
        c = [at[c] for c in names["categorical_columns"]]
        m, g, t = at["tags"], at["user"], at["when"]
        for fields in reader:
            labels.append(float(fields[0]))
            dense.append([float(fields[k]) if fields[k] else 0.0 for k in d])
            ids.append([hash((i, fields[k])) & (2**63 - 1) for i, k in enumerate(c)])
            bags.append([hash((len(c), x)) & (2**63 - 1) for x in fields[m].split("|")] if fields[m] else [])
            groups.append(hash(fields[g]) & (2**63 - 1))
            times.append(int(fields[t]))
            rows += 1
    return rows


def delimited_case(args: argparse.Namespace) -> None:
    rows = args.rows or 200_000
    path = Path(args.dir) / f"delimited-{rows}.csv"
    if not path.exists():
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        write_delimited(path, rows)
    criteo = Path(args.dir) / f"criteo-{rows}.tsv"
    if not criteo.exists():
        write_synthetic_criteo(criteo, rows=rows, seed=0)
    first = delimited_datamodule(path)  # loads the compiled decoders; not counted
    assert first == rows, (first, rows)
    assert criteo_datamodule(criteo) == rows
    readers = {"ours, format": delimited_format, "ours, DataModule": delimited_datamodule,
               "Criteo reader, DataModule": criteo_datamodule, "pandas.read_csv": pandas_read_csv,
               "plain csv module": csv_module}
    files = {name: criteo if name.startswith("Criteo") else path for name in readers}
    rates = {name: [] for name in readers}
    for round_ in range(args.rounds):
        order = list(readers) if round_ % 2 == 0 else list(reversed(readers))
        for name in order:
            start = time.perf_counter()
            assert readers[name](files[name]) == rows, name
            rates[name].append(rows / (time.perf_counter() - start))
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {rates[name][-1]:,.0f}" for name in readers), flush=True)
    print(f"file: {path} ({rows:,} rows, {path.stat().st_size / 2**20:.0f} MiB); {args.rounds} rounds, one process")
    print(f"{'reader (rows/s, median of rounds)':<40}{'rows/s':>12}")
    for name, values in rates.items():
        print(f"{name:<40}{np.median(values):>12,.0f}")
    for ours in ("ours, format", "ours, DataModule"):
        for anchor in ("Criteo reader, DataModule", "pandas.read_csv", "plain csv module"):
            ratios = sorted(o / a for o, a in zip(rates[ours], rates[anchor]))
            print(f"{ours} / {anchor}: {np.median(ratios):.2f}x ({ratios[0]:.2f}x-{ratios[-1]:.2f}x)")


def criteo_case(args: argparse.Namespace) -> None:
    args.rows = args.rows or 2_000_000
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["criteo", "delimited"], default="criteo")
    parser.add_argument("--rows", type=int, default=None, help="rows of the file (criteo 2,000,000; delimited 200,000)")
    parser.add_argument("--sample-rows", type=int, default=200_000, help="rows a pass of a slow reader (criteo)")
    parser.add_argument("--dir", default="bench_out")
    parser.add_argument("--rounds", type=int, default=3, help="passes of every reader, alternated")
    parser.add_argument("--workers", type=int, default=2, help="processes of the multi-process readers (criteo)")
    args = parser.parse_args()
    if args.case == "delimited":
        delimited_case(args)
    else:
        criteo_case(args)


if __name__ == "__main__":
    main()
