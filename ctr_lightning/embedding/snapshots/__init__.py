"""Table snapshots: a collection's rows streamed to files and loaded back.

``table_snapshot`` writes and reads a snapshot (row files from every tier, manifest last;
incremental snapshots name a parent); ``row_files`` is its chunked, checksummed file format,
``segment_sets`` its share of the SSD log's sealed segments, taken by hard link;
``collection_snapshots`` is a collection's bookkeeping of the snapshots its checkpoints refer
to. A sharded collection's snapshots are written by
:mod:`ctr_lightning.embedding.distributed.shard_snapshots`.
"""
