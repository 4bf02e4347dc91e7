import pyarrow.parquet as pq

from varlen_cli.analyze import AnalyzeConfig, analyze
from tests.conftest import sample


def test_analyze_parquet_tokens(tmp_path):
    out = tmp_path / "m"
    res = analyze(AnalyzeConfig(sources=(sample("text.parquet"),), output=str(out),
                                tokenizer=sample("tokenizer.json"), progress=False))
    assert res.num_samples == 2000
    t = pq.read_table(out)
    assert t.column("sample_id").to_pylist() == list(range(2000))
