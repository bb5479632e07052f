"""A table's rows start where its EmbeddingBagConfig says (weight_init_min / max, a uniform
init_fn), still a function of (seed, table, id); an init_fn that cannot be applied per row is refused."""

import functools
import json
import math

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.embedding.initializer import initial_rows, range_bounds, table_key
from ctr_lightning.serving_export import export_for_serving

ROWS = 1000
IDS = torch.arange(0, 4 * ROWS, 3)  # hashed ids: beyond num_embeddings too


def config(name="t0", **init):
    return EmbeddingBagConfig(name=name, embedding_dim=16, num_embeddings=ROWS, feature_names=[f"f_{name}"], **init)


def test_the_configs_range_is_honoured_and_rows_stay_a_function_of_seed_table_and_id(tmp_path):
    ebc = TieredEmbeddingBagCollection([config(weight_init_min=0.5, weight_init_max=0.75), config("t1")], seed=3)
    rows = ebc.rows("t0", IDS)
    assert 0.5 <= rows.min() < 0.501 and 0.749 < rows.max() <= 0.75
    assert abs(float(rows.mean()) - 0.625) < 0.005
    default = ebc.rows("t1", IDS)  # torchrec's default range, the rows of earlier versions bit for bit
    bound = math.sqrt(1 / ROWS)
    assert torch.equal(default, torch.from_numpy(initial_rows(3, np.full(len(IDS), table_key("t1")), IDS.numpy(), 16,
                                                              np.full(len(IDS), bound))))
    # The same (seed, table, id) gives the same row in another collection, with other
    # tables and tiers; another seed another row.
    other = TieredEmbeddingBagCollection([config("t1"), config(weight_init_min=0.5, weight_init_max=0.75)], seed=3,
                                         storage=StorageConfig(device_rows=64, host_rows=0, ssd_dir=str(tmp_path)))
    assert torch.equal(other.rows("t0", IDS), rows)
    assert not torch.equal(TieredEmbeddingBagCollection([config(weight_init_min=0.5, weight_init_max=0.75)],
                                                        seed=4).rows("t0", IDS), rows)
    # Rows the forward pass creates (written in place into the tiers) are those rows().
    other.eval()
    kjt = KeyedJaggedTensor.from_lengths_sync(["f_t1", "f_t0"], torch.cat([IDS[:50], IDS[:50]]),
                                              torch.ones(100, dtype=torch.int64))
    with torch.no_grad():
        pooled = other(kjt)["f_t0"]
    assert torch.equal(pooled, rows[:50])


def test_a_uniform_init_fn_is_honoured_as_torchrec_applies_it_and_others_are_refused():
    # torchrec applies init_fn, which wins over weight_init_min / max when both are given.
    uniform = functools.partial(torch.nn.init.uniform_, a=-2.0, b=-1.5)
    given = lambda: [config(weight_init_min=0.0, weight_init_max=1.0, init_fn=uniform)]  # noqa: E731
    reference = EmbeddingBagCollection(given()).embedding_bags["t0"].weight
    ours = TieredEmbeddingBagCollection(given()).rows("t0", IDS)
    for weights in (reference, ours):
        assert -2.0 <= weights.min() < -1.99 and -1.51 < weights.max() <= -1.5

    for fn in (torch.nn.init.normal_, functools.partial(torch.nn.init.normal_, std=0.01),
               functools.partial(torch.nn.init.uniform_, a=0.0, b=1.0, generator=torch.Generator())):
        with pytest.raises(ValueError, match=r"table 't0': init_fn=.* is not supported.*weight_init_min / "
                                             r"weight_init_max"):
            TieredEmbeddingBagCollection([config(init_fn=fn)])
    with pytest.raises(ValueError, match=r"table 't0': the initial range \[1.0, 0.5\]"):
        TieredEmbeddingBagCollection([config(weight_init_min=1.0, weight_init_max=0.5)])


@pytest.mark.parametrize("snapshots", [True, False], ids=["table-snapshot", "tables-in-ckpt"])
def test_an_export_says_the_range_rows_never_stored_start_in(tmp_path, snapshots):
    ebc = TieredEmbeddingBagCollection([config(weight_init_min=0.25, weight_init_max=0.5), config("t1")], seed=0)
    trained = torch.arange(10)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f_t0", "f_t1"], torch.cat([trained, trained]),
                                              torch.ones(20, dtype=torch.int64))
    ebc(kjt).values().sum().backward()
    if snapshots:
        ebc.checkpoint_to_snapshots(tmp_path / "snapshots")
    state = {f"embeddings.{k}": v for k, v in ebc.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"num_embeddings": ROWS, "embedding_dim": 16, "seed": 0}},
               tmp_path / "model.ckpt")

    described = export_for_serving(tmp_path / "model.ckpt", tmp_path / "serving")
    assert json.loads((tmp_path / "serving" / "export.json").read_text()) == described
    assert described["tables"]["t0"]["init_range"] == [0.25, 0.5]
    bound = math.sqrt(1 / ROWS)
    assert described["tables"]["t1"]["init_range"] == [-bound, bound]
    assert "init_range" in described["unstored_rows"]
    # What the description says, recomputed by a reader: the rows the model uses.
    for name in ("t0", "t1"):
        info, unstored = described["tables"][name], torch.arange(10, 60)
        low, high = info["init_range"]
        recomputed = initial_rows(info["seed"], np.full(50, table_key(name)), unstored.numpy(), info["dim"],
                                  *range_bounds(np.full(50, low), np.full(50, high)))
        assert torch.equal(torch.from_numpy(recomputed), ebc.rows(name, unstored))
