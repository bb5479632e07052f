"""A training forward whose backward never comes (a skipped batch, an exception before
backward) gives its rows back; forwards still waiting for their backward keep them
(forward_pins.ForwardPins)."""

import gc

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection

TABLES = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10**6, feature_names=["f0"])]
IDS_PER_BATCH = 64


def batch_of(ids: torch.Tensor) -> KeyedJaggedTensor:
    # Four bags of 16 ids: every id its own row.
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=ids, lengths=torch.full((4,), len(ids) // 4))


def loss_of(kt) -> torch.Tensor:
    values = kt.values()
    return (values * torch.linspace(-1, 1, values.shape[1])).sum() + 0.5 * (values**2).sum()


def small_tier(tmp_path, kernel: str = "numba") -> TieredEmbeddingBagCollection:
    return TieredEmbeddingBagCollection(TABLES, storage=StorageConfig(device_rows=256, host_rows=0,
                                                                      ssd_dir=str(tmp_path / "ssd")),
                                        optimizer=SparseAdam(lr=0.05), kernel=kernel)


@pytest.mark.parametrize("kernel", ["numba", "torch"])
def test_ten_forwards_without_backward_on_a_256_row_tier_then_training_is_exact(tmp_path, kernel):
    ebc = small_tier(tmp_path, kernel)
    skipped = torch.arange(10 * IDS_PER_BATCH)
    for b in range(10):
        ebc(batch_of(skipped[b * IDS_PER_BATCH : (b + 1) * IDS_PER_BATCH]))  # output dropped: no backward
    trained = torch.arange(10_000, 10_000 + IDS_PER_BATCH)
    loss_of(ebc(batch_of(trained))).backward()
    loss_of(ebc(batch_of(trained))).backward()

    # The same two steps alone, every row in memory.
    reference = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05), kernel=kernel)
    loss_of(reference(batch_of(trained))).backward()
    loss_of(reference(batch_of(trained))).backward()
    assert torch.equal(ebc.rows("t0", trained), reference.rows("t0", trained))
    # Rows of the skipped batches were never trained.
    assert torch.equal(ebc.rows("t0", skipped), reference.rows("t0", skipped))


def test_an_exception_between_forward_and_backward_releases_the_rows(tmp_path):
    ebc = small_tier(tmp_path)

    def failing_step(ids: torch.Tensor) -> None:
        loss = loss_of(ebc(batch_of(ids)))
        raise FloatingPointError(f"loss {float(loss.detach())} refused")

    for b in range(10):
        with pytest.raises(FloatingPointError):
            failing_step(torch.arange(b * IDS_PER_BATCH, (b + 1) * IDS_PER_BATCH))
    trained = torch.arange(10_000, 10_000 + IDS_PER_BATCH)
    before = ebc.rows("t0", trained)
    loss_of(ebc(batch_of(trained))).backward()
    assert not torch.equal(ebc.rows("t0", trained), before)


def test_outputs_freed_only_by_the_cycle_collector_release_their_rows_when_room_is_short(tmp_path):
    ebc = small_tier(tmp_path)
    gc.disable()  # so only the tables' own call collects the cycles below
    try:
        for b in range(10):
            cycle: dict = {"output": ebc(batch_of(torch.arange(b * IDS_PER_BATCH, (b + 1) * IDS_PER_BATCH)))}
            cycle["self"] = cycle
            del cycle
        loss_of(ebc(batch_of(torch.arange(10_000, 10_000 + IDS_PER_BATCH)))).backward()
    finally:
        gc.enable()


def test_forwards_awaiting_their_backward_keep_their_rows_and_the_error_says_so(tmp_path):
    ebc = small_tier(tmp_path)
    reference = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05))
    batches = [torch.arange(b * IDS_PER_BATCH, (b + 1) * IDS_PER_BATCH) for b in range(5)]
    # Gradient accumulation: four forwards in flight fill the tier; their rows must stay.
    kept = [ebc(batch_of(ids)) for ids in batches[:4]]
    with pytest.raises(RuntimeError, match=r"table 't0': .*256 of them held by 4 earlier training forwards whose "
                                           r"backward has not run") as failure:
        ebc(batch_of(batches[4]))
    assert "lower the batch size" not in str(failure.value)
    sum(loss_of(kt) for kt in kept).backward()
    sum(loss_of(reference(batch_of(ids))) for ids in batches[:4]).backward()
    every = torch.cat(batches[:4])
    assert torch.equal(ebc.rows("t0", every), reference.rows("t0", every))
    # Their backward gave the rows back: the fifth batch fits now.
    loss_of(ebc(batch_of(batches[4]))).backward()


def test_evaluation_forwards_pin_nothing(tmp_path):
    ebc = small_tier(tmp_path)
    with torch.no_grad():
        kept = [ebc(batch_of(torch.arange(b * IDS_PER_BATCH, (b + 1) * IDS_PER_BATCH))) for b in range(10)]
    assert len(kept) == 10
    np.testing.assert_array_equal(ebc.rows("t0", torch.arange(3)).shape, (3, 4))
