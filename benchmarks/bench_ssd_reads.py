"""What a row read from the SSD tier costs, by layout, with the reads a step waits on serial
below 4,096 rows (the anchor: 2,048 rows a reader thread at least, as before 2026-12-05)
and parallel from 512 (256 a thread, the default now), in ONE run. (Reads in background
threads, read-ahead and cleaning, still go parallel from 4,096; nothing here reads ahead.)

The model and data are bench_planner's (8 tables of dim 32 with Adam rows; batch 2048), each
layout's SSD files written once and read by both settings in turn, the guest's page cache
dropped before every step, as for tables larger than RAM:

  calibration  8 tables of ``--rows`` ids, 10% of each in DRAM, every table at one Zipf
               exponent (1.4, 1.1, 0.8, uniform): the files the planner's calibration reads
  B / C        bench_planner's candidates: 10% of the bytes in DRAM split by skew / by size
  small files  8 tables of ``--rows`` / 8 ids, 20% in DRAM, Zipf 0.5

Prints per layout the rows read a step, the microseconds a step waits on SSD reads per row
read, the step's time with each setting, and their ratio.

    python benchmarks/bench_ssd_reads.py [--rows 200000 --steps 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable

import numpy as np

from ctr_lightning.embedding import StorageConfig
import ctr_lightning.embedding.tiers.ssd.ssd_log_segments as ssd_log_segments
from ctr_lightning.topology import ModelShape, PlanOptions, TableAccess, discover, plan
from ctr_lightning.topology.auto_placement import set_threads
from ctr_lightning.topology.calibration import dlrm_step, fill_tables, make_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_planner  # noqa: E402  (the same model, tables and candidates)

SERIAL_BELOW = 2048  # the anchor: records a reader thread, at least
DEFAULT = ssd_log_segments.PARALLEL_READ_MIN


def timed_steps(ebc: object, step: Callable, batches: list, directory: str,
                per_thread: int) -> tuple[float, float, float]:
    """Median over ``batches`` of (rows read, ms waiting on SSD reads, step ms)."""
    ssd_log_segments.PARALLEL_READ_MIN = per_thread
    seconds, reads, stall = np.median(bench_planner.time_steps(ebc, step, batches, directory), axis=0)
    return float(reads), float(stall * 1e3), float(seconds * 1e3)


def layout(name: str, shape: ModelShape, rows: int | list[int], storage_in: Callable[[str], object],
           skews_list: list[list[float]], steps: int, work: str) -> list[tuple]:
    """Fill one layout's tables (``storage_in(directory)`` places them), then per skew: warm
    up, and time both settings in turn."""
    directory = tempfile.mkdtemp(dir=work)
    ebc, step = dlrm_step(shape, storage_in(directory))
    fill_tables(step, shape, rows)
    rng = np.random.default_rng(10)
    lines = []
    try:
        for skews in skews_list:
            for batch in [make_batch(rng, shape, rows, skews) for _ in range(3)]:
                step(batch)
            got: dict[int, list] = {SERIAL_BELOW: [], DEFAULT: []}
            # A-B-B-A: the log grows as it is read, and the machine drifts; both settings meet both alike.
            for setting in (SERIAL_BELOW, DEFAULT, DEFAULT, SERIAL_BELOW):
                batches = [make_batch(rng, shape, rows, skews) for _ in range(steps)]
                got[setting].append(timed_steps(ebc, step, batches, directory, setting))
            old, new = (np.median(np.array(got[s]), axis=0) for s in (SERIAL_BELOW, DEFAULT))
            label = name if len(skews_list) == 1 else f"{name}, Zipf {skews[0]}"
            lines.append((label, old, new, ebc.storage_stats()["ssd_bytes"]))
            print(f"  {label}: {old[0]:,.0f} rows read a step; step {old[2]:.1f} -> {new[2]:.1f} ms", flush=True)
    finally:
        ssd_log_segments.PARALLEL_READ_MIN = DEFAULT
        ebc.stop_prefetch()
        shutil.rmtree(directory, ignore_errors=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="ids of a large table")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per setting and turn (2 turns each)")
    parser.add_argument("--dir", default="bench_out/ssd_reads", help="SSD files (deleted at the end)")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=args.dir)
    set_threads(2)
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: str) -> None:
    shape = bench_planner.model_shape(args.rows, 2048)
    n = len(shape.tables)
    uniform = bench_planner.model_shape(args.rows, 2048, uniform=True)
    small = bench_planner.model_shape(args.rows // 8, 2048, uniform=True)
    machine = discover()
    access = {t.name: TableAccess.zipf(t.num_embeddings, s) for t, s in zip(shape.tables, bench_planner.SKEWS)}
    total = sum(t.num_embeddings * shape.row_bytes(t) for t in shape.tables)

    def planned(skew_aware: bool) -> Callable[[str], object]:
        def storage_in(directory: str) -> object:
            p = plan(machine, shape, access, PlanOptions(device_bytes=int(0.1 * total), ssd_dirs=(directory,),
                                                        skew_aware=skew_aware))
            return p.storage(0)
        return storage_in

    print(f"SSD reads: serial below {2 * SERIAL_BELOW} rows (anchor) against parallel from {2 * DEFAULT} "
          f"({ssd_log_segments.READ_THREADS} reader threads), {args.steps} x 2 timed steps each", flush=True)
    lines = []
    lines += layout("calibration files", uniform, args.rows,
                    lambda d: StorageConfig(device_rows=args.rows // 10, host_rows=0, ssd_dir=d),
                    [[s] * n for s in (1.4, 1.1, 0.8, 0.0)], args.steps, work)
    lines += layout("B: 10% in DRAM by skew", shape, bench_planner.table_rows(args.rows), planned(True),
                    [list(bench_planner.SKEWS)], args.steps, work)
    lines += layout("C: 10% in DRAM by size", shape, bench_planner.table_rows(args.rows), planned(False),
                    [list(bench_planner.SKEWS)], args.steps, work)
    lines += layout("small files", small, args.rows // 8,
                    lambda d: StorageConfig(device_rows=args.rows // 40, host_rows=0, ssd_dir=d),
                    [[0.5] * n], args.steps, work)
    print()
    print(f"| layout | SSD files MiB | rows read a step | us a read, serial below {2 * SERIAL_BELOW} "
          f"| us a read, parallel from {2 * DEFAULT} | step ms (anchor) | step ms | anchor / now |")
    print("|---|---|---|---|---|---|---|---|")
    for label, old, new, file_bytes in lines:
        print(f"| {label} | {file_bytes / 2**20:.0f} | {old[0]:,.0f} | {old[1] * 1e3 / max(old[0], 1):.1f} "
              f"| {new[1] * 1e3 / max(new[0], 1):.1f} | {old[2]:.1f} | {new[2]:.1f} | {old[2] / new[2]:.2f}x |")


if __name__ == "__main__":
    main()
