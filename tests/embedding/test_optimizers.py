import pytest

from ctr_lightning.embedding.optimizers import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseSGD


@pytest.mark.parametrize("make, match", [
    (lambda: SparseSGD(lr=0), "SparseSGD: lr must be > 0"),
    (lambda: SparseAdagrad(eps=0), "SparseAdagrad: eps must be > 0"),
    (lambda: RowWiseAdagrad(eps=-1e-8), "RowWiseAdagrad: eps must be > 0"),
    (lambda: SparseAdam(eps=0.0), "SparseAdam: eps must be > 0"),
    (lambda: SparseAdam(betas=(0.9, 1.0)), r"SparseAdam: betas must be two numbers in \[0, 1\)"),
    (lambda: SparseAdam(betas=(0.9,)), "SparseAdam: betas"),
])
def test_bad_settings_are_refused_with_the_optimizer_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_defaults_are_accepted():
    for cls in (SparseSGD, SparseAdagrad, RowWiseAdagrad, SparseAdam):
        cls()
