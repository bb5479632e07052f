import itertools

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning import Batch
from ctr_lightning.embedding import StorageConfig
from ctr_lightning.models import MODELS, CTRModule, DCNv2Module, DeepFMModule, DLRMModule, WideDeepModule
from ctr_lightning.models.layers import MLP, fm_interaction

FEATURES = ["a", "b", "c"]


def multi_hot_batch(seed: int, size: int = 64, num_dense: int = 4, id_range: int = 50) -> Batch:
    """Jagged features: 0 to 3 ids per example and feature (an empty bag included)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES) * size,), generator=g, dtype=torch.int32)
    values = torch.randint(0, id_range, (int(lengths.sum()),), generator=g)
    dense = torch.randn(size, num_dense, generator=g)
    # A label the features decide, so a model that learns lowers its loss.
    labels = ((values.float().mean() < id_range / 2) ^ (dense[:, 0] > 0)).float()
    return Batch(dense=dense, sparse=KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths), labels=labels)


def build(model_class, **kwargs) -> CTRModule:
    extra = {"dense_arch_layer_sizes": [8], "over_arch_layer_sizes": [8, 1]} if model_class is DLRMModule else {}
    return model_class(**{"sparse_feature_names": FEATURES, "num_dense_features": 4, "embedding_dim": 8,
                          "num_embeddings": 50, **extra, **kwargs})


def train_steps(model: CTRModule, batch: Batch, steps: int) -> list[float]:
    optimizer = model.configure_optimizers()
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("model_class", MODELS, ids=lambda c: c.__name__)
def test_dense_optimizer_never_sees_the_tables(model_class):
    model = build(model_class)
    optimizer = model.configure_optimizers()
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    tables = {id(p) for p in model.embeddings.parameters()}
    assert given and not given & tables
    assert given | tables == {id(p) for p in model.parameters()}


@pytest.mark.parametrize(("model_class", "pooling"), list(itertools.product(MODELS, ["sum", "mean"])),
                         ids=lambda v: getattr(v, "__name__", v))
def test_every_model_learns_multi_hot_features_with_either_pooling(model_class, pooling):
    torch.manual_seed(0)
    model = build(model_class, pooling=pooling, sparse_learning_rate=0.05)
    batch = multi_hot_batch(1)
    assert model(batch).shape == (64,)
    losses = train_steps(model, batch, 30)
    assert losses[-1] < 0.8 * losses[0], losses[::5]


def test_mean_pooling_averages_a_bag_and_sum_adds_it():
    batch = multi_hot_batch(2)
    pooled = {p: build(DeepFMModule, pooling=p).embed(batch.sparse) for p in ("sum", "mean")}
    lengths = batch.sparse.lengths().view(len(FEATURES), -1).T.float()  # [B, F]
    full = lengths > 0
    torch.testing.assert_close(pooled["mean"][full] * lengths[full].unsqueeze(-1), pooled["sum"][full])


def test_first_order_models_keep_the_linear_weight_in_the_table_row():
    for model_class, first_order in ((DeepFMModule, True), (WideDeepModule, True), (DCNv2Module, False),
                                     (DLRMModule, False)):
        model = build(model_class)
        dims = {t.embedding_dim for t in model.embeddings.embedding_bag_configs()}
        assert dims == {9 if first_order else 8}, model_class
    model = build(DeepFMModule)
    batch = multi_hot_batch(3)
    rows = model.embed(batch.sparse)
    vectors, weights = model.embed_with_weights(batch.sparse)
    assert vectors.shape == (64, 3, 8)
    torch.testing.assert_close(weights, rows[..., 8].sum(1))
    with pytest.raises(TypeError, match="no first-order column"):
        build(DCNv2Module).embed_with_weights(batch.sparse)


def test_fm_interaction_is_the_sum_over_pairs_of_inner_products():
    v = torch.randn(5, 4, 3)
    pairs = sum((v[:, i] * v[:, j]).sum(-1) for i in range(4) for j in range(i + 1, 4))
    torch.testing.assert_close(fm_interaction(v), pairs)


def pooled_rows(model: CTRModule, batch: Batch) -> torch.Tensor:
    """Each example's sum of its feature's rows, ``[B, F, row width]``, read one id at a
    time from the tables: the reference for what the models pool."""
    size, out = len(batch), []
    for name in FEATURES:
        jagged = batch.sparse[name]
        rows = [model.embeddings.rows(f"t_{name}", ids).sum(0) if len(ids) else None
                for ids in jagged.values().split(jagged.lengths().tolist())]
        width = next(r for r in rows if r is not None).shape[-1]
        out.append(torch.stack([r if r is not None else torch.zeros(width) for r in rows]))
    assert out[0].shape[0] == size
    return torch.stack(out, dim=1)


def cross_layers(model: DCNv2Module, x0: torch.Tensor) -> torch.Tensor:
    """DCN-v2's cross network, written out: x_{l+1} = x0 * (W_l x_l + b_l) + x_l, with
    W_l = U_l V_l when low-rank (Wang et al., 2021, eq. 1)."""
    cross, x = model.cross, x0
    for layer in range(len(cross.bias)):
        if hasattr(cross, "kernels"):
            w = cross.kernels[layer]
        else:
            w = cross.W_kernels[layer] @ cross.V_kernels[layer]
        x = x0 * (x @ w.T + cross.bias[layer].view(-1)) + x
    return x


@pytest.mark.parametrize("structure", ["parallel", "stacked", "crossnet_only"])
@pytest.mark.parametrize("low_rank", [None, 4])
def test_dcn_v2_is_the_cross_network_formula_under_each_structure(structure, low_rank):
    torch.manual_seed(3)
    model = build(DCNv2Module, structure=structure, low_rank=low_rank, cross_layers=2, deep_layer_sizes=[16])
    with torch.no_grad():
        for p in model.cross.parameters():
            p.copy_(torch.randn_like(p) * 0.3)  # torchrec starts the bias at 0: make every term count
    assert (model.deep is None) == (structure == "crossnet_only")
    batch = multi_hot_batch(4)
    with torch.no_grad():
        dense_vectors = batch.dense.unsqueeze(-1) * model.inputs.dense_embedding.weight  # [B, 4, 8]
        x0 = torch.cat([dense_vectors, pooled_rows(model, batch)], dim=1).flatten(1)
        crossed = cross_layers(model, x0)
        top = {"parallel": lambda: torch.cat([crossed, model.deep(x0)], dim=1),
               "stacked": lambda: model.deep(crossed), "crossnet_only": lambda: crossed}[structure]()
        want = top @ model.out.weight.T + model.out.bias
        torch.testing.assert_close(model(batch), want.squeeze(-1))


def test_wide_and_deep_is_a_logistic_regression_plus_the_deep_logit():
    torch.manual_seed(4)
    model = build(WideDeepModule, deep_layer_sizes=[16])
    with torch.no_grad():
        model.wide.bias.fill_(0.7)
        model.wide.dense.weight.copy_(torch.randn_like(model.wide.dense.weight))
    batch = multi_hot_batch(6)
    with torch.no_grad():
        rows = pooled_rows(model, batch)  # [B, F, 8 + 1]: the last column is the feature's wide weight
        wide = 0.7 + batch.dense @ model.wide.dense.weight.squeeze(0) + rows[..., 8].sum(1)
        dense_vectors = batch.dense.unsqueeze(-1) * model.inputs.dense_embedding.weight
        deep = model.deep(torch.cat([dense_vectors, rows[..., :8]], dim=1).flatten(1)).squeeze(-1)
        torch.testing.assert_close(model(batch), wide + deep)


@pytest.mark.parametrize("model_class", [DCNv2Module, DeepFMModule, WideDeepModule], ids=lambda c: c.__name__)
def test_raw_dense_features_feed_the_deep_input_as_they_are(model_class):
    torch.manual_seed(0)
    model = build(model_class, dense_features="raw", sparse_learning_rate=0.05)
    assert model.inputs.width == 4 + 3 * 8 and not hasattr(model.inputs, "dense_embedding")
    batch = multi_hot_batch(5)
    vectors, flat = model.inputs(batch.dense, torch.zeros(64, 3, 8))
    assert vectors.shape == (64, 3, 8)  # only the categorical features interact
    torch.testing.assert_close(flat[:, :4], batch.dense)
    losses = train_steps(model, batch, 30)
    assert losses[-1] < 0.8 * losses[0]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="dense_features"):
        build(DeepFMModule, dense_features="bucketized")
    with pytest.raises(ValueError, match="structure"):
        build(DCNv2Module, structure="sideways")
    with pytest.raises(ValueError, match="pooling"):
        build(DeepFMModule, pooling="max")
    with pytest.raises(ValueError, match="sparse_optimizer"):
        build(WideDeepModule, sparse_optimizer="lamb")
    with pytest.raises(ValueError, match="must end in 1"):
        DLRMModule(over_arch_layer_sizes=[16, 2])
    with pytest.raises(ValueError, match="dropout"):
        MLP(4, [4], dropout=1.0)


def test_hyperparameters_hold_the_subclass_and_base_arguments():
    model = build(DCNv2Module, cross_layers=2, sparse_optimizer="rowwise_adagrad")
    assert model.hparams.cross_layers == 2 and model.hparams.embedding_dim == 8
    assert model.hparams.sparse_optimizer == "rowwise_adagrad"
    assert type(model.embeddings._setup.optimizer).__name__ == "RowWiseAdagrad"


@pytest.mark.parametrize("model_class", [DeepFMModule, DCNv2Module], ids=lambda c: c.__name__)
def test_a_model_on_tiny_tiers_with_ssd_matches_all_in_memory(model_class, tmp_path):
    """Any storage: the same model with small device and host tiers and SSD below (about
    1,000 rows a table, 512 in memory) trains bit for bit as with every row in memory."""
    results = []
    for storage in (None, StorageConfig(device_rows=256, host_rows=256, ssd_dir=str(tmp_path / "ssd"))):
        torch.manual_seed(0)
        model = build(model_class, storage=storage, num_embeddings=2000)
        for step in range(12):
            train_steps(model, multi_hot_batch(10 + step, id_range=2000), 1)
        batch = multi_hot_batch(99, id_range=2000)
        with torch.no_grad():
            results.append((model(batch), model.embeddings.rows("t_b", torch.arange(2000))))
        if storage is not None:
            assert model.embeddings.storage_stats()["ssd_rows"] > 0
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


class TwoLayer(CTRModule):
    """The README's own-model example."""

    def __init__(self, hidden: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.mlp = MLP(self.num_dense_features + self.num_sparse_features * self.embedding_dim, [hidden],
                       output_dim=1)

    def forward(self, batch):
        vectors = self.embed(batch.sparse)
        return self.mlp(torch.cat([batch.dense, vectors.flatten(1)], dim=1)).squeeze(-1)


def test_a_users_own_model_is_a_few_lines_and_trains_with_a_trainer():
    model = TwoLayer(hidden=8, sparse_feature_names=FEATURES, num_dense_features=4, embedding_dim=4,
                     num_embeddings=50)
    batches = [multi_hot_batch(s) for s in range(8)]
    trainer = Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu")
    before = torch.nn.functional.binary_cross_entropy_with_logits(model(batches[0]), batches[0].labels).item()
    loader = DataLoader(batches, batch_size=None, collate_fn=lambda b: b)
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=loader)
    after = torch.nn.functional.binary_cross_entropy_with_logits(model(batches[0]), batches[0].labels).item()
    assert after < before
    assert {"val/auc", "val/logloss", "val/ne", "val/calibration"} <= set(trainer.callback_metrics)
    assert "val/gauc" not in trainer.callback_metrics  # no grouping column in these batches


def test_dlrm_forward_equals_torchrecs_dlrm_on_the_same_tables():
    model = build(DLRMModule)
    batch = multi_hot_batch(6)
    with torch.no_grad():
        torch.testing.assert_close(model(batch), model.dlrm(batch.dense, batch.sparse).squeeze(-1), rtol=0, atol=0)


@pytest.mark.parametrize("model_class", MODELS, ids=lambda c: c.__name__)
def test_every_model_learns_a_log_with_no_dense_column_without_warnings(model_class):
    import warnings

    torch.manual_seed(0)
    ids = torch.randint(0, 50, (3 * 64,), generator=torch.Generator().manual_seed(2))
    labels = (ids[:64] < 25).float()  # feature a's id alone decides
    batch = Batch(dense=torch.zeros(64, 0), labels=labels, sparse=KeyedJaggedTensor(
        keys=FEATURES, values=ids, lengths=torch.ones(3 * 64, dtype=torch.int32)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails: a torch one on zero-element tensors did
        model = build(model_class, num_dense_features=0, sparse_learning_rate=0.05)
        losses = train_steps(model, batch, 20)
    assert losses[-1] < losses[0]
