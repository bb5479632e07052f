"""Fused CPU kernels for the device tier: pool straight from storage, and in backward
sum each touched row's gradient and apply the sparse optimizer in place.

One call covers every table of a group; rows are processed in parallel (numba prange),
and each row's gradient is summed in a fixed order, so results do not depend on the
thread count or on where the row lived before.

The kernels are bound by memory latency: rows are scattered over a storage of many
gigabytes, so they hint the rows a few steps ahead to the CPU's caches (see :mod:`cache_hints`).
``error_model="numpy"`` lets LLVM vectorise the optimizer's divisions (Python's
ZeroDivisionError check would otherwise force scalar code); no divisor here can be 0:
bag lengths are counted only for non-empty bags, and the optimizer configs refuse eps <= 0.

Numba's cache keys a kernel by its own file only: after editing :mod:`cache_hints`,
clear the ``__pycache__`` caches of this module and of :mod:`key_index`.
"""

from __future__ import annotations

import numba
import numpy as np

from ctr_lightning.embedding.kernels.cache_hints import hint_span

SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM = 0, 1, 2, 3

_AHEAD = 4  # rows the backward kernel hints ahead of the one it updates
_CHUNK = 512  # rows a backward task updates, with one gradient buffer


@numba.njit(parallel=True, cache=True, fastmath={"contract"}, nogil=True, error_model="numpy")
def pool_forward(storage, dim, slots, inverse, offsets, weights, mean, batch, out):
    """out[b, f*dim : (f+1)*dim] = pooled rows of bag f*batch + b (feature-major bags).

    Sample by sample, so each output row is written in one sweep, while the rows of
    the next sample are hinted to the caches.
    """
    features = (len(offsets) - 1) // batch
    has_weights = len(weights) > 0
    for b in numba.prange(batch):
        if b + 1 < batch:
            for f in range(features):
                k = f * batch + b + 1
                for i in range(offsets[k], offsets[k + 1]):
                    if slots[inverse[i]] >= 0:
                        hint_span(storage, slots[inverse[i]], 0, dim)
        for f in range(features):
            k = f * batch + b
            acc = out[b, f * dim : (f + 1) * dim]
            acc[:] = 0.0
            start, end = offsets[k], offsets[k + 1]
            for i in range(start, end):
                if slots[inverse[i]] < 0:
                    continue  # a row not admitted: zeros
                row = storage[slots[inverse[i]], :dim]
                w = weights[i] if has_weights else np.float32(1.0)
                for d in range(dim):
                    acc[d] += w * row[d]
            if mean and end > start:
                scale = np.float32(1.0) / np.float32(end - start)
                for d in range(dim):
                    acc[d] *= scale


@numba.njit(cache=True, nogil=True)
def occurrences_by_row(inverse, num_rows):
    """CSR of id positions per unique row, positions in increasing order (a counting sort)."""
    counts = np.zeros(num_rows + 1, dtype=np.int64)
    for i in range(len(inverse)):
        counts[inverse[i] + 1] += 1
    for u in range(num_rows):
        counts[u + 1] += counts[u]
    fill = counts[:-1].copy()
    positions = np.empty(len(inverse), dtype=np.int64)
    for i in range(len(inverse)):
        u = inverse[i]
        positions[fill[u]] = i
        fill[u] += 1
    return counts, positions


@numba.njit(cache=True, nogil=True)
def bag_of_ids(offsets, num_ids):
    bag = np.empty(num_ids, dtype=np.int64)
    for k in range(len(offsets) - 1):
        for i in range(offsets[k], offsets[k + 1]):
            bag[i] = k
    return bag


@numba.njit(parallel=True, cache=True, fastmath={"contract"}, nogil=True, error_model="numpy")
def backward_update(storage, dim, slots, row_ptr, positions, bag, offsets, weights, mean, batch,
                    grad_out, kind, params, step_scale):
    """For every touched row: gradient = sum over its ids of the pooled-output gradient,
    then one optimizer step on ``storage[slot]`` (weights and state) in place.

    params: (lr, eps, beta1, beta2); step_scale[u]: Adam's lr * sqrt(1 - beta2^t) / (1 - beta1^t).
    """
    has_weights = len(weights) > 0
    lr, eps, beta1, beta2 = params[0], params[1], params[2], params[3]
    one = np.float32(1.0)
    rows = len(slots)
    width = storage.shape[1]
    for chunk in numba.prange((rows + _CHUNK - 1) // _CHUNK):
        g = np.empty(dim, dtype=np.float32)
        last = min(rows, (chunk + 1) * _CHUNK)
        for u in range(chunk * _CHUNK, last):
            if slots[u] < 0:
                continue  # a row not admitted: no update
            ahead = u + _AHEAD
            if ahead < last and slots[ahead] >= 0:
                hint_span(storage, slots[ahead], 0, width)
                for j in range(row_ptr[ahead], row_ptr[ahead + 1]):
                    k = bag[positions[j]]
                    f = k // batch
                    hint_span(grad_out, k - f * batch, f * dim, (f + 1) * dim)
            g[:] = 0.0
            for j in range(row_ptr[u], row_ptr[u + 1]):
                i = positions[j]
                k = bag[i]
                f = k // batch
                b = k - f * batch
                scale = weights[i] if has_weights else one
                if mean:
                    scale = scale / np.float32(offsets[k + 1] - offsets[k])
                src = grad_out[b, f * dim : (f + 1) * dim]
                for d in range(dim):
                    g[d] += scale * src[d]
            r = storage[slots[u]]
            if kind == SGD:
                for d in range(dim):
                    r[d] -= lr * g[d]
            elif kind == ADAGRAD:
                for d in range(dim):
                    acc = r[dim + d] + g[d] * g[d]
                    r[dim + d] = acc
                    r[d] -= lr * g[d] / (np.sqrt(acc) + eps)
            elif kind == ROWWISE_ADAGRAD:
                sq = np.float32(0.0)
                for d in range(dim):
                    sq += g[d] * g[d]
                acc = r[dim] + sq / np.float32(dim)
                r[dim] = acc
                denom = np.sqrt(acc) + eps
                for d in range(dim):
                    r[d] -= lr * g[d] / denom
            else:
                size = step_scale[u]
                for d in range(dim):
                    m = r[dim + d] + (g[d] - r[dim + d]) * (one - beta1)
                    v = r[2 * dim + d] + (g[d] * g[d] - r[2 * dim + d]) * (one - beta2)
                    r[dim + d] = m
                    r[2 * dim + d] = v
                    r[d] -= size * (m / (np.sqrt(v) + eps))
