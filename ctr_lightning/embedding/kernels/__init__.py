"""The compute of a step: pooling, and the fused row-wise optimizer update in backward.

``pooling`` pools rows and applies the optimizer step (numba kernels on CPU, torch ops
elsewhere); ``cpu_kernels`` holds the numba kernels, ``cache_hints`` the CPU cache prefetch
hints they (and the hash indexes of the tiers) use, ``sparse_update`` the optimizer rules as
torch ops and their kernel codes.
"""
