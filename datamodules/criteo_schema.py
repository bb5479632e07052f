"""The Criteo raw layout, defined once: ``label, I1..I13, C1..C26``, tab-separated.

The reader, the synthetic generator and the DLRM model's defaults all take it from here.
"""

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
