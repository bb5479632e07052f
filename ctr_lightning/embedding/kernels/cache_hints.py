"""Cache hints for numba kernels whose reads are scattered over large arrays.

Hash probes and row gathers wait on DRAM one cache miss at a time; hinting the
address a few iterations ahead (``llvm.prefetch``) overlaps those misses, so the
kernels that scan tables larger than the CPU caches (key lookups, pooling, the fused
optimizer) wait on several misses at once instead of one after another.

Example::

    @numba.njit
    def gather_sum(table, rows):
        total = 0.0
        for i in range(len(rows)):
            if i + 8 < len(rows):
                hint(table, rows[i + 8])
            total += table[rows[i]]
        return total
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LINE_FLOATS = 16  # float32 values per 64-byte cache line


def _codegen(context, builder, signature, args):
    array_type = signature.args[0]
    view = context.make_array(array_type)(context, builder, args[0])
    index = [context.cast(builder, value, kind, types.intp) for value, kind in zip(args[1:], signature.args[1:])]
    pointer = cgutils.get_item_pointer(context, builder, array_type, view, index, wraparound=False)
    byte_pointer = ir.IntType(8).as_pointer()
    int32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32]), "llvm.prefetch.p0i8")
    # (address, for reading, keep in every cache level, data cache)
    builder.call(fn, [builder.bitcast(pointer, byte_pointer), ir.Constant(int32, 0), ir.Constant(int32, 3),
                      ir.Constant(int32, 1)])
    return context.get_dummy_value()


def _typed(array, indices):
    if isinstance(array, types.Array) and array.ndim == len(indices) and all(
            isinstance(i, types.Integer) for i in indices):
        return types.void(array, *indices)
    return None  # numba then reports a typing error naming the arguments


@intrinsic
def hint(typingctx, array, index):
    """Hint that ``array[index]`` (1-d) will be read soon. A hint only: never faults."""
    return _typed(array, (index,)), _codegen


@intrinsic
def hint_at(typingctx, array, row, col):
    """Hint that ``array[row, col]`` (2-d) will be read soon."""
    return _typed(array, (row, col)), _codegen


@numba.njit(inline="always")
def hint_span(array, row, start, stop):
    """Hint that ``array[row, start:stop]`` (2-d, float32) will be read soon."""
    for col in range(start, stop, LINE_FLOATS):
        hint_at(array, row, col)
