"""torchrec's state dict, both ways (torchrec_state.py): torchrec's weights load into a
collection and train alike, come back from it, and are refused clearly where they cannot move."""

import pytest
import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import SparseAdam, SparseSGD, StorageConfig, TieredEmbeddingBagCollection

ROWS = 200
LR = 0.1


def tables():
    return [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=ROWS, feature_names=["fa"]),
            EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=ROWS, feature_names=["fb", "fc"],
                               pooling=PoolingType.MEAN)]


def batch(seed, size=16):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * size,), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(["fc", "fa", "fb"], torch.randint(0, ROWS, (int(lengths.sum()),),
                                                                                 generator=gen), lengths)


def sgd_step(module, kjt, bags=None):
    """One step on sum(pooled * target): the fused SparseSGD of ours, torch's SGD on torchrec's weights."""
    out = module(kjt).values()
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7))).sum().backward()
    if bags is not None:
        with torch.no_grad():
            for bag in bags.values():
                bag.weight -= LR * bag.weight.grad
                bag.weight.grad = None
    return out


@pytest.mark.parametrize("id_space,ssd", [("hashed", False), ("hashed", True), ("bounded", True)],
                         ids=["hashed-in-memory", "hashed-ssd", "bounded-ssd"])
def test_torchrec_weights_load_train_alike_and_come_back(tmp_path, id_space, ssd):
    reference = EmbeddingBagCollection(tables())
    # With an SSD tier, most loaded rows go to SSD and come back from there.
    storage = StorageConfig(device_rows=60, host_rows=0, ssd_dir=str(tmp_path)) if ssd else None
    ours = TieredEmbeddingBagCollection(tables(), id_space=id_space, storage=storage, optimizer=SparseSGD(lr=LR),
                                        seed=5)
    ours.load_torchrec_state_dict(reference.state_dict())
    assert ours.storage_stats()["ssd_rows"] > (300 if ssd else -1)
    kjt = batch(0)
    torch.testing.assert_close(ours(kjt).values(), reference(kjt).values(), atol=1e-6, rtol=0)
    for step in range(3):
        sgd_step(ours, batch(step + 1))
        sgd_step(reference, batch(step + 1), reference.embedding_bags)

    state = ours.torchrec_state_dict()
    assert sorted(state) == sorted(reference.state_dict()) == ["embedding_bags.a.weight", "embedding_bags.b.weight"]
    back = EmbeddingBagCollection(tables())
    back.load_state_dict(state)  # strict: every key, every shape
    for name, bag in reference.embedding_bags.items():
        torch.testing.assert_close(back.embedding_bags[name].weight, bag.weight.detach(), atol=1e-6, rtol=0)
    kjt = batch(9)
    torch.testing.assert_close(back(kjt).values(), ours(kjt).values(), atol=1e-6, rtol=0)


def test_a_torchrec_model_state_dict_loads_into_the_same_model_over_ours():
    def dlrm(collection):
        torch.manual_seed(0)
        return DLRM(embedding_bag_collection=collection, dense_in_features=3, dense_arch_layer_sizes=[8, 4],
                    over_arch_layer_sizes=[8, 1])

    reference = dlrm(EmbeddingBagCollection(tables()))
    with torch.no_grad():
        for p in reference.parameters():
            p.uniform_(-0.5, 0.5)  # nothing left at a value the other model starts with
    ours = dlrm(TieredEmbeddingBagCollection(tables(), optimizer=SparseAdam()))
    ours.load_state_dict(reference.state_dict())  # strict: torchrec's table keys are taken
    dense, kjt = torch.randn(16, 3), batch(3)
    torch.testing.assert_close(ours(dense, kjt), reference(dense, kjt), atol=1e-5, rtol=0)
    # A loaded row starts with zero optimizer state, its table at step 0, as a fresh optimizer.
    extra = ours.sparse_arch.embedding_bag_collection.get_extra_state()["tables"]
    assert all(len(t["ids"]) == ROWS and not t["rows"][:, 4:].any() and t["steps"] == 0 for t in extra.values())
    back = dlrm(EmbeddingBagCollection(tables()))
    back.load_state_dict({**{k: v for k, v in ours.state_dict().items() if not k.endswith("_extra_state")},
                          **ours.sparse_arch.embedding_bag_collection.torchrec_state_dict(
                              "sparse_arch.embedding_bag_collection.")})
    torch.testing.assert_close(back(dense, kjt), reference(dense, kjt), atol=1e-5, rtol=0)


def test_torchrec_state_dicts_that_cannot_be_moved_are_refused():
    ours = TieredEmbeddingBagCollection(tables(), optimizer=SparseSGD(lr=LR))
    good = EmbeddingBagCollection(tables()).state_dict()
    with pytest.raises(KeyError, match=r"lacks torchrec's weights \['embedding_bags.b.weight'\]"):
        ours.load_torchrec_state_dict({"embedding_bags.a.weight": good["embedding_bags.a.weight"]})
    with pytest.raises(KeyError, match=r"embedding_bags.z.weight.*of no table"):
        ours.load_torchrec_state_dict({**good, "embedding_bags.z.weight": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match=r"table 'a': embedding_bags.a.weight has shape \[100, 4\]"):
        ours.load_torchrec_state_dict({**good, "embedding_bags.a.weight": torch.zeros(100, 4)})
    with pytest.raises(RuntimeError, match=r"embedding_bags.a.weight has shape \[100, 4\]"):
        ours.load_state_dict({**good, "embedding_bags.a.weight": torch.zeros(100, 4)})
    # Hashed ids beyond num_embeddings have no place in torchrec's weight: refused, not dropped.
    kjt = KeyedJaggedTensor.from_lengths_sync(["fa", "fb", "fc"], torch.tensor([3, ROWS + 5, 10**12]),
                                              torch.tensor([1, 1, 1]))
    sgd_step(ours, kjt)
    with pytest.raises(ValueError, match=r"ids >= num_embeddings.*\{'b': 2\}"):
        ours.torchrec_state_dict()
    huge = TieredEmbeddingBagCollection([EmbeddingBagConfig(name="h", embedding_dim=64, num_embeddings=10**12,
                                                            feature_names=["fh"])])
    with pytest.raises(MemoryError, match=r"tables \['h'\].*more than the .* GiB of memory available.*save_tables"):
        huge.torchrec_state_dict()


RANK_SCRIPT = r"""
import copy, json, sys
import torch, torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import TieredEmbeddingBagCollection

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
tables = lambda: [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=200, feature_names=["fa"]),
                  EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=200, feature_names=["fb", "fc"],
                                     pooling=PoolingType.MEAN)]
torch.manual_seed(0)  # the same torchrec weights on both ranks
reference = EmbeddingBagCollection(tables())
ours = TieredEmbeddingBagCollection(tables(), sharding={"a": "row_wise", "b": "data_parallel"})
ours.load_torchrec_state_dict(reference.state_dict())  # every rank the same state dict, each keeps its own
result = {"rows": all(torch.equal(ours.rows(n, torch.arange(200)), b.weight) for n, b in reference.embedding_bags.items())}
# Each rank's own batch, of variable batch size per feature, with weights the collection ignores.
lengths = torch.tensor([1, 2, 3, 0, 1, 2, 1, 1]) + rank
kjt = KeyedJaggedTensor(keys=["fa", "fb", "fc"], values=torch.arange(int(lengths.sum())) * 7 % 200, lengths=lengths,
                        weights=torch.full((int(lengths.sum()),), 3.0), stride_per_key_per_rank=[[1, 1], [2, 1], [2, 1]],
                        inverse_indices=(["fc", "fa", "fb"], torch.tensor([[2, 0, 1, 1], [0, 1, 1, 0], [2, 2, 0, 1]])))
result["forward"] = bool(torch.allclose(ours(kjt).values(), reference(kjt).values(), atol=1e-6))
for name, call in (("state_dict", ours.torchrec_state_dict), ("copy", lambda: copy.deepcopy(ours))):
    try:
        call()
        result[name] = "no error"
    except (RuntimeError, TypeError) as e:
        result[name] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(result), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_sharded_collections_load_torchrec_weights_and_refuse_what_they_cannot_do(run_ranks):
    for result in run_ranks(RANK_SCRIPT, ["{port}"], world=2, ddp_env=False):
        assert result["rows"] and result["forward"]
        assert result["state_dict"].startswith("RuntimeError") and "sharded over ranks" in result["state_dict"]
        assert result["copy"].startswith("TypeError") and "sharded over ranks" in result["copy"]
