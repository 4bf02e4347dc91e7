"""Rich summary tables printed at the end of each stage (rank 0 only): the one place the CLI prints
results; the library functions return them."""

from __future__ import annotations

from varlen_cli.runtime.text import fmt, histogram_lines  # noqa: F401  (re-exported for the CLI)


def console():
    from rich.console import Console

    return Console()


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


def print_analyze(result) -> None:
    from rich.table import Table

    s = result.stats
    t = Table(title=f"varlen analyze → {result.output}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    for label, value in [
        ("samples", result.num_samples), ("files", result.num_files), ("parts", result.num_parts),
        ("length", result.length), ("difficulty", result.difficulty), ("total length", s["total"]),
        ("min / p50 / p90 / p99 / max", f"{s['min']:,} / {s['p50']:,} / {s['p90']:,} / {s['p99']:,} / {s['max']:,}"),
        ("mean length", s["mean"]), ("seconds", result.seconds),
    ]:
        t.add_row(label, fmt(value))
    h = Table(title="lengths (log2 bins)", show_header=True)
    h.add_column("length")
    h.add_column("samples", justify="right")
    h.add_column("")
    for row in histogram_lines(s["histogram"]["log2_bins"]):
        h.add_row(*row)
    c = console()
    c.print(t)
    c.print(h)
    empty = s["histogram"]["log2_bins"][0] if s["histogram"]["log2_bins"] else 0
    if empty:
        import sys

        sys.stderr.write(f"varlen: warning: {empty:,} samples have length 0; they are kept "
                         "(plans still schedule them; they add no tokens)\n")


def print_sort(result) -> None:
    """The summary table: rows, rows per worker, balance, seconds per phase."""
    from rich.table import Table

    o = result.order
    rows = result.rows_per_worker
    order = ",".join(o["by"]) + (" descending" if o["descending"] else "") + f", ties {o['ties']}"
    if o["ties"] == "shuffle":
        order += f" (seed {o['seed']})"
    t = Table(title=f"varlen sort → {result.output}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    for label, value in [
        ("rows", result.num_rows), ("order", order), ("workers", result.world_size), ("parts", result.num_parts),
        ("rows per worker (min / max)", f"{min(rows):,} / {max(rows):,}"),
        ("balance (max / mean)", f"{result.balance:.3f}"),
        ("seconds", result.seconds),
    ]:
        t.add_row(label, fmt(value))
    peaks = [p for p in result.peak_rss_bytes if p]
    if peaks:
        t.add_row("peak memory per worker (max)", f"{max(peaks) / 2**20:,.0f} MiB")
    p = Table(title="seconds per phase (slowest worker)", show_header=True)
    p.add_column("phase")
    p.add_column("seconds", justify="right")
    for phase, secs in result.phases.items():
        p.add_row(phase.replace("_", " "), f"{secs:.2f}")
    c = console()
    c.print(t)
    c.print(p)


def print_plan(result) -> None:
    """The rich table ``varlen plan`` prints at the end."""
    from rich.table import Table

    s = result.stats
    t = Table(title=f"varlen plan → {result.output}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    rows = [
        ("order", result.order), ("epochs", s["epochs"]), ("steps", s["steps"]),
        ("microbatches", s["microbatches"]), ("samples", s["samples"]), ("tokens", s["tokens"]),
        ("samples / microbatch", s["mean_samples_per_microbatch"]),
        ("padding %", f"{s['padding_pct']:.2f}"), ("budget fill %", f"{s['budget_fill_pct']:.2f}"),
        ("straggler mean / max", f"{s['straggler_mean']:.3f} / {s['straggler_max']:.3f}"),
        ("straggler overhead %", _overhead(s, result.metadata)),
        ("distinct shapes", s["distinct_shapes"]),
        ("lr_scale min / max", f"{s['lr_scale_min']:.3f} / {s['lr_scale_max']:.3f}"),
        ("dropped samples", s["dropped"]),
    ]
    for src in (result.metadata.get("mixture") or {}).get("sources", []):  # varlen plan --mix
        rows.append((f"tokens of {src['name']} (weight {src['weight']:g}) per epoch",
                     " / ".join(f"{t:,}" for t in src["tokens_per_epoch"])))
    if s.get("warmup_steps"):
        rows.append(("compile warm-up steps", s["warmup_steps"]))
    if result.packing:
        rows.append(("packing efficiency %", f"{100 * result.packing['efficiency']:.3f}"))
    if result.metadata.get("memory"):
        from varlen_cli.memory.budget import memory_rows

        rows += memory_rows(result.metadata)
    ordered = result.metadata.get("schedule")
    if ordered:
        rows.append((f"{ordered['name']} makespan ({ordered['stages']} stages) vs plan order",
                     f"{ordered['makespan']:.6g} vs {ordered['makespan_plan_order']:.6g} ({ordered['gain']:+.2%})"))
        rows.append(("peak activation vs plan order",
                     f"{ordered['peak_activation']:,.0f} vs {ordered['peak_activation_plan_order']:,.0f} tokens"))
    rows.append(("seconds", s["seconds"]))
    for label, value in rows:
        t.add_row(label, fmt(value))
    console().print(t)


def _overhead(stats: dict, metadata: dict) -> str:
    """The straggler overhead and the cost it is measured in (the plan's ``straggler_cost``)."""
    cost = metadata.get("straggler_cost") or {}
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
