"""runtime.parquet_concat: row groups of several files, one footer; the file one writer writes."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from varlen_cli import format
from varlen_cli.errors import OutputError
from varlen_cli.plan import writer
from varlen_cli.runtime.parquet_concat import concat


def _tables(packed: bool, sizes: list[int], seed: int = 0):
    schema = format.plan_schema(packed, writer.plan_metadata({"note": "x" * 50, "dp": 2}))
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        cols = {}
        lens = rng.integers(1, 30, n)
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        for f in schema:
            if pa.types.is_list(f.type):
                values = rng.integers(0, 1 << 30, int(off[-1])).astype(f.type.value_type.to_pandas_dtype())
                cols[f.name] = pa.ListArray.from_arrays(pa.array(off), pa.array(values, type=f.type.value_type))
            else:
                cols[f.name] = pa.array(rng.integers(0, 60, n).astype(f.type.to_pandas_dtype()), type=f.type)
        out.append(pa.Table.from_pydict(cols, schema=schema))
    return schema, out


def _write(path, schema, tables) -> str:
    with pq.ParquetWriter(path, schema, **writer.parquet_options(schema)) as w:
        for t in tables:
            w.write_table(t)
    return str(path)


@settings(max_examples=15)
@given(packed=st.booleans(), sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=9),
       cuts=st.sets(st.integers(1, 8), max_size=4))
def test_concat_is_the_file_one_writer_writes(tmp_path_factory, packed, sizes, cuts):
    tmp = tmp_path_factory.mktemp("concat")
    schema, tables = _tables(packed, sizes)
    whole = _write(tmp / "whole.parquet", schema, tables)
    bounds = [0, *sorted(c for c in cuts if c < len(tables)), len(tables)]
    parts = [_write(tmp / f"part{i}.parquet", schema, tables[a:b]) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    concat(parts, str(tmp / "cat.parquet"))
    assert (tmp / "cat.parquet").read_bytes() == open(whole, "rb").read()
    got = pq.ParquetFile(tmp / "cat.parquet")
    assert got.metadata.num_row_groups == len(tables)
    assert got.read().equals(pa.concat_tables(tables))
    for i, t in enumerate(tables):  # each row group reads back by itself (offsets moved right)
        assert got.read_row_group(i).equals(t)


def test_concat_refuses_other_schemas_and_non_parquet(tmp_path):
    schema_a, a = _tables(False, [10])
    schema_b, b = _tables(True, [10])
    pa_path = _write(tmp_path / "a.parquet", schema_a, a)
    pb_path = _write(tmp_path / "b.parquet", schema_b, b)
    with pytest.raises(OutputError, match="schema or metadata differs"):
        concat([pa_path, pb_path], str(tmp_path / "out.parquet"))
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not a parquet file at all")
    with pytest.raises(OutputError, match="is not a Parquet file"):
        concat([str(junk)], str(tmp_path / "out2.parquet"))
    with pytest.raises(OutputError, match="nothing to concatenate"):
        concat([], str(tmp_path / "out3.parquet"))


def test_a_full_disk_is_an_output_error_naming_the_plan(tmp_path):
    """A write that fails (a file-size limit: EFBIG, as on a full disk) while joining is one OutputError
    naming the plan, not an internal error."""
    import os
    import resource
    import subprocess
    import sys

    from tests.conftest import ROOT

    schema, tables = _tables(False, [3000, 3000])
    parts = [_write(tmp_path / f"p{i}.parquet", schema, [t]) for i, t in enumerate(tables)]
    code = ("import sys\nfrom varlen_cli.errors import OutputError\n"
            "from varlen_cli.runtime.parquet_concat import concat\n"
            "try:\n    concat(sys.argv[1:3], sys.argv[3], what='plan.parquet')\n"
            "except OutputError as exc:\n    print(exc.message)\n    sys.exit(4)\n")

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    result = subprocess.run([sys.executable, "-c", code, *parts, str(tmp_path / "out.parquet")], capture_output=True,
                            text=True, env=dict(os.environ, PYTHONPATH=ROOT), preexec_fn=small_files, timeout=60)
    assert result.returncode == 4, result.stderr
    assert result.stdout.strip() == "cannot write plan.parquet: File too large"


def test_concat_under_another_files_footer(tmp_path):
    """``footer=``: row groups of files written with other metadata, joined under the metadata of an empty
    file of the same schema: the file one writer writes with that metadata; another schema is refused."""
    from varlen_cli.runtime.parquet_concat import same_schema

    schema, tables = _tables(True, [40, 7, 300], seed=3)
    other = schema.with_metadata(format.encode_plan_metadata({"note": "other", "dp": 2}))
    parts = [_write(tmp_path / "a.parquet", schema, tables[:2]), _write(tmp_path / "b.parquet", other, tables[2:])]
    final = schema.with_metadata(format.encode_plan_metadata({"note": "final" * 30, "dp": 2}))
    footer = _write(tmp_path / "footer.parquet", final, [])
    assert pq.ParquetFile(footer).metadata.num_row_groups == 0
    concat(parts, str(tmp_path / "cat.parquet"), footer=footer)
    whole = _write(tmp_path / "whole.parquet", final, tables)
    assert (tmp_path / "cat.parquet").read_bytes() == open(whole, "rb").read()
    assert same_schema(parts[0], footer) and same_schema(parts[1], footer)
    plain, _ = _tables(False, [5])
    elsewhere = _write(tmp_path / "plain.parquet", plain, [])
    assert not same_schema(parts[0], elsewhere)
    with pytest.raises(OutputError, match="its schema differs from"):
        concat(parts, str(tmp_path / "bad.parquet"), footer=elsewhere)
