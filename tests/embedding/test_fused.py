import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import FusedEmbeddingBagCollection, RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseSGD

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=50, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=30, feature_names=["f1", "f2"]),
]


def random_kjt(gen, batch=8, keys=("f0", "f1", "f2"), max_len=3, id_range=1000):
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=gen)
    values = torch.randint(0, id_range, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=values, lengths=lengths)


def reference_pool(weights, kjt, tables, mean=False):
    """Plain per-bag loop: fold ids, gather, sum (or mean)."""
    feature_table = {f: i for i, t in enumerate(tables) for f in t.feature_names}
    out = {}
    for key, jt in kjt.to_dict().items():
        t = feature_table[key]
        rows = []
        for bag in jt.to_dense():
            ids = bag % tables[t].num_embeddings
            pooled = weights[t][ids].sum(0) if len(ids) else torch.zeros(tables[t].embedding_dim)
            rows.append(pooled / max(len(ids), 1) if mean else pooled)
        out[key] = torch.stack(rows)
    return out


def test_forward_matches_reference_and_reorders_keys():
    gen = torch.Generator().manual_seed(0)
    ebc = FusedEmbeddingBagCollection(TABLES, optimizer=SparseSGD(lr=0.1))
    kjt = random_kjt(gen, keys=("f2", "f0", "f1"))
    kt = ebc(kjt)
    assert kt.keys() == ["f0", "f1", "f2"]
    weights = [w.clone() for w in ebc.kernel.split_embedding_weights()]
    want = reference_pool(weights, kjt, TABLES)
    for key in ("f0", "f1", "f2"):
        torch.testing.assert_close(kt[key], want[key])


def test_mean_pooling():
    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=20, feature_names=["f"],
                                 pooling=PoolingType.MEAN)]
    ebc = FusedEmbeddingBagCollection(tables, optimizer=SparseSGD())
    kjt = random_kjt(torch.Generator().manual_seed(1), keys=("f",))
    weights = [w.clone() for w in ebc.kernel.split_embedding_weights()]
    torch.testing.assert_close(ebc(kjt)["f"], reference_pool(weights, kjt, tables, mean=True)["f"])


@pytest.mark.parametrize("optimizer", [SparseSGD(lr=0.3), SparseAdagrad(lr=0.2), RowWiseAdagrad(lr=0.2)])
def test_fused_update_matches_reference_optimizer(optimizer):
    gen = torch.Generator().manual_seed(2)
    ebc = FusedEmbeddingBagCollection(TABLES, optimizer=optimizer)
    weights = [w.clone().requires_grad_(True) for w in ebc.kernel.split_embedding_weights()]
    state = [torch.zeros_like(w) for w in weights]
    for _ in range(5):
        kjt = random_kjt(gen)
        target = torch.randn(8, 12, generator=gen)
        loss = ((ebc(kjt).values() - target) ** 2).sum()
        loss.backward()
        ref = reference_pool(weights, kjt, TABLES)
        ref_loss = ((torch.cat([ref["f0"], ref["f1"], ref["f2"]], 1) - target) ** 2).sum()
        grads = torch.autograd.grad(ref_loss, weights)
        with torch.no_grad():
            for w, g, s in zip(weights, grads, state):
                touched = g.abs().sum(1) > 0
                if isinstance(optimizer, RowWiseAdagrad):
                    s[touched] += (g[touched] ** 2).mean(1, keepdim=True)
                    w[touched] -= optimizer.lr * g[touched] / (s[touched].sqrt() + optimizer.eps)
                elif isinstance(optimizer, SparseAdagrad):
                    s[touched] += g[touched] ** 2
                    w[touched] -= optimizer.lr * g[touched] / (s[touched].sqrt() + optimizer.eps)
                else:
                    w -= optimizer.lr * g
    for got, want in zip(ebc.kernel.split_embedding_weights(), weights):
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)


def test_state_dict_round_trip_includes_optimizer_state():
    gen = torch.Generator().manual_seed(3)
    a = FusedEmbeddingBagCollection(TABLES, optimizer=RowWiseAdagrad(lr=0.1), seed=1)
    a(random_kjt(gen)).values().sum().backward()
    b = FusedEmbeddingBagCollection(TABLES, optimizer=RowWiseAdagrad(lr=0.1), seed=2)
    b.load_state_dict(a.state_dict())
    kjt = random_kjt(gen)
    a(kjt).values().sum().backward()
    b(kjt).values().sum().backward()
    for wa, wb in zip(a.kernel.split_embedding_weights(), b.kernel.split_embedding_weights()):
        torch.testing.assert_close(wa, wb)


def test_bad_inputs_name_the_feature_and_table():
    ebc = FusedEmbeddingBagCollection(TABLES)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.tensor([1, 2]),
                                              lengths=torch.tensor([1, 1]))
    with pytest.raises(KeyError, match=r"lacks features \['f2'\] of tables \['t1'\]"):
        ebc(kjt)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, -5]),
                                              lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"negative id -5 in feature 'f2' \(table 't1'\)"):
        ebc(kjt)
    with pytest.raises(ValueError, match="no CPU Adam kernel"):
        FusedEmbeddingBagCollection(TABLES, optimizer=SparseAdam())


def test_torchrec_dlrm_accepts_it():
    from torchrec.models.dlrm import DLRM

    ebc = FusedEmbeddingBagCollection(TABLES, optimizer=SparseSGD(lr=0.5))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=3, dense_arch_layer_sizes=[4],
                 over_arch_layer_sizes=[5, 1])
    kjt = random_kjt(torch.Generator().manual_seed(4))
    dense = torch.randn(8, 3, generator=torch.Generator().manual_seed(5))
    before = [w.clone() for w in ebc.kernel.split_embedding_weights()]
    logits = model(dense, kjt)
    # The same DLRM fed the reference pooling of the same rows.
    pooled = reference_pool(before, kjt, TABLES)
    sparse = torch.stack([pooled[f] for f in ("f0", "f1", "f2")], dim=1)
    want = model.over_arch(model.inter_arch(model.dense_arch(dense), sparse))
    torch.testing.assert_close(logits, want)
    # Backward through DLRM reaches the fused optimizer: touched rows move, the others stay.
    logits.sum().backward()
    after = ebc.kernel.split_embedding_weights()
    for t, table in enumerate(TABLES):
        touched = torch.zeros(table.num_embeddings, dtype=torch.bool)
        for f in table.feature_names:
            touched[kjt[f].values() % table.num_embeddings] = True
        moved = (after[t] != before[t]).any(dim=1)
        assert moved.any() and not (moved & ~touched).any(), table.name
