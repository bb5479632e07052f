import logging
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CRITEO_SAMPLE = SHARED_DATA / "criteo_kaggle_sample"

# torchrec's KJT asks torch.fx whether it is tracing, which warns once per process.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


@pytest.fixture
def criteo_sample() -> Path:
    """The real Criteo Kaggle samples (never committed); tests skip where they are absent."""
    if not (CRITEO_SAMPLE / "train_random4584.tsv").is_file():
        pytest.skip(f"real Criteo sample not found under {CRITEO_SAMPLE}")
    return CRITEO_SAMPLE
