"""The engines of a collection sharded over the ranks of a process group, and their collectives.

:class:`ShardedTables` keeps each row on its owner and moves ids and pooled embeddings
every step; :class:`ReplicatedTables` trains local replicas and merges them at the owners
every k steps. The single-process path (:mod:`ctr_lightning.embedding.local_tables`)
knows nothing of ranks.
"""

from ctr_lightning.embedding.distributed.replicated_tables import ReplicatedTables
from ctr_lightning.embedding.distributed.sharded_tables import ShardedTables

__all__ = ["ReplicatedTables", "ShardedTables"]
