import torch
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


def test_defaults_follow_torch_where_torch_has_the_optimizer():
    # Lazy Adam's defaults are torch.optim.SparseAdam's; the Adagrads' eps is FBGEMM's
    # table-batched kernels' default, the anchor they are compared with.
    adam = torch.optim.SparseAdam([torch.zeros(1, requires_grad=True)]).defaults
    assert (SparseAdam().lr, SparseAdam().betas, SparseAdam().eps) == (adam["lr"], adam["betas"], adam["eps"])
    assert SparseAdagrad().eps == RowWiseAdagrad().eps == 1e-8
    assert (SparseSGD().lr, SparseAdagrad().lr, RowWiseAdagrad().lr) == (0.01, 0.05, 0.05)
    # Each is its own kind: the kernels pick the update rule by type.
    assert len({type(c()) for c in (SparseSGD, SparseAdagrad, RowWiseAdagrad, SparseAdam)}) == 4
