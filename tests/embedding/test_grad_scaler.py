"""Loss scaling (torch.amp.GradScaler): the rows train on unscaled gradients and skip the
steps the scaler skips, although their optimizer runs inside backward."""

import numpy as np
import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import SparseAdam, SparseSGD, StorageConfig, TieredEmbeddingBagCollection

# Two dims: two table groups, each with its own update in backward.
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10**6, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10**6, feature_names=["f1"]),
]
STEPS = 8
OVERFLOW_STEP = 4


def batches(steps: int = STEPS) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, 4, (2 * 16,), generator=gen)
        values = torch.randint(0, 200, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=values, lengths=lengths)
        out.append((kjt, torch.randint(0, 2, (16,), generator=gen).float()))
    return out


class Model(nn.Module):
    def __init__(self, tmp_path, name: str, optimizer, kernel: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embeddings = TieredEmbeddingBagCollection(
            TABLES, storage=StorageConfig(device_rows=60, host_rows=0, ssd_dir=str(tmp_path / name)),
            optimizer=optimizer, kernel=kernel)
        self.head = nn.Linear(12, 1)

    def forward(self, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embeddings(kjt).values()).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def state(model: Model) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    ids = np.arange(200)
    return ({t.name: model.embeddings.rows(t.name, ids) for t in TABLES},
            [p.detach().clone() for p in model.head.parameters()])


def assert_same(got, want) -> None:
    for name in want[0]:
        assert torch.isfinite(got[0][name]).all(), name
        torch.testing.assert_close(got[0][name], want[0][name], rtol=0, atol=0)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def train_unscaled(model: Model, data) -> None:
    dense = torch.optim.Adam(model.head.parameters(), lr=0.01)
    for kjt, labels in data:
        dense.zero_grad()
        model(kjt, labels).backward()
        dense.step()


def train_scaled(model: Model, data, overflow_at: int | None = None) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    model.embeddings.set_grad_scaler(scaler)
    dense = torch.optim.Adam(model.head.parameters(), lr=0.01)
    for step, (kjt, labels) in enumerate(data):
        dense.zero_grad()
        loss = model(kjt, labels)
        if step == overflow_at:
            loss = loss * float("inf")  # every gradient overflows: the scaler skips this step
        scaler.scale(loss).backward()
        scaler.step(dense)
        scaler.update()
    return scaler


@pytest.mark.parametrize("kernel", ["numba", "torch"])
@pytest.mark.parametrize("optimizer", [SparseSGD(lr=0.1), SparseAdam(lr=0.05)], ids=lambda o: type(o).__name__)
def test_scaled_loss_trains_the_rows_as_the_unscaled_one(tmp_path, optimizer, kernel):
    data = batches()
    reference = Model(tmp_path, "reference", optimizer, kernel)
    train_unscaled(reference, data)
    scaled = Model(tmp_path, "scaled", optimizer, kernel)
    train_scaled(scaled, data)
    # Power-of-two scales: scaling and unscaling are exact.
    assert_same(state(scaled), state(reference))


@pytest.mark.parametrize("kernel", ["numba", "torch"])
def test_a_step_the_scaler_skips_leaves_rows_and_optimizer_state_as_they_were(tmp_path, kernel):
    data = batches()
    skipping = Model(tmp_path, "skipping", SparseAdam(lr=0.05), kernel)
    scaler = train_scaled(skipping, data, overflow_at=OVERFLOW_STEP)
    assert scaler.get_scale() == 2.0**11  # the scaler saw the overflow and backed off once
    # Equal to a run that never saw that batch: rows, Adam's moments and step counts untouched.
    reference = Model(tmp_path, "reference", SparseAdam(lr=0.05), kernel)
    train_unscaled(reference, [b for i, b in enumerate(data) if i != OVERFLOW_STEP])
    assert_same(state(skipping), state(reference))
    got, want = whole_rows(skipping), whole_rows(reference)
    for name in want:
        assert got[name][2] == want[name][2] == STEPS - 1  # step counts
        assert torch.equal(got[name][0], want[name][0]) and torch.equal(got[name][1], want[name][1]), name


def whole_rows(model: Model) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """Per table: stored ids, their rows with optimizer state (sorted by id), step count."""
    model.embeddings.checkpoint_to_snapshots(None)  # whole rows in the state, on purpose
    out = {}
    for name, table in model.embeddings.get_extra_state()["tables"].items():
        order = torch.argsort(table["ids"])
        out[name] = (table["ids"][order], table["rows"][order], table["steps"])
    return out


def test_an_overflow_in_one_table_group_skips_every_table_of_the_step(tmp_path):
    model = Model(tmp_path, "model", SparseSGD(lr=0.1), "numba")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    model.embeddings.set_grad_scaler(scaler)
    kjt, labels = batches(1)[0]
    before = state(model)[0]
    pooled = model.embeddings(kjt).values()
    # Only t1's columns (the second group) see the overflow; t0's gradient alone is finite.
    loss = (pooled[:, :8] ** 2).sum() + float("inf") * pooled[:, 8:].sum()
    scaler.scale(loss).backward()
    after = state(model)[0]
    for name in before:
        assert torch.equal(after[name], before[name]), name


def test_float16_autocast_without_a_scaler_warns(tmp_path):
    model = Model(tmp_path, "model", SparseSGD(lr=0.1), "numba")
    kjt, labels = batches(1)[0]
    with pytest.warns(UserWarning, match=r"float16 autocast with no GradScaler handed to set_grad_scaler"):
        with torch.autocast("cpu", dtype=torch.float16):
            model(kjt, labels)
