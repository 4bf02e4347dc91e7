"""numpy <-> Arrow for the planner's fixed-width numeric columns, without pandas.

``pa.array`` and ``Array.to_numpy`` import pandas on their first call (about 0.3 s of a command's
start-up, for nothing: the planner's columns are plain numbers). These go through the buffers
instead: zero-copy from numpy to Arrow (after one cast where the dtypes differ), and a view of an
Arrow buffer as numpy.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_NUMPY = {"int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
          "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "float": np.float32, "double": np.float64}


def numpy_dtype(arrow_type: pa.DataType) -> np.dtype | None:
    """The numpy dtype of a fixed-width numeric Arrow type (None for others: bool, strings, lists)."""
    t = _NUMPY.get(str(arrow_type))
    return None if t is None else np.dtype(t)


def to_arrow(values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    """An Arrow array of ``values`` (1-D numbers, no nulls) as ``arrow_type``; no copy when the dtype matches."""
    if pa.types.is_list(arrow_type):
        raise TypeError("use list_array for list columns")
    dtype = numpy_dtype(arrow_type)
    if dtype is None:  # not a plain number type: let pyarrow convert (imports pandas)
        return pa.array(values, type=arrow_type)
    v = np.ascontiguousarray(values, dtype=dtype)
    return pa.Array.from_buffers(arrow_type, len(v), [None, pa.py_buffer(v)])


def list_array(offsets: np.ndarray, values: np.ndarray, list_type: pa.DataType) -> pa.Array:
    """A list column from CSR ``offsets`` (rows + 1, starting at 0) and the flat ``values``."""
    return pa.ListArray.from_arrays(to_arrow(offsets, pa.int32()), to_arrow(values, list_type.value_type))


def to_numpy(chunk: pa.Array) -> np.ndarray:
    """A numpy view of a numeric Arrow array without nulls (a copy for other types)."""
    dtype = numpy_dtype(chunk.type)
    if dtype is None or chunk.null_count:
        return chunk.to_numpy(zero_copy_only=False)
    return np.frombuffer(chunk.buffers()[1], dtype=dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize)


def flat_list(column) -> tuple[np.ndarray, np.ndarray]:
    """A list column (an array or a chunked array) as CSR: its offsets (int64, from 0) and its values."""
    import pyarrow.compute as pc

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if isinstance(array, pa.ChunkedArray):  # an empty chunked array
        array = pa.array([], type=array.type)
    offsets = array.offsets.to_numpy().astype(np.int64)
    return offsets - offsets[0], pc.list_flatten(array).to_numpy(zero_copy_only=False)
