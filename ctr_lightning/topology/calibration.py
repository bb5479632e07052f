"""Measure this machine's rates for the cost model: a DLRM step's fixed and per-row costs
with the project's own kernels, the SSD tier's cost per row read, and the links between
ranks. Published figures (``HardwareRates.published``) describe machines not here."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding.tiers.ssd.ssd_log_segments import PARALLEL_READ_MIN
from ctr_lightning.topology.auto_placement import set_threads
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


def dlrm_step(shape: ModelShape, storage: object, sharding: object = "row_wise", seed: int = 0,
              process_group: dist.ProcessGroup | None = None) -> tuple:
    """A DLRM of ``shape`` (torchrec's, on a TieredEmbeddingBagCollection) and a function
    that trains it one step on ``(dense, kjt, labels)`` with dense Adam."""
    from torchrec.models.dlrm import DLRM

    from ctr_lightning.embedding import TieredEmbeddingBagCollection

    dims = shape.dlrm_layers
    ebc = TieredEmbeddingBagCollection(list(shape.tables), storage=storage, optimizer=shape.optimizer, seed=seed,
                                       sharding=sharding, process_group=process_group)
    torch.manual_seed(seed)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=dims[0],
                 dense_arch_layer_sizes=[*dims[1], shape.tables[0].embedding_dim],
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


def make_batch(rng: np.random.Generator, shape: ModelShape, rows: int | Sequence[int], exponents: Sequence[float],
               batch: int | None = None) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """A batch of ``shape``'s model: table i's ids Zipf(``exponents[i]``) over its ``rows[i]``."""
    b = batch or shape.batch_size
    keys = [f for t in shape.tables for f in t.feature_names]
    sizes = _per_table(rows, len(keys))
    ids = np.concatenate([zipf_ids(rng, n, b, s) for n, s in zip(sizes, exponents)])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(ids),
                                              lengths=torch.ones(len(keys) * b, dtype=torch.int32))
    return (torch.from_numpy(rng.standard_normal((b, shape.dlrm_layers[0]), dtype=np.float32)), kjt,
            torch.from_numpy((rng.random(b) < 0.25).astype(np.float32)))


def fill_tables(step: Callable, shape: ModelShape, rows: int | Sequence[int], seed: int = 1) -> None:
    """Touch every id of every table once (ids in order), so that timed steps create no row."""
    rng = np.random.default_rng(seed)
    b = shape.batch_size
    keys = [f for t in shape.tables for f in t.feature_names]
    sizes = _per_table(rows, len(keys))
    for start in range(0, max(sizes), b):
        ids = np.concatenate([np.arange(start, start + b) % n for n in sizes])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(ids),
                                                  lengths=torch.ones(len(keys) * b, dtype=torch.int32))
        step((torch.from_numpy(rng.standard_normal((b, shape.dlrm_layers[0]), dtype=np.float32)), kjt,
              torch.zeros(b)))


def _per_table(rows: int | Sequence[int], n: int) -> list[int]:
    return [rows] * n if isinstance(rows, int) else list(rows)


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


def _unique_rows(*kjts: KeyedJaggedTensor) -> int:
    """Distinct ids per key, summed over keys, of the batches together."""
    per_key = [kjt.to_dict() for kjt in kjts]
    return sum(len(np.unique(np.concatenate([d[k].values().numpy() for d in per_key]))) for k in per_key[0])


@dataclasses.dataclass(frozen=True)
class RateSamples:
    """What :func:`sample_rates` times on one rank, before any fit.

    ``steps``: per skew of the ids (1.4, 1.1, 0.8, uniform), a step's median seconds and the
    mean distinct rows its batches touch, each step pooling ``lookups`` ids. With an SSD,
    ``ssd_steps``: per read density (uniform, then Zipf 1.4), every timed step's raw
    ``(seconds, distinct rows, rows read from the SSD)``. These are kept per step and
    before the fitted fixed and per-row cost are taken away, because that takes the fit,
    and :func:`fit_rates` takes the median of the differences, as measured. Last,
    ``ssd_file_bytes``: the bytes of the tier's files.

    Example::

        samples = sample_rates(shape, threads=2, ssd_dir="runs/calibrate")
        rates = fit_rates(shape, samples)  # what measure_rates(shape, 2, "runs/calibrate") returns
    """

    threads: int
    lookups: int
    steps: tuple[tuple[float, float], ...]
    ssd_steps: tuple[tuple[tuple[float, float, float], ...], ...] = ()
    ssd_file_bytes: int = 0


def measure_rates(shape: ModelShape, threads: int, ssd_dir: str | None = None, rows: int = 100_000,
                  steps: int = 5, base: HardwareRates | None = None,
                  process_group: dist.ProcessGroup | None = None) -> HardwareRates:
    """This machine's rates for one rank of ``threads`` threads, measured on ``shape``'s
    model with ``rows`` rows a table (all in memory), and with ``ssd_dir``, on the SSD tier
    with its pages dropped from the page cache after every step: :func:`sample_rates`,
    then :func:`fit_rates`.

    A step's time is fitted as ``fixed + b * distinct rows`` over batches of several skews
    (the ids a step pools are the same in each): ``fixed`` becomes the dense part, ``b``
    the cost of a row (memory traffic included, so ``device_bw`` is left out of the sum).
    Under torch.distributed, pass a ``process_group`` of this rank alone, so that the
    collection is not sharded.

    Example::

        rates = measure_rates(shape, threads=2, ssd_dir="runs/calibrate")
        plan(machine, shape, rates=rates)
    """
    return fit_rates(shape, sample_rates(shape, threads, ssd_dir, rows, steps, process_group), base)


def sample_rates(shape: ModelShape, threads: int, ssd_dir: str | None = None, rows: int = 100_000,
                 steps: int = 5, process_group: dist.ProcessGroup | None = None) -> RateSamples:
    """The timings :func:`measure_rates` fits (its arguments but ``base``); the SSD tier's
    files, under a temporary folder of ``ssd_dir``, are gone when it returns.

    Example::

        samples = sample_rates(shape, threads=1, ssd_dir="/tmp", rows=3000, steps=2)
        samples.steps  # ((0.0021, 105.5), (0.0023, 240.0), ...): (seconds, distinct rows) per skew
    """
    set_threads(threads)
    rng = np.random.default_rng(0)
    ebc, step = dlrm_step(shape, None, process_group=process_group)
    fill_tables(step, shape, rows)
    timed = []
    n = len(shape.tables)
    lookups = shape.batch_size * n
    for skew in (1.4, 1.1, 0.8, 0.0):
        batches = [make_batch(rng, shape, rows, [skew] * n) for _ in range(steps + 1)]
        step(batches[0])
        times = []
        for batch in batches[1:]:
            start = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - start)
        timed.append((float(np.median(times)), float(np.mean([_unique_rows(b[1]) for b in batches[1:]]))))
    del ebc
    if ssd_dir is None:
        return RateSamples(threads, lookups, tuple(timed))
    budget_rows = max(4 * int(max(u for _, u in timed) / n), rows // 10)
    from ctr_lightning.embedding import StorageConfig

    with tempfile.TemporaryDirectory(dir=ssd_dir) as d:
        ebc, step = dlrm_step(shape, StorageConfig(device_rows=budget_rows, host_rows=0, ssd_dir=d),
                              process_group=process_group)
        fill_tables(step, shape, rows)
        # Two read densities on the same files, far apart (every row alike, and a hot head):
        # their costs give both the cost of a random read and how many bytes one brings in
        # (rows near a read come free).
        densities = []
        for skew in (0.0, 1.4):
            batches = [make_batch(rng, shape, rows, [skew] * n) for _ in range(steps + 3)]
            for batch in batches[:3]:
                step(batch)
            per_step = []
            for batch in batches[3:]:
                drop_cached_pages(d)
                before = ebc.tier_stats()["ssd_hits"]
                start = time.perf_counter()
                step(batch)
                seconds = time.perf_counter() - start
                per_step.append((seconds, float(_unique_rows(batch[1])),
                                 float(ebc.tier_stats()["ssd_hits"] - before)))
            densities.append(tuple(per_step))
        file_bytes = ebc.storage_stats()["ssd_bytes"]
        ebc.stop_prefetch()
        del ebc
    return RateSamples(threads, lookups, tuple(timed), tuple(densities), int(file_bytes))


def fit_rates(shape: ModelShape, samples: RateSamples, base: HardwareRates | None = None) -> HardwareRates:
    """``base`` (the published CPU rates unless given) with the rates ``samples`` of
    ``shape``'s model show: ``row_op_s`` and ``dense_flops`` from the least-squares line
    ``seconds = fixed + row_op_s * distinct rows``; with SSD steps, ``ssd_read_iops`` and
    ``ssd_read_unit`` from what the two read densities cost beyond that line, as
    ``c * W * (1 - exp(-reads / W))`` for W windows of the files read at ``c`` seconds each.
    No I/O and no clock: the same samples give the same rates.

    Example::

        samples = RateSamples(threads=1, lookups=512, steps=((2.3e-3, 100.0), (2.9e-3, 300.0)))
        fit_rates(shape, samples).row_op_s  # 3e-6
    """
    base = base or HardwareRates.published("cpu")
    t = np.array([s[0] for s in samples.steps])
    u = np.array([s[1] for s in samples.steps])
    # Lookups per step are the same in every sample, so their cost goes into `fixed`.
    slope, fixed = np.polyfit(u, t, 1)
    row_op = max(float(slope), 0.0)
    fixed = max(float(fixed), 1e-6)
    threads = samples.threads
    rates = dataclasses.replace(base, name=f"measured here ({threads} thread{'s' if threads > 1 else ''})",
                                device_bw=INF, host_to_device_bw=INF, row_op_s=row_op, lookup_op_s=0.0,
                                dense_flops=shape.dense_flops_per_example * shape.batch_size / fixed)
    if not samples.ssd_steps:
        return rates
    points = []
    for per_step in samples.ssd_steps:
        # What a step costs beyond the in-memory line is its SSD reads'.
        seconds = [s - fixed - row_op * rows for s, rows, _ in per_step]
        points.append((max(float(np.median(seconds)), 1e-6), float(np.median([r for _, _, r in per_step]))))
    (t1, r1), (t2, r2) = points
    if min(r1, r2) < 2 * PARALLEL_READ_MIN:
        # The tier reads fewer rows one at a time: the two costs would differ by that, not by density.
        warnings.warn(f"SSD calibration: {min(r1, r2):.0f} rows read a step at one density, under the "
                      f"{2 * PARALLEL_READ_MIN} from which the SSD tier reads in parallel; its cost a read "
                      f"mixes serial and parallel reads (raise the batch size or the rows)", stacklevel=2)
    file_bytes = samples.ssd_file_bytes
    windows = _windows(t1, r1, t2, r2)
    unit = int(min(max(file_bytes / windows, 4096), file_bytes)) if windows else 4096
    units = windows * -np.expm1(-r1 / windows) if windows else r1
    return dataclasses.replace(rates, ssd_read_iops=units / t1, ssd_read_bw=INF, ssd_write_bw=INF,
                               ssd_read_unit=unit)


def _windows(t1: float, r1: float, t2: float, r2: float) -> float | None:
    """W with t1 / t2 = (1 - exp(-r1 / W)) / (1 - exp(-r2 / W)); None when the times say
    every read costs the same (no W fits: units of one page)."""
    if r1 <= 0 or r2 <= 0 or r1 == r2:
        return None
    target = t1 / t2

    def ratio(w: float) -> float:
        return float(np.expm1(-r1 / w) / np.expm1(-r2 / w))

    lo, hi = 1e-3 * min(r1, r2), 1e6 * max(r1, r2)  # ratio runs from 1 (small W) to r1 / r2 (large W)
    if not min(ratio(lo), ratio(hi)) < target < max(ratio(lo), ratio(hi)):
        return None
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if (ratio(mid) - target) * (ratio(lo) - target) > 0:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


@dataclasses.dataclass(frozen=True)
class LinkSamples:
    """What :func:`sample_links` times on one rank of ``world``, before any fit.

    ``all_to_all``: a small and a large all-to-all, each as (bytes a rank sends to the
    others, median seconds). ``seconds``: a step's median seconds per (run, batch size),
    the runs ``"local"`` (this rank alone), ``"row_wise"``, ``"table_wise"`` and
    ``"data_parallel"``, at 16 examples and at ``examples``. ``local_rows``: per batch size,
    the mean distinct rows of this rank's batch alone; ``replica_rows``: per data-parallel
    batch size, the mean distinct rows of this rank's batch and of all ranks' together.

    Example::

        samples = sample_links(shape, reps=3)  # collective: every rank of the group calls it
        links = fit_links(rates, shape, samples)  # what measure_links(rates, shape, reps=3) returns
    """

    world: int
    examples: int
    all_to_all: tuple[tuple[float, float], tuple[float, float]]
    seconds: Mapping[tuple[str, int], float]
    local_rows: Mapping[int, float]
    replica_rows: Mapping[int, tuple[float, float]]


def measure_links(rates: HardwareRates, shape: ModelShape, group: dist.ProcessGroup | None = None,
                  reps: int = 9, examples: int | None = None) -> HardwareRates:
    """``rates`` with the links between the ranks of ``group`` (collective): the bandwidth
    of all-to-alls; as ``collective_latency_s`` the fixed cost a sharded step pays per
    collective (torchrec's all-to-alls of ids, lengths and pooled rows, their size
    exchanges, the ranks waiting on each other), from a row-wise ``shape`` model on 16
    examples against the same model alone; as ``example_op_s`` the cost of routing an
    example's feature to its owner and back (table-wise on ``examples``), as ``bag_op_s``
    of each bag a row-wise shard pools for another rank's example (row-wise on ``examples``),
    and as ``replica_op_s`` of each row gradient a data-parallel replica
    applies (every table data-parallel, on ``examples`` against 16). ``examples`` is the
    shape's batch size unless given: the costs found at the batch they price, whose work
    stands well above the noise of the fixed costs taken away. :func:`sample_links`, then
    :func:`fit_links`.

    Example::

        links = measure_links(measure_rates(shape, threads=1, process_group=alone), shape)
    """
    return fit_links(rates, shape, sample_links(shape, group, reps, examples))


def sample_links(shape: ModelShape, group: dist.ProcessGroup | None = None, reps: int = 9,
                 examples: int | None = None) -> LinkSamples:
    """The timings :func:`measure_links` fits (collective: every rank of ``group`` calls it).

    Example::

        samples = sample_links(shape, reps=3)
        samples.seconds["row_wise", 16] - samples.seconds["local", 16]  # 5 collectives' latency
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
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
    alone = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    rng = np.random.default_rng(rank)
    b = max(examples or shape.batch_size, 32)
    seconds: dict[tuple[str, int], float] = {}
    local_rows: dict[int, float] = {}  # distinct rows a rank's batch touches alone
    replica_rows: dict[int, tuple[float, float]] = {}  # a rank's distinct rows, and all ranks' together
    runs = (("local", 16, alone[rank], "row_wise"), ("row_wise", 16, group, "row_wise"),
            ("local", b, alone[rank], "row_wise"), ("row_wise", b, group, "row_wise"),
            ("table_wise", b, group, "table_wise"), ("data_parallel", 16, group, "data_parallel"),
            ("data_parallel", b, group, "data_parallel"))
    for name, batch_size, own, sharding in runs:
        tiny = dataclasses.replace(shape, batch_size=batch_size)
        if name == "data_parallel":
            # Every rank draws every rank's batches, to count the distinct rows the replicas step.
            drawers = [np.random.default_rng(1000 + r) for r in range(world)]
            each = [[make_batch(d, tiny, 10_000, [1.0] * len(tiny.tables)) for _ in range(reps + 2)] for d in drawers]
            batches = each[rank]
            timed = list(zip(*each))[2:]
            replica_rows[batch_size] = (float(np.mean([_unique_rows(b[rank][1]) for b in timed])),
                                        float(np.mean([_unique_rows(*[x[1] for x in b]) for b in timed])))
        else:
            batches = [make_batch(rng, tiny, 10_000, [1.0] * len(tiny.tables)) for _ in range(reps + 2)]
            if name == "local":
                local_rows[batch_size] = float(np.mean([_unique_rows(b[1]) for b in batches[2:]]))
        _, step = dlrm_step(tiny, None, sharding, process_group=own)
        for batch in batches[:2]:
            step(batch)
        times = []
        for batch in batches[2:]:
            dist.barrier(group=group)
            start = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - start)
        seconds[name, batch_size] = float(np.median(times))
    return LinkSamples(world, b, (results[0], results[1]), seconds, local_rows, replica_rows)


def fit_links(rates: HardwareRates, shape: ModelShape, samples: LinkSamples) -> HardwareRates:
    """``rates`` with the link rates ``samples`` of ``shape``'s model show (see
    :func:`measure_links` for what each prices); no I/O and no clock.

    Example::

        links = fit_links(rates, shape, LinkSamples(world=2, examples=64, all_to_all=..., seconds=...,
                                                    local_rows=..., replica_rows=...))
        links.intra_node_bw  # bytes/s
    """
    world, b, seconds = samples.world, samples.examples, samples.seconds
    local_rows, replica_rows = samples.local_rows, samples.replica_rows
    (b0, t0), (b1, t1) = samples.all_to_all
    # From the difference, unless noise swallowed it: then the large transfer alone.
    bw = (b1 - b0) / (t1 - t0) if t1 > 1.1 * t0 else b1 / t1
    collectives = 5  # as the cost model counts a sharded step's: ids, lengths, pooled rows, their grads, dense
    latency = max((seconds["row_wise", 16] - seconds["local", 16]) / collectives, 1e-6)
    # At b examples: table-wise, each rank pools its own tables' bags for all ranks (as
    # many bags as alone) and routes its examples' ids and pooled rows; row-wise pools
    # (world - 1) * b bags a feature more. What is left after bytes and latency is per
    # example and feature routed, and per bag pooled for another rank.
    features = sum(len(t.feature_names) for t in shape.tables)
    dim = shape.tables[0].embedding_dim
    ids = b * features * 8 * (world - 1) / world
    table_wise = seconds["table_wise", b] - seconds["local", b] - collectives * latency - (
        b * dim * 4 * features * 2 * (world - 1) / world + ids) / bw
    example = max(table_wise / (b * features), 0.0)
    row_wise = seconds["row_wise", b] - seconds["local", b] - collectives * latency - (
        2 * (world - 1) * b * dim * 4 * features + ids) / bw - example * b * features
    bag = max(row_wise / ((world - 1) * b * features), 0.0)

    # Replicas: a step sends (world - 1) x the rank's distinct ids and their gradient rows,
    # and each replica steps the distinct rows of all ranks' batches; what is left grows
    # with the row gradients applied, world x the rank's distinct ids (as the cost model
    # counts them, less what ``rates`` already charge a lookup for them). The slope between
    # 16 and b examples leaves out what a step pays whatever its size (the collectives'
    # latency, priced above). The replicas' work per lookup (turning pooled gradients into
    # row gradients) lands in it too: it holds for tables about as skewed as these.
    def replica_left(n: int) -> tuple[float, float]:
        own_rows, union = replica_rows[n]
        applied = world * own_rows
        left = (seconds["data_parallel", n] - seconds["local", n] - (world - 1) * own_rows * (8 + dim * 4) / bw
                - rates.row_op_s * (union - local_rows[n]) - applied * (rates.lookup_op_s + dim * 4 * 2 / rates.device_bw))
        return left, applied

    (left_small, rows_small), (left_large, rows_large) = replica_left(16), replica_left(b)
    replica = max((left_large - left_small) / max(rows_large - rows_small, 1.0), 0.0)
    return dataclasses.replace(rates, intra_node_bw=bw, collective_latency_s=latency, example_op_s=example,
                               bag_op_s=bag, replica_op_s=replica)
