"""``varlen analyze``: adapter over :func:`varlen_cli.analyze.analyze`."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.runtime.choices import Device


def analyze_command(
    sources: list[str] = typer.Argument(
        ..., metavar="SOURCE", show_default=False,
        help="Parquet/Arrow/JSONL/text files, directories, globs, or a Hugging Face save_to_disk directory, local or "
        "in object storage (s3://, gs://, hf://, https:// URLs, prefixes and globs), a Megatron PREFIX.idx, an MDS "
        "index.json directory or WebDataset .tar shards; rows are numbered over the files in sorted path order.",
    ),
    output: str = typer.Option(
        ..., "-o", "--output", show_default=False,
        help="Metrics directory to write (part-*.parquet + _manifest.json), atomically; or an s3://... prefix "
        "(published manifest last).",
    ),
    length: str = typer.Option(
        "auto", "--length",
        help="KIND:COLUMN with KIND list, tokens, chars, bytes, words, value or chat; 'auto' picks a list column "
        "input_ids/tokens/token_ids, then text (tokens with --tokenizer, else chars), then num_tokens/length/duration.",
    ),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", show_default=False,
        help="A tokenizer.json file, or a directory transformers.AutoTokenizer loads (sentencepiece and tiktoken "
        "models too), for --length tokens:COLUMN and chat:COLUMN (truncation and padding are switched off).",
    ),
    special_tokens: bool = typer.Option(
        True, "--special-tokens/--no-special-tokens",
        help="Count the tokenizer's special tokens (BOS/EOS, CLS/SEP).",
    ),
    target_length: str | None = typer.Option(
        None, "--target-length", show_default=False,
        help="With --length chat:COLUMN: 'assistant' also stores target_length, the tokens that carry loss under "
        "assistant-only training (the chat template's {% generation %} mask); plans then count those as loss tokens.",
    ),
    frames_per_second: float | None = typer.Option(
        None, "--frames-per-second", show_default=False,
        help="With --length value:COLUMN in seconds: frames = ceil(seconds x F).",
    ),
    difficulty: str = typer.Option(
        "length", "--difficulty",
        help="Curriculum key: length, value:COLUMN, vocab-rarity, or MODULE:FUNCTION (RecordBatch -> one value per "
        "row).",
    ),
    storage_options: list[str] = typer.Option(
        [], "--storage-option", metavar="KEY=VALUE", show_default=False,
        help="KEY=VALUE passed to the object-storage filesystem of s3://, gs://, hf://... sources and outputs "
        "(repeatable; JSON values parsed); credentials and endpoints otherwise come from the standard environment "
        "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).",
    ),
    nproc: int = common.NPROC,
    device: Device = common.DEVICE,
    overwrite: bool = common.OVERWRITE,
    progress: bool = common.PROGRESS,
    json_output: bool = common.JSON,
) -> None:
    """Compute each sample's length and difficulty, distributed over workers."""
    from varlen_cli.analyze import AnalyzeConfig, analyze
    from varlen_cli.cli import report

    config = AnalyzeConfig(
        sources=tuple(sources), output=output, length=length, tokenizer=tokenizer, special_tokens=special_tokens,
        target_length=target_length,
        frames_per_second=frames_per_second, difficulty=difficulty, nproc=nproc, overwrite=overwrite,
        device=device, progress=progress, storage_options=tuple(storage_options),
    )
    result = common.run(analyze, config)
    if result is not None and json_output:
        report.print_json(report.analyze_json(result))
        report.warn_empty(result)
    elif result is not None:
        report.print_analyze(result)


def register(app: typer.Typer) -> None:
    app.command("analyze", no_args_is_help=True)(analyze_command)
