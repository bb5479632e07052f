"""The SSD tier: what the memory tiers and snapshots ask of it (``ssd_tier``) and its two stores.

``ssd_log`` keeps hashed ids' rows as a log of segment files (``ssd_log_segments``), cleaned a
piece at a time (``ssd_log_cleaner``), read by chunk or since a mark for snapshots
(``ssd_log_snapshots``), found through ``location_index``; ``direct_store`` keeps bounded ids
at fixed offsets. Both read and write runs of records with ``record_io`` and hold their
directory with ``directory_lock``.
"""
