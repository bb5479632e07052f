"""Inputs torchrec's EmbeddingBagCollection accepts, given to a TieredEmbeddingBagCollection
with the same weights: the same pooled output and updates, or an error where torchrec raises."""

import functools

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import SparseSGD, TieredEmbeddingBagCollection

ROWS = 50
LR = 0.1


def tables(feature_names=True):
    names = {"a": ["fa"], "b": ["fb", "fc"]} if feature_names else {"a": [], "b": []}
    return [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=ROWS, feature_names=names["a"]),
            EmbeddingBagConfig(name="b", embedding_dim=3, num_embeddings=ROWS, feature_names=names["b"],
                               pooling=PoolingType.MEAN if feature_names else PoolingType.SUM)]


def sum_tables():
    """The tables, all SUM pooling, as weighted bags need."""
    return [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=ROWS,
                               feature_names=t.feature_names) for t in tables()]


def pair(configs, weighted=False):
    """torchrec's collection and ours, torchrec's weights set to ours (read with rows())."""
    ours = TieredEmbeddingBagCollection(configs(), is_weighted=weighted, optimizer=SparseSGD(lr=LR))
    reference = EmbeddingBagCollection(configs(), is_weighted=weighted)
    with torch.no_grad():
        for name, bag in reference.embedding_bags.items():
            bag.weight.copy_(ours.rows(name, torch.arange(ROWS)))
    return ours, reference


def trained_alike(ours, reference, kjt):
    """One SGD step of both on the same loss; the outputs of that step."""
    out, want = ours(kjt), reference(kjt)
    target = torch.randn(want.values().shape, generator=torch.Generator().manual_seed(1))
    (out.values() * target).sum().backward()
    (want.values() * target).sum().backward()
    with torch.no_grad():
        for bag in reference.embedding_bags.values():
            bag.weight -= LR * bag.weight.grad
    return out, want


def assert_same_rows(ours, reference):
    for name, bag in reference.embedding_bags.items():
        torch.testing.assert_close(ours.rows(name, torch.arange(ROWS)), bag.weight.detach(), atol=1e-6, rtol=0)


def test_a_table_without_feature_names_reads_the_feature_of_its_own_name():
    ours, reference = pair(functools.partial(tables, feature_names=False))
    assert [t.feature_names for t in ours.embedding_bag_configs()] == [["a"], ["b"]]  # as torchrec writes them
    kjt = KeyedJaggedTensor.from_lengths_sync(["b", "a"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 0, 2]))
    out, want = ours(kjt), reference(kjt)
    assert out.keys() == want.keys() == ["a", "b"] and out.length_per_key() == want.length_per_key() == [4, 3]
    torch.testing.assert_close(out.values(), want.values(), atol=1e-6, rtol=0)


def vbe_kjt(weighted=False):
    # Features of 2, 3 and 3 distinct bags from two ranks, a batch of 5 indexing them;
    # inverse_indices list the features in another order than the KJT's keys.
    lengths = torch.tensor([1, 2, 3, 0, 1, 2, 1, 1])
    values = torch.arange(int(lengths.sum())) % ROWS * 7 % ROWS
    return KeyedJaggedTensor(
        keys=["fa", "fb", "fc"], values=values, lengths=lengths,
        weights=torch.linspace(0.5, 2.0, len(values)) if weighted else None,
        stride_per_key_per_rank=[[1, 1], [2, 1], [2, 1]],
        inverse_indices=(["fc", "fa", "fb"], torch.tensor([[2, 0, 1, 1, 0], [0, 1, 1, 0, 1], [2, 2, 0, 1, 0]])))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_a_variable_batch_kjt_is_pooled_and_trained_as_torchrec_expands_it(weighted):
    ours, reference = pair(sum_tables if weighted else tables, weighted)
    kjt = vbe_kjt(weighted)
    out, want = trained_alike(ours, reference, kjt)
    assert out.values().shape == want.values().shape == (5, 10)
    assert out.length_per_key() == want.length_per_key() == [4, 3, 3]
    torch.testing.assert_close(out.values(), want.values(), atol=1e-6, rtol=0)
    assert_same_rows(ours, reference)  # a bag used twice counts twice, as torchrec's gradient does


def test_a_variable_batch_kjt_without_inverse_indices_needs_one_batch_size_as_torchrec_does():
    ours, reference = pair(tables)
    even = KeyedJaggedTensor(keys=["fa", "fb", "fc"], values=torch.arange(6), lengths=torch.tensor([1, 1, 1, 1, 1, 1]),
                             stride_per_key_per_rank=[[2], [2], [2]])
    torch.testing.assert_close(ours(even).values(), reference(even).values(), atol=1e-6, rtol=0)
    uneven = KeyedJaggedTensor(keys=["fa", "fb", "fc"], values=torch.arange(6), lengths=torch.tensor([1, 1, 1, 1, 1, 1]),
                               stride_per_key_per_rank=[[2], [3], [1]])
    with pytest.raises(RuntimeError):
        reference(uneven)
    with pytest.raises(ValueError, match=r"without inverse_indices.*\{'fa': 2, 'fb': 3, 'fc': 1\}"):
        ours(uneven)


def test_weights_are_required_by_a_weighted_collection_and_ignored_by_an_unweighted_one():
    plain = KeyedJaggedTensor.from_lengths_sync(["fa", "fb", "fc"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    ours, reference = pair(lambda: [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=ROWS,
                                                       feature_names=["fa", "fb", "fc"])], weighted=True)
    with pytest.raises(AssertionError):
        reference(plain)
    with pytest.raises(ValueError, match=r"is_weighted=True.*carries no weights"):
        ours(plain)

    ours, reference = pair(tables)
    weighted = KeyedJaggedTensor.from_lengths_sync(["fa", "fb", "fc"], torch.tensor([1, 2, 3, 4]),
                                                   torch.tensor([1, 2, 0, 1, 0, 0]),
                                                   weights=torch.tensor([3.0, 5.0, 7.0, 9.0]))
    out, want = trained_alike(ours, reference, weighted)
    torch.testing.assert_close(out.values(), want.values(), atol=1e-6, rtol=0)
    assert_same_rows(ours, reference)


def test_a_missing_feature_is_a_key_error_as_in_torchrec_and_an_extra_one_is_ignored():
    ours, reference = pair(tables)
    lacking = KeyedJaggedTensor.from_lengths_sync(["fa", "fc"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(KeyError):
        reference(lacking)
    with pytest.raises(KeyError, match=r"lacks features \['fb'\] of tables \['b'\]"):
        ours(lacking)
    extra = KeyedJaggedTensor.from_lengths_sync(["fx", "fc", "fb", "fa"], torch.tensor([9, 1, 2, 3]),
                                                torch.tensor([1, 1, 1, 1]))
    torch.testing.assert_close(ours(extra).values(), reference(extra).values(), atol=1e-6, rtol=0)
