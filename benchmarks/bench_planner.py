"""Does the topology planner pick well on this machine? Candidate placements of one model
and data, the cost model's predicted step against a measured one, in ONE run.

The model: a DLRM (torchrec's, on TieredEmbeddingBagCollection, dense Adam) with 8 tables
of dim 32 and Adam rows (384 bytes), as in ad logs: four large tables with hot heads (2x
``--rows`` each, Zipf 1.3 to 1.05) and four small ones used about evenly (a quarter of
``--rows``, Zipf 0.6 to 0.3), batch 2048 a rank. First the rates of this machine are measured
(``ctr_lightning.topology.calibration``: a DLRM step's fixed and per-row costs on
100k-row tables, the SSD tier's cost per row read with the page cache dropped, gloo
all-to-alls between two ranks on 127.0.0.1); then each candidate is planned
(``ctr_lightning.topology.plan`` with those rates) and run as planned:

  A  1 rank, all rows in DRAM
  B  1 rank, 10% of the rows in DRAM, split over tables by skew (the planner's split), the rest on SSD
  C  1 rank, 10% in DRAM split in proportion to the tables' sizes (uniform), the rest on SSD
  D  2 ranks (gloo, one thread each), row-wise, all in DRAM
  E  2 ranks, table-wise, all in DRAM
  F  2 ranks, the large tables row-wise and the four small ones data-parallel (a replica
     on each rank), all in DRAM
  G  2 ranks, each table sharded as the planner picks (``sharding: auto``) with the link
     rates the two ranks have just measured, all in DRAM
  H  2 ranks, the large tables table-wise and the small ones row-wise, all in DRAM
  I  2 ranks, the large tables row-wise and the small ones table-wise, all in DRAM

Each run fills every row first (no first-touch in the timed steps), warms up, then times
``--steps`` steps (the median; the slowest rank's for 2 ranks). Calibration and runs are
repeated ``--rounds`` times, each round's predictions from its own calibration, and the
medians over rounds are compared (the speed of 2 shared cores drifts within minutes). SSD candidates drop the
tier's pages from the page cache before every step, as for tables larger than RAM.
Prints per candidate predicted and measured ms/step and examples/s, their ratio, and B / C.
Then, for each budget (B and C: one rank, 10% in DRAM; D, E, F, H, I: two ranks, all in DRAM),
the candidates whose measured steps lie within 1.5x of the budget's fastest, the one the
planner would choose among them (highest predicted examples/s) in each round against the
fastest measured in that round, and how often it is the fastest or within 10% of it.

    python benchmarks/bench_planner.py [--rows 200000 --steps 8 --rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding import SparseAdam
from ctr_lightning.topology import ModelShape, PlanOptions, TableAccess, discover, plan
from ctr_lightning.topology.auto_placement import set_threads
from ctr_lightning.topology.calibration import (dlrm_step, drop_cached_pages, fill_tables, make_batch,
                                                measure_links, measure_rates)

# As in ad logs: a few large tables with hot heads (ads, users, queries), several small
# ones whose values are used about evenly. (share of --rows, Zipf exponent) per table.
TABLES = ((2.0, 1.3), (2.0, 1.2), (2.0, 1.1), (2.0, 1.05), (0.25, 0.6), (0.25, 0.5), (0.25, 0.4), (0.25, 0.3))
SKEWS = [s for _, s in TABLES]
DIM = 32


def table_rows(rows: int) -> list[int]:
    return [int(rows * share) for share, _ in TABLES]


def model_shape(rows: int, batch: int, uniform: bool = False) -> ModelShape:
    """The benchmark's model; ``uniform``: every table of ``rows`` ids (as the calibration's)."""
    sizes = [rows] * len(TABLES) if uniform else table_rows(rows)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"])
              for i, n in enumerate(sizes)]
    return ModelShape.dlrm(tables, SparseAdam(lr=1e-3), batch, 13, (64,), (128, 64, 1))


def run_placement(shape: ModelShape, rows: list[int], storage: object, sharding: object, steps: int, cold: str | None,
                  seed: int) -> dict[str, float]:
    """Fill, warm up, time ``steps`` steps of the model placed as given; median seconds a step."""
    ebc, step = dlrm_step(shape, storage, sharding)
    fill_tables(step, shape, rows)
    rng = np.random.default_rng(seed)
    batches = [make_batch(rng, shape, rows, list(SKEWS)) for _ in range(steps + 4)]
    for batch in batches[:4]:
        step(batch)
    seconds, reads, _ = np.median(time_steps(ebc, step, batches[4:], cold), axis=0)
    ebc.stop_prefetch()
    return {"seconds": float(seconds), "ssd_rows": float(reads)}


def time_steps(ebc: object, step: Callable, batches: list, cold: str | None) -> np.ndarray:
    """Per step of ``batches``: seconds, rows read from SSD, seconds waiting on those reads;
    with ``cold``, that SSD directory's pages are dropped from the page cache before each."""
    out = []
    for batch in batches:
        if cold:
            drop_cached_pages(cold)
        before = ebc.tier_stats()
        start = time.perf_counter()
        step(batch)
        seconds = time.perf_counter() - start
        after = ebc.tier_stats()
        out.append((seconds, after["ssd_hits"] - before["ssd_hits"], (after["ssd_stall_us"] - before["ssd_stall_us"]) / 1e6))
    return np.array(out, dtype=np.float64)


def _two_ranks(rank: int, port: int, shape: ModelShape, rows: list[int], steps: int, plans: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    set_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result: dict = {}
    alone = [dist.new_group([r]) for r in range(2)]
    # One thread a rank while the other rank computes too: the rates the candidates meet.
    rates = measure_rates(shape, threads=1, rows=plans["rows"], process_group=alone[rank])
    links = measure_links(rates, shape)
    if rank == 0:
        result["links"] = dataclasses.asdict(links)
    result["sharding"] = {}
    for name, (machine, access, options) in plans["auto"].items():
        # Planned on this pair of ranks with the links just measured (rank 0's reading), so that its
        # estimate is priced with the rates it was chosen by.
        chosen = [plan(machine, shape, access, options, rates=links).sharding() if rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        plans["runs"][name] = (chosen[0], None)
    for name, (sharding, storage) in plans["runs"].items():
        result["sharding"][name] = sharding
        dist.barrier()
        result[name] = run_placement(shape, rows, storage, sharding, steps, None, seed=10 + rank)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows a table")
    parser.add_argument("--batch", type=int, default=2048, help="examples a step a rank")
    parser.add_argument("--steps", type=int, default=8, help="timed steps a candidate")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of calibration and runs; medians count (the 2 shared cores' speed drifts)")
    parser.add_argument("--dir", default="bench_out/planner", help="SSD files (deleted at the end)")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=args.dir)
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: str) -> None:
    machine = discover()
    shape = model_shape(args.rows, args.batch)
    rows = table_rows(args.rows)
    access = {t.name: TableAccess.zipf(t.num_embeddings, s) for t, s in zip(shape.tables, SKEWS)}
    total = sum(t.num_embeddings * shape.row_bytes(t) for t in shape.tables)
    print(f"{len(SKEWS)} tables of {rows} rows, Zipf exponents {SKEWS}, dim {DIM}, Adam "
          f"({shape.row_bytes(shape.tables[0])} B a row, {total / 2**20:.0f} MiB), batch {args.batch} a rank, "
          f"{args.rounds} rounds of calibration and runs", flush=True)
    rounds = [one_round(args, os.path.join(work, f"round{i}"), machine, shape, rows, access, total)
              for i in range(args.rounds)]
    names = list(rounds[0]["predicted"])
    pred = {n: float(np.median([r["predicted"][n] for r in rounds])) for n in names}
    meas = {n: float(np.median([r["measured"][n] for r in rounds])) for n in names}
    per_step = rounds[0]["examples_per_step"]

    print()
    print(f"medians over {args.rounds} rounds (each round's predicted / measured in brackets)")
    print("| candidate | predicted ms/step | measured ms/step | predicted / measured | predicted examples/s "
          "| measured examples/s | SSD rows read a step (predicted / measured) |")
    print("|---|---|---|---|---|---|---|")
    for n in names:
        each = ", ".join(f"{r['predicted'][n] / r['measured'][n]:.2f}" for r in rounds)
        ssd = np.median([r["ssd_measured"][n] for r in rounds])
        print(f"| {n} | {pred[n] * 1e3:.1f} | {meas[n] * 1e3:.1f} | {pred[n] / meas[n]:.2f} ({each}) "
              f"| {per_step[n] / pred[n]:,.0f} | {per_step[n] / meas[n]:,.0f} "
              f"| {rounds[0]['ssd_predicted'][n]:,.0f} / {ssd:,.0f} |")
    print()
    print(f"worst prediction error: {max(abs(pred[n] / meas[n] - 1) for n in names):.0%} (target <= 30%)")
    report_choices(rounds, meas)
    print(f"2 ranks, sharding auto: the planner picks {sorted({k for r in rounds for k in r['auto_two']})}; "
          f"measured row-wise / table-wise: {meas['E 2 ranks table-wise'] / meas['D 2 ranks row-wise']:.2f}x, "
          f"small tables replicated / all row-wise: "
          f"{meas['D 2 ranks row-wise'] / meas['F 2 ranks, small tables replicated']:.2f}x")
    b, c = meas["B 10% DRAM, skew-aware"], meas["C 10% DRAM, uniform"]
    print(f"skew-aware / uniform DRAM split (same budget): {c / b:.2f}x steps/s (target >= 1.1)")
    sys.stdout.flush()


# Candidates that compete for the same resources: one rank with a tenth of the bytes in
# DRAM, and two ranks with every row in DRAM. A (one rank, all in DRAM) has no competitor:
# it is 3-20x faster than any other placement here, so choosing it proves little. G, the
# planner's own sharding, is not a competitor: it is one of the others, planned.
BUDGETS = {
    "1 rank, 10% of the bytes in DRAM": ("B 10% DRAM, skew-aware", "C 10% DRAM, uniform"),
    "2 ranks, all in DRAM": ("D 2 ranks row-wise", "E 2 ranks table-wise", "F 2 ranks, small tables replicated",
                             "H 2 ranks, large tables table-wise, small row-wise",
                             "I 2 ranks, large tables row-wise, small table-wise"),
}
CLOSE = 1.5  # competitors: measured median steps within this factor of the budget's fastest
NEAR = 0.9  # a choice "within 10%": at least this share of the fastest's examples/s


def report_choices(rounds: list[dict], meas: dict[str, float]) -> None:
    """For each budget, the planner's choice among the close competitors (the highest
    predicted examples/s) against the fastest measured, in every round: how often it is
    the fastest, and how often within 10% of it."""
    decisions = fastest_picked = near_picked = 0
    for budget, members in BUDGETS.items():
        best = min(meas[n] for n in members)
        close = [n for n in members if meas[n] <= CLOSE * best]
        spread = max(meas[n] for n in close) / best
        if len(close) < 2:
            print(f"{budget}: no close competitors (only {close[0]} within {CLOSE}x)")
            continue
        print(f"{budget}: {len(close)} candidates within {spread:.2f}x of each other ({', '.join(close)}"
              + (f"; left out, over {CLOSE}x: {', '.join(n for n in members if n not in close)}" if len(close) < len(members) else "")
              + ")")
        for i, r in enumerate(rounds):
            ex_pred = {n: r["examples_per_step"][n] / r["predicted"][n] for n in close}
            ex_meas = {n: r["examples_per_step"][n] / r["measured"][n] for n in close}
            chosen, fastest = max(ex_pred, key=ex_pred.get), max(ex_meas, key=ex_meas.get)
            share = ex_meas[chosen] / ex_meas[fastest]
            decisions += 1
            fastest_picked += chosen == fastest
            near_picked += share >= NEAR
            print(f"  round {i + 1}: chose {chosen}, fastest measured {fastest}: {share:.2f}x")
    if decisions:
        print(f"planner's choice among close competitors: the fastest in {fastest_picked} of {decisions} "
              f"decisions, within 10% of it in {near_picked} of {decisions}")


def one_round(args: argparse.Namespace, work: str, machine: object, shape: ModelShape, rows: list[int],
              access: dict, total: int) -> dict[str, dict]:
    """Calibrate, then plan and run every candidate: a round's predictions and measurements."""
    os.makedirs(work)
    start = time.perf_counter()
    rates2 = measure_rates(shape, threads=2, ssd_dir=work, rows=args.rows)
    print(f"calibration, 1 rank of 2 threads ({time.perf_counter() - start:.0f} s): fixed "
          f"{shape.dense_flops_per_example * args.batch / rates2.dense_flops * 1e3:.1f} ms a step, "
          f"{rates2.row_op_s * 1e9:.0f} ns a distinct row, SSD {1e6 / rates2.ssd_read_iops:.0f} us a random read "
          f"of {rates2.ssd_read_unit / 1024:.0f} KiB", flush=True)

    budget = int(0.1 * total)
    one = {
        "A all in DRAM": PlanOptions(device_bytes=2 * total),
        "B 10% DRAM, skew-aware": PlanOptions(device_bytes=budget, ssd_dirs=(os.path.join(work, "b"),)),
        "C 10% DRAM, uniform": PlanOptions(device_bytes=budget, ssd_dirs=(os.path.join(work, "c"),), skew_aware=False),
    }
    two = {
        "D 2 ranks row-wise": PlanOptions(ranks_per_node=2, device_bytes=2 * total, sharding="row_wise"),
        "E 2 ranks table-wise": PlanOptions(ranks_per_node=2, device_bytes=2 * total, sharding="table_wise"),
        "F 2 ranks, small tables replicated": PlanOptions(
            ranks_per_node=2, device_bytes=2 * total,
            sharding={t.name: "data_parallel" if share < 1 else "row_wise" for t, (share, _) in zip(shape.tables, TABLES)}),
        "G 2 ranks, sharding auto": PlanOptions(ranks_per_node=2, device_bytes=2 * total),
        "H 2 ranks, large tables table-wise, small row-wise": PlanOptions(
            ranks_per_node=2, device_bytes=2 * total,
            sharding={t.name: "row_wise" if share < 1 else "table_wise" for t, (share, _) in zip(shape.tables, TABLES)}),
        "I 2 ranks, large tables row-wise, small table-wise": PlanOptions(
            ranks_per_node=2, device_bytes=2 * total,
            sharding={t.name: "table_wise" if share < 1 else "row_wise" for t, (share, _) in zip(shape.tables, TABLES)}),
    }
    results: dict[str, dict] = {}
    plans = {}
    for name, options in one.items():
        plans[name] = plan(machine, shape, access, options, rates=rates2)
        p = plans[name]
        cold = p.ranks[0].ssd_dir if any(t.ssd_rows for t in p.tables) else None
        storage = p.storage(0) if cold else None
        results[name] = run_placement(shape, rows, storage, p.sharding(), args.steps, cold, seed=10)
        print(f"  ran {name}: {results[name]['seconds'] * 1e3:.1f} ms/step", flush=True)

    port = 29500 + (os.getpid() + int(time.time())) % 1000
    out = os.path.join(work, "two")
    links_probe = {"rows": args.rows, "runs": {}, "auto": {}}
    for name, options in two.items():
        if options.sharding == "auto":
            links_probe["auto"][name] = (machine, access, options)  # planned by the ranks, after the links
        else:
            links_probe["runs"][name] = (plan(machine, shape, access, options, rates=rates2).sharding(), None)
    mp.spawn(_two_ranks, args=(port, shape, rows, args.steps, links_probe, out), nprocs=2, join=True)
    ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
    from ctr_lightning.topology import HardwareRates

    rates_links = HardwareRates(**ranks[0]["links"])
    print(f"  calibration, 2 ranks of 1 thread: fixed "
          f"{shape.dense_flops_per_example * args.batch / rates_links.dense_flops * 1e3:.1f} ms a step, "
          f"{rates_links.row_op_s * 1e9:.0f} ns a distinct row; "
          f"gloo all-to-all on 127.0.0.1: {rates_links.intra_node_bw / 1e9:.2f} GB/s, "
          f"{rates_links.collective_latency_s * 1e6:.0f} us a collective (a sharded step's fixed cost / 5), "
          f"{rates_links.example_op_s * 1e9:.0f} ns an example's feature routed, "
          f"{rates_links.bag_op_s * 1e9:.0f} ns a bag pooled for the other rank, "
          f"{rates_links.replica_op_s * 1e9:.0f} ns a row gradient a replica applies", flush=True)
    for name, options in two.items():
        ran = dataclasses.replace(options, sharding=ranks[0]["sharding"][name])
        plans[name] = plan(machine, shape, access, ran, rates=rates_links)
        results[name] = {"seconds": max(r[name]["seconds"] for r in ranks), "ssd_rows": 0.0}
        print(f"  ran {name}: {results[name]['seconds'] * 1e3:.1f} ms/step"
              + (f" ({plans[name].sharding()})" if name.startswith("G") else ""), flush=True)
    return {"predicted": {n: p.step_estimate.seconds for n, p in plans.items()},
            "measured": {n: results[n]["seconds"] for n in plans},
            "ssd_predicted": {n: p.step_estimate.ssd_rows for n, p in plans.items()},
            "ssd_measured": {n: results[n]["ssd_rows"] for n in plans},
            "examples_per_step": {n: p.examples_per_step for n, p in plans.items()},
            "auto_two": set(ranks[0]["sharding"]["G 2 ranks, sharding auto"].values())}


if __name__ == "__main__":
    main()
