"""The working set, pulled ahead of time: before batches train, their rows are read ahead.

``working_set_prefetcher`` wraps a data loader and reads batches ahead; ``working_set`` marks
the rows upcoming batches need (so the tiers keep them) and reads rows ahead from SSD;
``staging`` hands rows read ahead from one thread to the other.
"""
