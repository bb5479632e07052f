import pytest

from ctr_lightning.models import DLRMModule


def test_dense_optimizer_never_sees_the_tables():
    model = DLRMModule(num_embeddings=1000, embedding_dim=8)
    optimizer = model.configure_optimizers()
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    tables = {id(p) for p in model.embeddings.parameters()}
    assert given and not given & tables
    assert given | tables == {id(p) for p in model.parameters()}


def test_rejects_bad_architecture():
    with pytest.raises(ValueError, match="must end in 1"):
        DLRMModule(over_arch_layer_sizes=[16, 2])
