"""Sharded embedding tables on 1 vs 2 gloo ranks, ours and torchrec's, in ONE run.

The Criteo-shaped workload of bench_embedding.py (26 tables, dim 64, Zipf ids) with a
global batch of 4096 split over the ranks; each step is lookup + sum-pool + backward +
sparse update. It runs, each as its own set of processes on 127.0.0.1:
  ours      TieredEmbeddingBagCollection, Adam, row-wise sharded (all-to-alls of
            torchrec.distributed.dist_data)
  ours tw   the same, table-wise sharded
  ours k16  row-wise owners with sparse_sync="k_step": local replicas, rows pulled when
            first touched, deltas pushed to the owners every 16 steps (2 ranks only)
  ours ssd  row-wise, each owner with 10% of its rows in DRAM and the rest on SSD (2 ranks)
  ours ssd+pf  the same through the working-set prefetcher, 4 batches ahead: ids go to
            their owners early and the owners read their rows from SSD meanwhile
  torchrec  DistributedModelParallel, table-wise sharding, fused FBGEMM CPU kernel,
            row-wise Adagrad (torchrec cannot shard row-wise on CPU)
Prints global examples/s for 1 and 2 ranks, the ratios, and the bytes our all-to-alls
send per step. The configurations take turns over ``--rounds`` rounds; the best counts.
On a 2-core machine two ranks share the cores (one thread each), so this measures the
overhead of sharding, not a speed-up.

    python benchmarks/bench_sharded.py [--rows 100000 --steps 10 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_embedding import BATCH, TABLES, configs, zipf_batches  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local(kjt, rank: int, world: int):
    """This rank's slice of a global one-id-per-bag batch."""
    share = BATCH // world
    values = kjt.values().reshape(TABLES, BATCH)[:, rank * share : (rank + 1) * share].reshape(-1)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=values.contiguous(),
                                               lengths=torch.ones(TABLES * share, dtype=torch.int32))


def _model(impl: str, rows: int, world: int, ssd_dir: str):
    if impl.startswith("ours"):
        from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection

        # An owner holds about rows / world of each table; 10% of those stay in memory.
        storage = (StorageConfig(device_rows=rows // world // 10, host_rows=0, ssd_dir=ssd_dir)
                   if impl.startswith("ours ssd") else None)
        ebc = TieredEmbeddingBagCollection(configs(rows), optimizer=SparseAdam(lr=1e-3), storage=storage,
                                           sharding="table_wise" if impl == "ours tw" else "row_wise",
                                           sparse_sync="k_step" if impl == "ours k16" else "step", sync_every=16)
        return ebc, lambda kjt: ebc(kjt).values().sum().backward()
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = configs(rows)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for t in tables})
    plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder], plan=plan)

    def step(kjt):
        out = model(kjt)
        out = out.wait() if hasattr(out, "wait") else out
        out.values().sum().backward()
    return None, step


def rank_main(args) -> None:
    # Ranks share the cores: each gets its share of threads, as OMP_NUM_THREADS would.
    threads = max(1, (os.cpu_count() or 1) // args.world)
    torch.set_num_threads(threads)
    import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    warmup = [_local(k, args.rank, args.world) for k in zipf_batches(args.rows, args.warmup, seed=0)]
    batches = [_local(k, args.rank, args.world) for k in zipf_batches(args.rows, args.steps, seed=1)]
    ebc, step = _model(args.impl, args.rows, args.world, args.ssd_dir)

    def loop(kjts):
        if args.impl == "ours ssd+pf":
            from ctr_lightning.embedding import WorkingSetPrefetcher

            return WorkingSetPrefetcher(kjts, ebc, lookahead=4, release_on_next=True)
        return kjts

    for kjt in loop(warmup):
        step(kjt)
    dist.barrier()
    sent = ebc.comm_bytes() if ebc is not None else 0
    stall = ebc.tier_stats()["ssd_stall_us"] if ebc is not None else 0
    start = time.perf_counter()
    timed = loop(batches)
    for kjt in timed:
        step(kjt)
    dist.barrier()
    seconds = time.perf_counter() - start
    per_step = ((ebc.comm_bytes() - sent) / len(batches)) if ebc is not None else 0.0
    # Waiting on SSD per step: demand reads, and reads ahead not finished in time.
    waited = (ebc.tier_stats()["ssd_stall_us"] - stall + getattr(timed, "wait_us", 0)) if ebc is not None else 0
    if args.rank == 0:
        print("RESULT " + json.dumps({"examples_per_s": len(batches) * BATCH / seconds, "bytes_per_step": per_step,
                                      "stall_ms": waited / 1000 / len(batches)}))
    dist.destroy_process_group()


def run(impl: str, world: int, args) -> dict:
    port = _free_port()
    with tempfile.TemporaryDirectory() as ssd:
        cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--world", str(world), "--port", str(port),
               "--rows", str(args.rows), "--steps", str(args.steps), "--warmup", str(args.warmup), "--ssd-dir", ssd]
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{impl} on {world} ranks failed:\n{err[-3000:]}")
    line = next(l for l in outs[0][0].splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="turns each configuration takes; the best counts")
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ssd-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.impl is not None:
        rank_main(args)
        return
    print(f"{TABLES} tables x {args.rows:,} rows, dim 64, global batch {BATCH}, Zipf s=1.1, gloo on 127.0.0.1")
    runs = ([(impl, world) for world in (1, 2) for impl in ("ours", "ours tw", "torchrec")]
            + [("ours k16", 2), ("ours ssd", 2), ("ours ssd+pf", 2)])
    best: dict[tuple[str, int], dict] = {}
    for _ in range(args.rounds):
        for key in runs:
            result = run(*key, args)
            if key not in best or result["examples_per_s"] > best[key]["examples_per_s"]:
                best[key] = result
    print(f"{'configuration':<30}{'ranks':>6}{'examples/s':>14}{'a2a bytes/step/rank':>22}")
    for (impl, world), r in best.items():
        print(f"{impl:<30}{world:>6}{r['examples_per_s']:>14,.0f}{r['bytes_per_step']:>22,.0f}")
    for world in (1, 2):
        tr = best[("torchrec", world)]["examples_per_s"]
        for impl in ("ours", "ours tw"):
            kind = "table-wise" if impl == "ours tw" else "row-wise"
            print(f"{world} rank(s): ours {kind} / torchrec table-wise = "
                  f"{best[(impl, world)]['examples_per_s'] / tr:.2f}x")
    k16 = best[("ours k16", 2)]
    print(f"2 ranks: sparse_sync k_step(16) / step = {k16['examples_per_s'] / best[('ours', 2)]['examples_per_s']:.2f}x "
          f"speed, {k16['bytes_per_step'] / best[('ours', 2)]['bytes_per_step']:.2f}x bytes")
    in_memory = best[("ours", 2)]["examples_per_s"]
    for impl in ("ours ssd", "ours ssd+pf"):
        r = best[(impl, 2)]
        print(f"2 ranks: {impl} / all in memory = {r['examples_per_s'] / in_memory:.2f}x, "
              f"SSD stall {r['stall_ms']:.2f} ms/step on rank 0")
    for impl in ("ours", "ours tw", "torchrec"):
        print(f"{impl}: 2 ranks / 1 rank = {best[(impl, 2)]['examples_per_s'] / best[(impl, 1)]['examples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
