"""The storage tiers of a table group: device memory (HBM), host memory (DRAM) and SSD.

:class:`~ctr_lightning.embedding.tiers.tier_stack.TierStack` builds a group's tiers and hands
its jobs to the modules beside it: misses filled from the tier below (``miss_path``), rows
written down to SSD (``ssd_writer``), every stored row exported or replaced (``row_export``,
``row_load``), the device tier as a k-step interval's copy (``interval_rows``), rows held between a
forward and its backward (``forward_pins``), the group's row layout and initial rows
(``group_tables``). ``row_cache`` is one memory tier, ``key_index`` its (table, id) -> slot
index; :mod:`ctr_lightning.embedding.tiers.ssd` holds the SSD stores.
"""
