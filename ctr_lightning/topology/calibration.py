"""Measure this machine's rates for the cost model: a DLRM step's fixed and per-row costs
with the project's own kernels, the SSD tier's cost per row read, and the links between
ranks. Published figures (``HardwareRates.published``) describe machines not here."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.topology.cost_model import HardwareRates
from ctr_lightning.topology.planner import ModelShape

INF = 1e30  # a rate whose bytes are already inside a measured per-row cost


def zipf_ids(rng: np.random.Generator, rows: int, n: int, exponent: float) -> np.ndarray:
    """``n`` ids of ``rows``, rank r drawn with weight ~ r^-exponent (0: uniform), the popular
    ones spread over the id range."""
    if exponent <= 0:
        return rng.integers(0, rows, n)
    u = rng.random(n)
    s = exponent
    x = (((rows + 1) ** (1 - s) - 1) * u + 1) ** (1 / (1 - s)) if s != 1 else (rows + 1) ** u
    ranks = np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)
    return (ranks * 2654435761) % rows


def dlrm_step(shape: ModelShape, storage: object, sharding: object = "row_wise", seed: int = 0) -> tuple:
    """A DLRM of ``shape`` (torchrec's, on a TieredEmbeddingBagCollection) and a function
    that trains it one step on ``(dense, kjt, labels)`` with dense Adam."""
    from torchrec.models.dlrm import DLRM

    from ctr_lightning.embedding import TieredEmbeddingBagCollection

    dims = shape.dlrm_layers
    ebc = TieredEmbeddingBagCollection(list(shape.tables), storage=storage, optimizer=shape.optimizer, seed=seed,
                                       sharding=sharding)
    torch.manual_seed(seed)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=dims[0], dense_arch_layer_sizes=list(dims[1]),
                 over_arch_layer_sizes=list(dims[2]))
    sparse = {id(p) for p in ebc.parameters()}
    opt = torch.optim.Adam([p for p in model.parameters() if id(p) not in sparse], lr=1e-3)

    def step(batch: tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]) -> None:
        dense, kjt, labels = batch
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(-1), labels)
        loss.backward()
        opt.step()

    return ebc, step


def make_batch(rng: np.random.Generator, shape: ModelShape, rows: int, exponents: list[float],
               batch: int | None = None) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    b = batch or shape.batch_size
    keys = [f for t in shape.tables for f in t.feature_names]
    ids = np.concatenate([zipf_ids(rng, rows, b, s) for s in exponents])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(ids),
                                              lengths=torch.ones(len(keys) * b, dtype=torch.int32))
    return (torch.from_numpy(rng.standard_normal((b, shape.dlrm_layers[0]), dtype=np.float32)), kjt,
            torch.from_numpy((rng.random(b) < 0.25).astype(np.float32)))


def fill_tables(step: Callable, shape: ModelShape, rows: int, seed: int = 1) -> None:
    """Touch every id of every table once (ids in order), so that timed steps create no row."""
    rng = np.random.default_rng(seed)
    b = shape.batch_size
    keys = [f for t in shape.tables for f in t.feature_names]
    for start in range(0, rows, b):
        ids = np.arange(start, start + b) % rows
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(np.tile(ids, len(keys))),
                                                  lengths=torch.ones(len(keys) * b, dtype=torch.int32))
        step((torch.from_numpy(rng.standard_normal((b, shape.dlrm_layers[0]), dtype=np.float32)), kjt,
              torch.zeros(b)))


def drop_cached_pages(directory: str) -> None:
    """Written back and out of the page cache: the next reads of these files go to the drive."""
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDWR)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _unique_rows(kjt: KeyedJaggedTensor) -> int:
    return sum(len(np.unique(jt.values().numpy())) for jt in kjt.to_dict().values())


def measure_rates(shape: ModelShape, threads: int, ssd_dir: str | None = None, rows: int = 100_000,
                  steps: int = 5, base: HardwareRates | None = None) -> HardwareRates:
    """This machine's rates for one rank of ``threads`` threads, measured on ``shape``'s
    model with ``rows`` rows a table (all in memory), and with ``ssd_dir``, on the SSD tier
    with its pages dropped from the page cache after every step.

    A step's time is fitted as ``fixed + a * lookups + b * distinct rows`` over batches of
    several skews: ``fixed`` becomes the dense part, ``a`` the cost of an id, ``b`` of a
    row (memory traffic included, so ``device_bw`` is left out of the sum).

    Example::

        rates = measure_rates(shape, threads=2, ssd_dir="runs/calibrate")
        plan(machine, shape, rates=rates)
    """
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    base = base or HardwareRates.published("cpu")
    ebc, step = dlrm_step(shape, None)
    fill_tables(step, shape, rows)
    samples = []
    n = len(shape.tables)
    for skew in (1.4, 1.1, 0.8, 0.0):
        batches = [make_batch(rng, shape, rows, [skew] * n) for _ in range(steps + 1)]
        step(batches[0])
        times = []
        for batch in batches[1:]:
            start = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - start)
        lookups = shape.batch_size * n
        samples.append((float(np.median(times)), lookups, np.mean([_unique_rows(b[1]) for b in batches[1:]])))
    # Lookups per step are the same in every sample, so their cost goes into `fixed`.
    t = np.array([s[0] for s in samples])
    u = np.array([s[2] for s in samples])
    slope, fixed = np.polyfit(u, t, 1)
    row_op = max(float(slope), 0.0)
    fixed = max(float(fixed), 1e-6)
    rates = dataclasses.replace(base, name=f"measured here ({threads} thread{'s' if threads > 1 else ''})",
                                device_bw=INF, host_to_device_bw=INF, row_op_s=row_op, lookup_op_s=0.0,
                                dense_flops=shape.dense_flops_per_example * shape.batch_size / fixed)
    del ebc
    if ssd_dir is None:
        return rates
    budget_rows = max(4 * int(u.max() / n), rows // 10)
    from ctr_lightning.embedding import StorageConfig

    with tempfile.TemporaryDirectory(dir=ssd_dir) as d:
        ebc, step = dlrm_step(shape, StorageConfig(device_rows=budget_rows, host_rows=0, ssd_dir=d))
        fill_tables(step, shape, rows)
        batches = [make_batch(rng, shape, rows, [1.1] * n) for _ in range(steps + 3)]
        for batch in batches[:3]:
            step(batch)
        costs = []
        for batch in batches[3:]:
            drop_cached_pages(d)
            before = ebc.tier_stats()["ssd_hits"]
            start = time.perf_counter()
            step(batch)
            elapsed = time.perf_counter() - start
            read = ebc.tier_stats()["ssd_hits"] - before
            if read:
                costs.append((elapsed - fixed - row_op * _unique_rows(batch[1])) / read)
        ebc.stop_prefetch()
        del ebc
    per_row = max(float(np.median(costs)), 1e-9) if costs else 1e-9
    return dataclasses.replace(rates, ssd_read_iops=1 / per_row, ssd_read_bw=INF, ssd_write_bw=INF)


def measure_links(rates: HardwareRates, group: dist.ProcessGroup | None = None, reps: int = 5) -> HardwareRates:
    """``rates`` with the bandwidth and latency of all-to-alls between the ranks of ``group``
    (collective), as the links between ranks of one node."""
    world = dist.get_world_size(group)
    results = []
    for nbytes in (1 << 12, 1 << 23):
        x = torch.zeros(nbytes // 4 // world * world)
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=group)
        times = []
        for _ in range(reps):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_to_all_single(y, x, group=group)
            times.append(time.perf_counter() - start)
        results.append((x.numel() * 4 * (world - 1) / world, float(np.median(times))))
    (b0, t0), (b1, t1) = results
    bw = (b1 - b0) / max(t1 - t0, 1e-9)
    latency = max(t0 - b0 / bw, 1e-6)
    return dataclasses.replace(rates, intra_node_bw=bw, collective_latency_s=latency)
