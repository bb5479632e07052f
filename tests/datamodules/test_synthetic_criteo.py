import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from ctr_lightning.datamodules import CriteoDataModule, SyntheticCriteo, SyntheticCriteoSpec, write_synthetic_criteo
from ctr_lightning.datamodules.synthetic_criteo import CRITEO_KAGGLE_CARDINALITIES

ROWS = 131_072


@pytest.fixture(scope="module")
def world():
    gen = SyntheticCriteo(SyntheticCriteoSpec(seed=3, max_cardinality=50_000))
    chunks = [gen.chunk(b) for b in range(2)]
    ranks = np.concatenate([c.ranks for c in chunks])
    logits = np.concatenate([c.logits for c in chunks])
    labels = np.concatenate([np.asarray(c.table["label"]) for c in chunks])
    return gen, chunks, ranks, logits, labels


def test_deterministic_for_a_seed_and_prefix_stable(tmp_path):
    a = write_synthetic_criteo(tmp_path / "a.tsv", rows=70_000, seed=5)
    b = write_synthetic_criteo(tmp_path / "b.tsv", rows=70_000, seed=5)
    c = write_synthetic_criteo(tmp_path / "c.tsv", rows=70_000, seed=6)
    short = write_synthetic_criteo(tmp_path / "short.tsv", rows=1_000, seed=5)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.read_bytes().startswith(short.read_bytes())
    assert len(a.read_text().splitlines()) == 70_000


def test_layout_is_criteo_raw(tmp_path):
    path = write_synthetic_criteo(tmp_path / "d.tsv", rows=5_000, seed=1)
    lines = path.read_text().splitlines()
    for line in lines[:200]:
        fields = line.split("\t")
        assert len(fields) == 40
        assert fields[0] in ("0", "1")
        assert all(f == "" or f.lstrip("-").isdigit() for f in fields[1:14])
        assert all(f == "" or (len(f) == 8 and int(f, 16) >= 0 and f == f.lower()) for f in fields[14:])
    # The reader accepts every line in strict mode.
    dm = CriteoDataModule(train_paths=[str(path)], batch_size=1024, bad_lines="raise")
    dm.setup("fit")
    assert sum(len(b) for b in dm.train_dataloader()) == 5_000


def test_gzip_output(tmp_path):
    import gzip

    path = write_synthetic_criteo(tmp_path / "d.tsv.gz", rows=2_000, seed=1)
    plain = write_synthetic_criteo(tmp_path / "d.tsv", rows=2_000, seed=1)
    assert gzip.decompress(path.read_bytes()) == plain.read_bytes()


def test_train_and_val_streams_share_the_world_not_the_rows():
    gen = SyntheticCriteo(SyntheticCriteoSpec(seed=0))
    a, b = gen.chunk(0, 1000, stream=0), gen.chunk(0, 1000, stream=1)
    assert not np.array_equal(a.ranks, b.ranks)
    # Same (feature, rank) gives the same hex string in both streams' rows, and another
    # rank another string.
    f, name = 2, "C3"
    strings_a, strings_b = a.table[name].to_pylist(), b.table[name].to_pylist()
    first_b = {}
    for j, r in enumerate(b.ranks[:, f].tolist()):
        first_b.setdefault(r, j)
    pairs = [(i, first_b[r]) for i, r in enumerate(a.ranks[:, f].tolist()) if r >= 0 and r in first_b]
    assert len(pairs) > 100
    for i, j in pairs:
        assert strings_a[i] == strings_b[j]
    by_string = {}
    for r, text in zip(a.ranks[:, f].tolist() + b.ranks[:, f].tolist(), strings_a + strings_b):
        if r >= 0:
            assert by_string.setdefault(text, r) == r
    assert all(text is None for r, text in zip(a.ranks[:, f].tolist(), strings_a) if r < 0)


def test_cardinalities_follow_criteo_capped(world):
    gen, _, ranks, _, _ = world
    expected = np.minimum(CRITEO_KAGGLE_CARDINALITIES, 50_000)
    assert gen.cardinalities.tolist() == expected.tolist()
    for f in range(26):
        seen = np.unique(ranks[:, f][ranks[:, f] >= 0])
        assert seen.max() < expected[f]
        if expected[f] <= 30:  # small vocabularies are fully used
            assert len(seen) == expected[f]
    # Distinct ranks give distinct hex values (the value map is a bijection).
    values = gen.values(2, np.arange(50_000))
    assert len(np.unique(values)) == 50_000


def test_values_are_zipf_skewed(world):
    _, _, ranks, _, _ = world
    col = ranks[:, 2]  # capped at 50k, so a long tail
    counts = np.bincount(col[col >= 0])
    top = np.sort(counts)[::-1]
    assert top[:500].sum() / top.sum() > 0.5  # 1% of values carry most of the traffic
    # log-frequency falls with log-rank at about the Zipf exponent.
    r = np.arange(1, 201)
    slope = np.polyfit(np.log(r), np.log(counts[:200] + 1), 1)[0]
    assert -1.4 < slope < -0.8


def test_click_rate_counts_and_missing(world):
    _, chunks, ranks, _, labels = world
    assert 0.20 <= labels.mean() <= 0.30
    table = chunks[0].table
    i5 = np.asarray(table["I5"].drop_null())
    assert np.percentile(i5, 99) > 10 * np.median(i5)  # heavy tail
    assert table["I12"].null_count / len(table) == pytest.approx(0.77, abs=0.02)
    assert (np.asarray(table["I2"].drop_null()) < 0).any()
    # C19, C20, C25, C26 go missing together, at about 44%.
    together = ranks[:, [18, 19, 24, 25]] < 0
    assert together.any(axis=1).mean() == pytest.approx(0.44, abs=0.02)
    assert (together.all(axis=1) == together.any(axis=1)).all()


def test_planted_model_separates_good_from_weak(world):
    gen, chunks, ranks, logits, labels = world
    y = torch.tensor(labels)
    oracle = binary_auroc(torch.tensor(logits), y).item()
    # A weak model that only knows the counts.
    z = np.stack([np.log1p(np.maximum(np.asarray(chunks[b].table[f"I{j}"].fill_null(0)), 0))
                  for j in range(1, 14) for b in range(2)]).reshape(13, 2, -1).transpose(1, 2, 0).reshape(-1, 13)
    x = torch.tensor((z - z.mean(0)) / (z.std(0) + 1e-6), dtype=torch.float32)
    w = torch.zeros(13, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=50)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y.float())
        loss.backward()
        return loss

    opt.step(closure)
    weak = binary_auroc((x @ w + b).detach(), y).item()
    assert oracle > 0.85
    assert weak < 0.65
    assert oracle - weak > 0.2
