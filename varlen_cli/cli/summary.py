"""Rich summary tables printed at the end of each stage (rank 0 only): the one place the CLI prints
results; the library functions return them."""

from __future__ import annotations

from varlen_cli.runtime.text import fmt, histogram_lines  # noqa: F401  (re-exported for the CLI)


def console():
    from rich.console import Console

    return Console()


# -- summaries: (label, value, cell) rows; the table shows the cells, --json the values ------------------
def _row(label: str, value, cell: str | None = None) -> tuple:
    return label, value, fmt(value) if cell is None else cell


def _json_default(obj):
    return obj.item() if hasattr(obj, "item") else str(obj)


def print_json(summary: dict) -> None:
    """One JSON object on stdout (``--json``): nothing else goes there."""
    import json
    import sys

    from varlen_cli.runtime import notes

    if notes.current():
        summary = {**summary, "notes": notes.current()}
    sys.stdout.write(json.dumps(summary, default=_json_default) + "\n")
    sys.stdout.flush()


def as_json(rows: list, output: str, **extra) -> dict:
    """A summary's rows as one JSON-ready object: label -> value, plus ``output`` (absolute path)."""
    return {**{label: value for label, value, _ in rows}, **extra, "output": output}


def _summary_table(title: str, rows: list):
    from rich.table import Table

    t = Table(title=title, show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    for label, _, cell in rows:
        t.add_row(label, cell)
    return t


def print_tables(tables) -> None:
    """Print :class:`varlen_cli.inspect.TextTable` s as rich tables (first column bold)."""
    from rich.table import Table

    out = console()
    for spec in tables:
        t = Table(title=spec.title, show_header=spec.show_header)
        for k, (name, justify) in enumerate(spec.columns):
            t.add_column(name, justify=justify, style="bold" if k == 0 and not spec.show_header else None)
        for row in spec.rows:
            t.add_row(*row)
        out.print(t)


def analyze_rows(result) -> list:
    from varlen_cli.analyze.lengths import not_tokens

    s = result.stats
    q = [s["min"], s["p50"], s["p90"], s["p99"], s["max"]]
    unit = not_tokens(result.length)
    return [
        _row("samples", result.num_samples), _row("files", result.num_files), _row("parts", result.num_parts),
        _row("length", result.length, f"{result.length} ({unit}, not tokens)" if unit else None),
        _row("difficulty", result.difficulty), _row("total length", s["total"]),
        _row("min / p50 / p90 / p99 / max", q, " / ".join(f"{v:,}" for v in q)),
        _row("mean length", s["mean"]), *_target_rows(result), _row("seconds", result.seconds),
    ]


def _target_rows(result) -> list:
    """With ``--target-length``: what it counted and its distribution (the ``target_length`` column)."""
    t = (result.manifest.get("stats") or {}).get("target_length")
    if not t:
        return []
    q = [t["min"], t["p50"], t["p90"], t["p99"], t["max"]]
    return [_row("target length", result.manifest["config"].get("target_length")),
            _row("total target length", t["total"]),
            _row("target min / p50 / p90 / p99 / max", q, " / ".join(f"{v:,}" for v in q))]


def analyze_json(result) -> dict:
    return as_json(analyze_rows(result), result.output)


def print_analyze(result) -> None:
    from rich.table import Table

    s = result.stats
    t = _summary_table(f"varlen analyze → {result.output}", analyze_rows(result))
    h = Table(title="lengths (log2 bins)", show_header=True)
    h.add_column("length")
    h.add_column("samples", justify="right")
    h.add_column("")
    for row in histogram_lines(s["histogram"]["log2_bins"]):
        h.add_row(*row)
    c = console()
    c.print(t)
    c.print(h)
    warn_empty(result)


def warn_empty(result) -> None:
    """On stderr: samples of length 0, and lengths that are not tokens (analyze)."""
    import sys

    from varlen_cli.analyze.lengths import not_tokens

    bins = result.stats["histogram"]["log2_bins"]
    empty = bins[0] if bins else 0
    if empty:
        sys.stderr.write(f"varlen: warning: {empty:,} samples have length 0; they are kept "
                         "(plans still schedule them; they add no tokens)\n")
    unit = not_tokens(result.length)
    if unit:
        sys.stderr.write(f"varlen: warning: the lengths are {unit} ({result.length}), not tokens: `varlen plan "
                         f"--max-tokens N` budgets N {unit} per microbatch (pass --tokenizer FILE_OR_DIR to measure "
                         f"tokens)\n")


def warn_plan_units(result) -> None:
    """On stderr: a plan of metrics whose lengths are not tokens budgets those (characters, ...)."""
    import sys

    from varlen_cli.analyze.lengths import not_tokens
    from varlen_cli.runtime import artifacts

    path = (result.metadata.get("input") or {}).get("path")
    try:
        length = artifacts.read_manifest(path)["config"].get("length", "") if path else ""
    except Exception:  # the plan is written: a gone or unreadable input only loses this note
        return
    unit = not_tokens(length)
    budget = (result.metadata.get("config") or {}).get("max_tokens")
    if unit and budget:
        sys.stderr.write(f"varlen: warning: the metrics' lengths are {unit} ({length}), not tokens: --max-tokens "
                         f"{budget} budgets {budget:,} {unit} per microbatch (analyze with --tokenizer FILE_OR_DIR "
                         f"for token lengths)\n")


def sort_rows(result) -> list:
    o = result.order
    rows = result.rows_per_worker
    order = ",".join(o["by"]) + (" descending" if o["descending"] else "") + f", ties {o['ties']}"
    if o["ties"] == "shuffle":
        order += f" (seed {o['seed']})"
    out = [
        _row("rows", result.num_rows), _row("order", order), _row("workers", result.world_size),
        _row("parts", result.num_parts),
        _row("rows per worker (min / max)", [min(rows), max(rows)], f"{min(rows):,} / {max(rows):,}"),
        _row("balance (max / mean)", result.balance, f"{result.balance:.3f}"),
        _row("seconds", result.seconds),
    ]
    peaks = [p for p in result.peak_rss_bytes if p]
    if peaks:
        out.append(_row("peak memory per worker (max)", max(peaks) / 2**20, f"{max(peaks) / 2**20:,.0f} MiB"))
    return out


def sort_json(result) -> dict:
    """The table's rows (peak memory in MiB) plus ``seconds per phase`` and ``output``."""
    return as_json(sort_rows(result), result.output, **{"seconds per phase": dict(result.phases)})


def print_sort(result) -> None:
    """The summary table: rows, rows per worker, balance, seconds per phase."""
    from rich.table import Table

    t = _summary_table(f"varlen sort → {result.output}", sort_rows(result))
    p = Table(title="seconds per phase (slowest worker)", show_header=True)
    p.add_column("phase")
    p.add_column("seconds", justify="right")
    for phase, secs in result.phases.items():
        p.add_row(phase.replace("_", " "), f"{secs:.2f}")
    c = console()
    c.print(t)
    c.print(p)


def lr_unit(metadata: dict) -> str:
    """What the plan's lr_scale follows: ``loss-tokens``, ``tokens``, ``samples``, or ``none``."""
    return "none" if metadata.get("lr_scaling") == "none" else metadata.get("lr_scale_by", "samples")


def plan_rows(result) -> list:
    from varlen_cli import format

    s = result.stats
    strag, lr = [s["straggler_mean"], s["straggler_max"]], [s["lr_scale_min"], s["lr_scale_max"]]
    rows = [
        _row("order", result.order), _row("epochs", s["epochs"]), _row("steps", s["steps"]),
        _row("microbatches", s["microbatches"]), _row("samples", s["samples"]), _row("tokens", s["tokens"]),
        _row("samples / microbatch", s["mean_samples_per_microbatch"]),
        _row("padding %", s["padding_pct"], f"{s['padding_pct']:.2f}"),
        _row("budget fill %", s["budget_fill_pct"], f"{s['budget_fill_pct']:.2f}"),
        _row("straggler mean / max", strag, f"{strag[0]:.3f} / {strag[1]:.3f}"),
        _row("straggler overhead %", s.get("straggler_overhead"), _overhead(s, result.metadata)),
        _row("distinct shapes", s["distinct_shapes"]),
        _row("lr_scale min / max", lr, f"{lr[0]:.3f} / {lr[1]:.3f}"),
        _row("lr_scale by", lr_unit(result.metadata)),
        _row("dropped samples", s["dropped"]),
    ]
    for src in (result.metadata.get("mixture") or {}).get("sources", []):  # varlen plan --mix
        rows.append(_row(f"tokens of {src['name']} (weight {src['weight']:g}) per epoch", src["tokens_per_epoch"],
                         " / ".join(f"{t:,}" for t in src["tokens_per_epoch"])))
    if "target_padding_pct" in s:  # two budgets (--max-target-tokens): the target side
        rows.append(_row("target padding %", s["target_padding_pct"], f"{s['target_padding_pct']:.2f}"))
    if s.get("warmup_steps"):
        rows.append(_row("compile warm-up steps", s["warmup_steps"]))
    if s.get("zero_lr_scale_steps"):
        rows.append(_row("steps with lr_scale 0 (only split chunks; consider --lr-scale-by tokens)",
                         s["zero_lr_scale_steps"]))
    if s.get("zero_loss_steps"):
        rows.append(_row("steps with step_loss_tokens 0 (their mean loss is 0/0)", s["zero_loss_steps"]))
    if result.packing:
        eff = 100 * result.packing["efficiency"]
        rows.append(_row("packing efficiency %", eff, f"{eff:.3f}"))
    memory = format.plan_budget(result.metadata).memory
    if memory:
        from varlen_cli.memory.budget import memory_rows

        rows += [_row(label, value, value) for label, value in memory_rows(memory, result.metadata.get("shapes") or [])]
    ordered = result.metadata.get("schedule")
    if ordered:
        rows.append(_row(f"{ordered['name']} makespan ({ordered['stages']} stages) vs plan order",
                         [ordered["makespan"], ordered["makespan_plan_order"], ordered["gain"]],
                         f"{ordered['makespan']:.6g} vs {ordered['makespan_plan_order']:.6g} "
                         f"({ordered['gain']:+.2%})"))
        rows.append(_row("peak activation vs plan order",
                         [ordered["peak_activation"], ordered["peak_activation_plan_order"]],
                         f"{ordered['peak_activation']:,.0f} vs {ordered['peak_activation_plan_order']:,.0f} tokens"))
    rows.append(_row("seconds", s["seconds"]))
    return rows


def plan_json(result) -> dict:
    return as_json(plan_rows(result), result.output, **{"seconds per phase": dict(result.phases)})


def print_plan(result) -> None:
    """The rich table ``varlen plan`` prints at the end."""
    console().print(_summary_table(f"varlen plan → {result.output}", plan_rows(result)))
    warn_zero_loss(result)


def warn_zero_loss(result) -> None:
    """On stderr: steps without a loss target (``step_loss_tokens`` 0), whose mean loss is 0/0."""
    zero, steps = result.stats.get("zero_loss_steps", 0), result.stats["steps"]
    if zero:
        import sys

        which = "every step has" if zero == steps else f"{zero:,} of {steps:,} steps have"
        sys.stderr.write(f"varlen: warning: {which} step_loss_tokens 0 (no sample in them carries a loss target: "
                         f"target_length 0, or samples of 1 token): a loss averaged over a step's targets is 0/0 "
                         f"there\n")


def run_json(result) -> dict:
    """The stages' summaries (``analyze``, ``sort`` or null, ``plan``), the budget run picked, seconds, output."""
    return {"analyze": analyze_json(result.analyze),
            "sort": sort_json(result.sort) if result.sort is not None else None,
            "plan": plan_json(result.plan), "auto max tokens": result.auto_max_tokens, "seconds": result.seconds,
            "output": result.output}


def _overhead(stats: dict, metadata: dict) -> str:
    """The straggler overhead and the cost it is measured in (the plan's budget)."""
    from varlen_cli import format

    cost = format.plan_straggler_cost(metadata)
    what = {"tokens": "tokens", "packed": "tokens + A sum(l^2)", "padded": "B T + A B T^2"}.get(cost.get("kind"), "")
    value = stats.get("straggler_overhead")
    return (f"{100 * value:.2f}" if value is not None else "-") + (f" ({what})" if what else "")


def print_run(result) -> None:
    print_analyze(result.analyze)
    if result.sort is not None:
        print_sort(result.sort)
    print_plan(result.plan)
    c = console()
    if result.auto_max_tokens:
        c.print(f"--max-tokens not given: used {result.auto_max_tokens:,} "
                "(the larger of 16,384 and the longest sample)")
    c.print(f"[bold]varlen run[/] → {result.output} in {result.seconds:.2f} s "
            f"(metrics/, {'sorted/, ' if result.sort is not None else ''}plan.parquet)")
