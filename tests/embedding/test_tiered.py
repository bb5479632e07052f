
import numpy as np
import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import (
    GatheringSsdRowsError,
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
    StorageConfig,
    TieredEmbeddingBagCollection,
    plan_storage,
)

ROWS = 5000
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=ROWS, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=ROWS, feature_names=["f1", "f2"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=ROWS, feature_names=["f3"]),
]
FEATURE_TABLE = {"f0": 0, "f1": 1, "f2": 1, "f3": 2}
BATCH = 8


def tiny_tiers(tmp_path):
    # 1% of each table's rows in the device tier, 5% in DRAM, the rest on SSD.
    return StorageConfig(device_rows=ROWS // 100, host_rows=ROWS // 20, ssd_dir=str(tmp_path / "ssd"))


def workload(seed, steps, weighted=False):
    gen = torch.Generator().manual_seed(seed)
    keys = ["f3", "f0", "f2", "f1"]  # not the config order: the module must reorder
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(keys) * BATCH,), generator=gen)  # multi-hot and empty bags
        hot = torch.randint(0, 60, (int(lengths.sum()),), generator=gen)  # a skewed head ...
        cold = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)  # ... and a long tail
        pick = torch.rand(int(lengths.sum()), generator=gen) < 0.6
        values = torch.where(pick, hot, cold)
        weights = torch.rand(int(lengths.sum()), generator=gen) if weighted else None
        target = torch.randn(BATCH, 28, generator=gen)
        yield KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights), target


def loss_of(kt, target):
    return (kt.values() * target).sum() + 0.5 * (kt.values() ** 2).sum()


class Reference(nn.Module):
    """Dense float32 tables, torch's sparse EmbeddingBag and a torch optimizer."""

    def __init__(self, tiered, optimizer, weighted, tables=TABLES):
        super().__init__()
        self.bags = nn.ModuleList()
        for t in tables:
            mode = "mean" if t.pooling == PoolingType.MEAN else "sum"
            bag = nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=mode, sparse=True)
            with torch.no_grad():
                bag.weight.copy_(tiered.rows(t.name, np.arange(t.num_embeddings)))
            self.bags.append(bag)
        self.weighted = weighted
        params = list(self.parameters())
        if isinstance(optimizer, RowWiseAdagrad):
            self.opt = None
            self.acc = [torch.zeros(t.num_embeddings) for t in tables]
            self.cfg = optimizer
        elif isinstance(optimizer, SparseAdam):
            self.opt = torch.optim.SparseAdam(params, lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps)
        elif isinstance(optimizer, SparseAdagrad):
            self.opt = torch.optim.Adagrad(params, lr=optimizer.lr, eps=optimizer.eps)
        else:
            self.opt = torch.optim.SGD(params, lr=optimizer.lr)

    def forward(self, kjt):
        parts = {}
        for key, jt in kjt.to_dict().items():
            bag = self.bags[FEATURE_TABLE[key]]
            w = jt.weights() if self.weighted else None
            parts[key] = bag(jt.values(), jt.offsets()[:-1], per_sample_weights=w)
        return torch.cat([parts[f] for f in ["f0", "f1", "f2", "f3"]], dim=1)

    def step(self, loss):
        if self.opt is not None:
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            return
        for bag in self.bags:
            bag.weight.grad = None
        loss.backward()
        with torch.no_grad():
            for bag, acc in zip(self.bags, self.acc):
                g = bag.weight.grad.coalesce()
                rows, vals = g.indices()[0], g.values()
                acc[rows] += vals.pow(2).mean(1)
                bag.weight[rows] -= self.cfg.lr * vals / (acc[rows].sqrt() + self.cfg.eps).unsqueeze(1)


def train(ebc, steps, weighted=False):
    for kjt, target in workload(0, steps, weighted):
        loss_of(ebc(kjt), target).backward()
    return {t.name: ebc.rows(t.name, np.arange(ROWS)) for t in TABLES}


@pytest.mark.parametrize("kernel", ["numba", "torch"])
@pytest.mark.parametrize("optimizer", [SparseAdam(lr=0.05), SparseAdagrad(lr=0.1), RowWiseAdagrad(lr=0.1),
                                       SparseSGD(lr=0.05)], ids=lambda o: type(o).__name__)
def test_matches_dense_reference_and_tiers_agree_bit_for_bit(tmp_path, optimizer, kernel):
    steps = 40
    in_device = TieredEmbeddingBagCollection(TABLES, optimizer=optimizer, id_space="bounded", kernel=kernel)
    tiered = TieredEmbeddingBagCollection(TABLES, storage=tiny_tiers(tmp_path), optimizer=optimizer,
                                          id_space="bounded", kernel=kernel)
    ref = Reference(in_device, optimizer, weighted=False)
    for kjt, target in workload(0, steps):
        ref_loss = loss_of_reference(ref(kjt), target)
        ref.step(ref_loss)
    got_device = train(in_device, steps)
    got_tiered = train(tiered, steps)
    stats = tiered.tier_stats()
    assert stats["ssd_hits"] > 0 and stats["host_hits"] > 0, stats  # all three tiers were exercised
    for i, t in enumerate(TABLES):
        torch.testing.assert_close(got_device[t.name], ref.bags[i].weight.detach(), atol=1e-5, rtol=0)
        assert torch.equal(got_device[t.name], got_tiered[t.name]), t.name


def loss_of_reference(values, target):
    return (values * target).sum() + 0.5 * (values ** 2).sum()


def test_weighted_bags_match_reference(tmp_path):
    sum_tables = [TABLES[0], EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=ROWS,
                                                feature_names=["f1", "f2"]), TABLES[2]]
    ebc = TieredEmbeddingBagCollection(sum_tables, storage=tiny_tiers(tmp_path), optimizer=SparseSGD(lr=0.05),
                                       is_weighted=True)
    ref = Reference(ebc, SparseSGD(lr=0.05), weighted=True, tables=sum_tables)
    for kjt, target in workload(1, 15, weighted=True):
        ref.step(loss_of_reference(ref(kjt), target))
        loss_of(ebc(kjt), target).backward()
    for i, t in enumerate(sum_tables):
        torch.testing.assert_close(ebc.rows(t.name, np.arange(ROWS)), ref.bags[i].weight.detach(),
                                   atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="weighted bags need SUM pooling"):
        TieredEmbeddingBagCollection(TABLES, is_weighted=True)


def test_untouched_rows_are_stored_nowhere_and_deterministic(tmp_path):
    ebc = TieredEmbeddingBagCollection(TABLES, storage=tiny_tiers(tmp_path), seed=7)
    ids = np.array([0, 10**12, 2**62])
    a = ebc.rows("t0", ids)
    again = TieredEmbeddingBagCollection(TABLES, seed=7).rows("t0", ids)
    assert torch.equal(a, again)
    assert not torch.equal(a, TieredEmbeddingBagCollection(TABLES, seed=8).rows("t0", ids))
    bound = (1.0 / ROWS) ** 0.5
    assert a.abs().max() <= bound
    with torch.no_grad():
        ebc.eval()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2", "f3"],
                                                  values=torch.tensor([10**12, 5, 6, 7]),
                                                  lengths=torch.tensor([1, 1, 1, 1]))
        ebc(kjt)
    ebc.checkpoint_to_snapshots(None)  # whole rows in the state dict, asked for
    state = ebc.get_extra_state()
    assert sum(len(t["ids"]) for t in state["tables"].values()) == 0  # looked up, never trained: not stored


def test_hashed_ids_are_collision_free():
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    ebc = TieredEmbeddingBagCollection(tables, optimizer=SparseSGD(lr=1.0))
    big = [3, 3 + 10, 3 + 2**40]  # equal modulo num_embeddings, distinct rows here
    before = ebc.rows("t", big)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([3]), lengths=torch.tensor([1]))
    ebc(kjt).values().sum().backward()
    after = ebc.rows("t", big)
    assert not torch.equal(after[0], before[0])
    assert torch.equal(after[1:], before[1:])


def test_checkpoint_round_trip(tmp_path):
    a = TieredEmbeddingBagCollection(TABLES, storage=tiny_tiers(tmp_path / "a"), optimizer=SparseAdam(lr=0.05))
    train(a, 10)
    b = TieredEmbeddingBagCollection(TABLES, storage=tiny_tiers(tmp_path / "b"), optimizer=SparseAdam(lr=0.05))
    path = tmp_path / "ebc.pt"
    with pytest.raises(GatheringSsdRowsError, match=r"tables \['t0', 't1', 't2'\] would gather into memory"):
        a.state_dict()  # an SSD tier's rows are not gathered unless asked for
    a.checkpoint_to_snapshots(None)
    torch.save(a.state_dict(), path)
    b.load_state_dict(torch.load(path, weights_only=False))
    for kjt, target in workload(5, 5):
        loss_of(a(kjt), target).backward()
        loss_of(b(kjt), target).backward()
    for t in TABLES:
        assert torch.equal(a.rows(t.name, np.arange(ROWS)), b.rows(t.name, np.arange(ROWS)))


def test_bad_inputs_name_table_and_cause(tmp_path):
    ebc = TieredEmbeddingBagCollection(TABLES, id_space={"t0": "bounded", "t1": "hashed", "t2": "hashed"})
    def kjt(values, keys=("f0", "f1", "f2", "f3")):
        return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=torch.tensor(values),
                                                   lengths=torch.ones(len(values), dtype=torch.int32))
    with pytest.raises(ValueError, match=r"table 't0': id 5000 is outside \[0, 5000\)"):
        ebc(kjt([5000, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"table 't2': id -4 is negative"):
        ebc(kjt([1, 1, 2, -4]))
    ebc(kjt([1, 10**15, 2, 3]))  # hashed tables take any non-negative id
    with pytest.raises(KeyError, match=r"lacks features \['f3'\] of tables \['t2'\]"):
        ebc(kjt([1, 2, 3], keys=("f0", "f1", "f2")))
    # A batch on an accelerator (meta stands in for CUDA here) while the tables sit in CPU memory.
    elsewhere = KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.zeros(4, dtype=torch.long, device="meta"),
                                  lengths=torch.ones(4, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"tables \['t0', 't1', 't2'\] are in cpu memory but the KJT is on meta"):
        ebc(elsewhere)
    with pytest.raises(ValueError, match="needs StorageConfig.ssd_dir"):
        TieredEmbeddingBagCollection(TABLES, storage=StorageConfig(host_rows=10))


def test_unusable_ssd_dir_names_tables(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the SSD directory should be")
    with pytest.raises(OSError, match=r"SSD tier of tables \['t0'\]: cannot create files in"):
        TieredEmbeddingBagCollection(TABLES, storage=StorageConfig(device_rows=50, host_rows=100,
                                                                   ssd_dir=str(blocker / "ssd")))


def test_lfu_eviction_and_planned_capacities_give_the_same_weights(tmp_path):
    reference = train(TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05)), 20)
    lfu = StorageConfig(device_rows=ROWS // 100, host_rows=ROWS // 20, ssd_dir=str(tmp_path / "lfu"),
                        eviction="lfu")
    row_bytes = 4 * (8 + 16)  # dim 8 with Adam's two moments
    planned = plan_storage(TABLES, device_bytes=3 * 60 * row_bytes, host_bytes=3 * 250 * row_bytes,
                           ssd_dir=str(tmp_path / "planned"))
    # Shares follow num_embeddings * dim: t0 and t1 alike, t2 (dim 4) half of either.
    assert planned["t0"].device_bytes == planned["t1"].device_bytes == 2 * planned["t2"].device_bytes
    for storage in (lfu, planned):
        ebc = TieredEmbeddingBagCollection(TABLES, storage=storage, optimizer=SparseAdam(lr=0.05))
        got = train(ebc, 20)
        stats = ebc.tier_stats()
        assert stats["host_hits"] + stats["ssd_hits"] > 0, stats  # rows came back from below
        for t in TABLES:
            assert torch.equal(got[t.name], reference[t.name]), t.name


def test_dtype_conversions_leave_the_device_tier_where_it_is():
    # meta stands in for CUDA: .float() / .double() on the module must not pull the tier to CPU.
    ebc = TieredEmbeddingBagCollection(TABLES, device="meta")
    ebc.double()
    assert ebc.device == torch.device("meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cpu_steps", [0, 5])  # moved before first use (as Lightning does), or with rows held
def test_device_tier_in_gpu_memory_matches_cpu(tmp_path, cpu_steps):
    optimizer = SparseAdam(lr=0.05)
    cpu = TieredEmbeddingBagCollection(TABLES, storage=tiny_tiers(tmp_path / "cpu"), optimizer=optimizer)
    gpu = TieredEmbeddingBagCollection(TABLES, storage=tiny_tiers(tmp_path / "gpu"), optimizer=optimizer)
    for step, (kjt, target) in enumerate(workload(0, 20)):
        if step == cpu_steps:
            gpu = gpu.cuda()  # after cpu_steps steps, move_device_tier carries rows and their Adam state
            assert gpu._built().groups[0].tiers.device_tier.values.is_cuda
        loss_of(cpu(kjt), target).backward()
        device = "cuda" if step >= cpu_steps else "cpu"
        out = gpu(kjt.to(device))
        assert out.values().device.type == device
        loss_of(out, target.to(device)).backward()
    for t in TABLES:
        torch.testing.assert_close(gpu.rows(t.name, np.arange(ROWS)), cpu.rows(t.name, np.arange(ROWS)),
                                   atol=1e-5, rtol=0)


def test_k_step_tables_follow_the_strategy_unless_told_otherwise():
    following = TieredEmbeddingBagCollection(TABLES, sparse_sync="k_step")
    fixed = TieredEmbeddingBagCollection(TABLES, sparse_sync="k_step", sync_every=8)
    for ebc in (following, fixed):
        ebc.follow_merge_schedule(4, warmup_steps=2)
    assert (following._merge_schedule.k, following._merge_schedule.warmup_steps) == (4, 2)
    assert (fixed._merge_schedule.k, fixed._merge_schedule.warmup_steps) == (8, 0)
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        TieredEmbeddingBagCollection(TABLES, sparse_sync="k_step", sync_every=0)


def growing_workload(steps, new_per_step=10):
    """Hashed ids: a hot head, rows seen before, and ids never seen (the table grows)."""
    gen = torch.Generator().manual_seed(3)
    keys = ["f0", "f1", "f2", "f3"]
    for step in range(steps):
        lengths = torch.randint(1, 4, (len(keys) * BATCH,), generator=gen)
        n = int(lengths.sum())
        seen = torch.randint(0, max(1, step * new_per_step), (n,), generator=gen) * 7919 + 2**40
        hot = torch.randint(0, 30, (n,), generator=gen)
        values = torch.where(torch.rand(n, generator=gen) < 0.3, hot, seen)
        values[:new_per_step] = (step * new_per_step + torch.arange(new_per_step)) * 7919 + 2**40
        yield KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths), torch.randn(
            BATCH, 28, generator=gen)


@pytest.mark.parametrize("host_rows", [0, 40], ids=["device_then_ssd", "device_host_ssd"])
def test_many_ssd_cleanings_under_pressure_match_all_in_memory_bit_for_bit(tmp_path, host_rows):
    steps = 300
    ids = {t: set() for t in ("t0", "t1", "t2")}
    results = []
    for storage in (StorageConfig(), StorageConfig(device_rows=60, host_rows=host_rows, ssd_dir=str(tmp_path / "ssd"),
                                                   ssd_segment_bytes=2 << 10)):
        ebc = TieredEmbeddingBagCollection(TABLES, storage=storage, optimizer=SparseAdam(lr=0.05))
        for kjt, target in growing_workload(steps):
            for key, jt in kjt.to_dict().items():
                ids[TABLES[FEATURE_TABLE[key]].name].update(jt.values().tolist())
            loss_of(ebc(kjt), target).backward()
        results.append({t: ebc.rows(t, np.array(sorted(ids[t]))) for t in ids})
    stats = ebc.tier_stats()
    stored = ebc.storage_stats()
    # Segments of 2 KiB hold about 20 rows: the log was cleaned many times over.
    assert stats["ssd_segments_cleaned"] >= 20 and stats["ssd_records_moved"] > 0, stats
    assert stats["ssd_hits"] > 1000 and stored["ssd_bytes"] <= 1.5 * stored["ssd_live_bytes"] + 3 * (2 << 10), stored
    for t in ids:
        assert torch.equal(results[0][t], results[1][t]), t


def test_a_device_tier_smaller_than_one_batch_names_the_table_and_numbers(tmp_path):
    ebc = TieredEmbeddingBagCollection(TABLES, storage=StorageConfig(device_rows=10, host_rows=0,
                                                                     ssd_dir=str(tmp_path / "ssd")))
    ids = torch.arange(12)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2", "f3"], values=torch.cat([ids] * 4),
                                              lengths=torch.tensor([12, 12, 12, 12]))  # one bag of 12 ids each
    with pytest.raises(RuntimeError, match=r"table 't0': one batch touches more rows than its tier holds \(12 rows "
                                           r"in the batches in flight, capacity 10 rows\)"):
        ebc(kjt)
