"""The search's table of candidates (rows from ``Candidate.row``)."""

from __future__ import annotations

from elixir_tune.cli.console import Table


def layout_label(row: dict) -> str:
    """The parallel layout of a candidate row: dp, or pp/tp/ep degrees (e.g. ``pp2 tp4/2d``, ``ep4``)."""
    parts = []
    if row.get("pipeline", 1) > 1:
        parts.append(f"pp{row['pipeline']}")
    if row.get("tensor", 1) > 1:
        parts.append(f"tp{row['tensor']}" + ("/2d" if row.get("tensor_mode") == "2d" else ""))
    if row.get("expert", 1) > 1:
        parts.append(f"ep{row['expert']}")
    if row.get("context", 1) > 1:
        mode = row.get("context_mode", "ulysses")
        parts.append(f"cp{row['context']}" + ("" if mode == "ulysses" else f"/{mode}"))
    return " ".join(parts) or "dp"


def candidates_table(rows: list[dict], title: str) -> Table:
    """The best candidates as a rich table (rows from ``Candidate.row``)."""
    table = Table(title=title)
    # The layout column only when some candidate uses pipeline or tensor parallelism.
    parallel = any(layout_label(row) != "dp" for row in rows)
    table.add_column("#", justify="right", no_wrap=True)
    engines = any("engine" in row for row in rows)
    if engines:
        table.add_column("engine", no_wrap=True)
    if parallel:
        table.add_column("parallel", justify="right", no_wrap=True)
    for name in (
        "chunk MiB",
        "cache",
        "offloaded",
        "ckpt",
        "micro x accum (L: layered)",
        "step s",
        "tokens/s",
        "TFLOPS/GPU",
        "MFU",
        "GPU GiB",
        "host GiB",
    ):
        table.add_column(name, justify="right", no_wrap=True)
    for rank, row in enumerate(rows, 1):
        every = row["checkpointing"]
        table.add_row(
            str(rank),
            *([row.get("engine", "elixir")] if engines else []),
            *([layout_label(row)] if parallel else []),
            f"{row['chunk_mib']:.3g}",
            f"{row['cache_blocks']}/{row['cacheable_chunks']}",
            f"{row['offload']:.0%}",
            "none" if every == 0 else "all" if every == 1 else f"1/{every}",
            f"{row['micro_batch_size']} x {row['grad_accum_steps']}{' L' if row.get('accumulation') == 'layered' else ''}",
            f"{row['step_time_s']:.3g}",
            f"{row['tokens_per_s']:,.0f}",
            f"{row['tflops_per_gpu']:.3g}",
            f"{row['mfu']:.0%}",
            f"{row['peak_gpu_bytes'] / 2**30:.3g}",
            f"{row['peak_host_bytes'] / 2**30:.3g}",
            style="bold green" if rank == 1 else None,
        )
    return table
