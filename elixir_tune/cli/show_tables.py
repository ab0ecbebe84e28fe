"""The tables of `elixir-tune show`: memory per device and per pipeline stage, the predicted timeline,
the chunk placement (kept apart from the command, which reads the plan and prints them)."""

from __future__ import annotations

from elixir_tune.cli.console import Table
from elixir_tune.costmodel.offload import (
    HOST_ADAM_RATE_FACTORS,
    HOST_ADAM_SHARE_SHOWN,
    host_adam_share,
    step_at_host_adam_rate,
)
from elixir_tune.plan import Plan
from elixir_tune.units import human_bytes

_STATE_LABELS = {
    "cache_bytes": "cache blocks (gathered chunks)",
    "resident_bytes": "resident chunks",
    "device_shard_bytes": "optimizer shards on the GPU",
    "host_shard_bytes": "optimizer shards on the host",
}
_TIMELINE_LABELS = {
    "compute_s": "compute (recompute included)",
    "recompute_s": "  of which recompute",
    "exposed_fetch_s": "compute waiting for fetches",
    "grad_drain_s": "gradient reduce after the last compute",
    "allgather_s": "all-gather busy",
    "reduce_scatter_s": "reduce-scatter busy",
    "h2d_s": "host->GPU copies busy",
    "d2h_s": "GPU->host copies busy",
    "optimizer_gpu_s": "Adam on the GPU",
    "optimizer_cpu_s": "Adam on the CPU",
    "optimizer_exposed_s": "optimizer after backward (norm + Adam)",
    "collective_compute_loss_s": "compute slowed by the collectives beside it",
    "tensor_comm_s": "tensor-parallel collectives (on the compute stream)",
    "expert_comm_s": "expert-parallel all-to-alls (on the compute stream)",
    "context_comm_s": "context-parallel all-to-alls (inside attention)",
    "pipeline_bubble_s": "pipeline bubble (idle)",
    "p2p_s": "pipeline sends exposed",
    "tied_allreduce_s": "tied-embedding all-reduce (first and last stage)",
    "bound_compute_s": "bound: useful FLOPs at the best published MFU",
    "bound_pcie_s": "bound: offloaded shards over PCIe",
    "bound_cpu_adam_s": "bound: host Adam at the node's rate",
    "bound_excess_s": "DEFECT: predicted faster than the bound allows, by",
}


def placement_runs(plan: Plan) -> list[dict]:
    """Consecutive chunks with the same placement, as rows (first/last id, count, placement, params)."""
    runs: list[dict] = []
    device = "GPU" if plan.cluster.device == "cuda" else "device (CPU)"
    for chunk in plan.memory.chunks:
        where = (
            ("frozen, " if chunk.frozen else "")
            + ("resident" if chunk.resident else "cached")
            + (", shard on host" if chunk.offload else f", shard on {device}")
        )
        if runs and runs[-1]["placement"] == where and runs[-1]["last"] == chunk.id - 1:
            run = runs[-1]
            run.update(
                last=chunk.id, count=run["count"] + 1, numel=run["numel"] + chunk.numel, last_param=chunk.params[-1]
            )
        else:
            runs.append(
                {
                    "first": chunk.id,
                    "last": chunk.id,
                    "count": 1,
                    "placement": where,
                    "numel": chunk.numel,
                    "first_param": chunk.params[0],
                    "last_param": chunk.params[-1],
                }
            )
    return runs


def memory_table(plan: Plan, states: dict[str, int]) -> Table:
    of_rank = "per device (rank)"
    if plan.parallel.pipeline.stages > 1:  # the prediction's memory figures are all of one stage
        of_rank = "per device (rank) of the pipeline stage with the highest peak"
    table = Table(title=f"memory {of_rank} and per node, {plan.training.dtype}")
    table.add_column("part")
    table.add_column("bytes", justify="right")
    table.add_column("size", justify="right")
    device_states = 0
    for key in ("cache_bytes", "resident_bytes", "device_shard_bytes"):
        table.add_row(_STATE_LABELS[key], f"{states[key]:,}", human_bytes(states[key]))
        device_states += states[key]
    prediction = plan.prediction
    if prediction is not None:
        held = prediction.transient_bytes.get("held_grad_bytes", 0)
        if held:
            table.add_row("gradients a pipeline step holds (no-sync)", f"{held:,}", human_bytes(held))
        rest = prediction.peak_gpu_bytes - device_states - held
        table.add_row("activations, frozen params, buffers, gradient staging", f"{rest:,}", human_bytes(rest))
        table.add_row("[bold]peak per GPU[/]", f"{prediction.peak_gpu_bytes:,}", human_bytes(prediction.peak_gpu_bytes))
    table.add_row(
        _STATE_LABELS["host_shard_bytes"] + " (per rank)",
        f"{states['host_shard_bytes']:,}",
        human_bytes(states["host_shard_bytes"]),
    )
    if prediction is not None:
        table.add_row(
            "[bold]peak host per node[/]", f"{prediction.peak_host_bytes:,}", human_bytes(prediction.peak_host_bytes)
        )
        if plan.cluster.device == "cpu":
            # One memory: the host part is the node's, shared by its workers; each byte counted once.
            per_rank = prediction.peak_gpu_bytes + prediction.peak_host_bytes // plan.cluster.gpus_per_node
            table.add_row(
                "[bold]peak per worker (cpu: device and host are one memory)[/]", f"{per_rank:,}", human_bytes(per_rank)
            )
    return table


def stages_table(plan: Plan) -> Table | None:
    """Each pipeline stage's memory per rank (``prediction.stages``: what each rank's
    ``memory_report()`` says), or None for a plan without them."""
    stages = plan.prediction.stages if plan.prediction is not None else []
    if not stages:
        return None
    cpu = plan.cluster.device == "cpu"
    table = Table(title=f"memory per rank of each pipeline stage, {plan.training.dtype}")
    for name in ("stage", "cache", "resident", "optimizer shards", "held gradients", "host shards", "peak per GPU"):
        table.add_column(name, justify="left" if name == "stage" else "right")
    if cpu:
        table.add_column("peak per worker", justify="right")
    for entry in stages:
        states, held = entry.model_state_bytes, entry.transient_bytes.get("held_grad_bytes", 0)
        # A hand-edited plan may lack a part: shown as unknown, not as 0.
        row = [str(entry.stage)] + [
            "-" if value is None else human_bytes(value)
            for value in (
                states.get("cache_bytes"),
                states.get("resident_bytes"),
                states.get("device_shard_bytes"),
                held,
                states.get("host_shard_bytes"),
                entry.peak_gpu_bytes,
            )
        ]
        if cpu:  # one memory: the rank's device part and its share of the node's host part
            row.append(human_bytes(entry.peak_gpu_bytes + entry.peak_host_bytes // plan.cluster.gpus_per_node))
        table.add_row(*row)
    return table


def timeline_table(plan: Plan) -> Table:
    prediction = plan.prediction
    assert prediction is not None, "only plans with a prediction have a timeline"
    table = Table(
        title=(
            f"predicted step: {prediction.step_time_s:.4g} s, {prediction.tokens_per_s:,.0f} tokens/s, "
            f"{prediction.tflops_per_gpu:.1f} TFLOPS/GPU, MFU {prediction.mfu:.0%}"
        )
    )
    table.add_column("part of the step")
    table.add_column("seconds", justify="right")
    table.add_column("share of step", justify="right")
    for key, value in prediction.breakdown.items():
        share = value / prediction.step_time_s if prediction.step_time_s else 0.0
        table.add_row(_TIMELINE_LABELS.get(key, key), f"{value:.4g}", f"{share:.0%}")
    return table


def host_adam_line(plan: Plan, rate_note: str = "", simulated_s: dict[float, float] | None = None) -> str:
    """One line when host Adam is more than ``HOST_ADAM_SHARE_SHOWN`` of the predicted step: its share and
    the step at other host Adam rates; '' otherwise.

    Args:
        plan: a plan with a prediction.
        rate_note: the rate predicted with and where it comes from (e.g. "1.8e9 elements/s per node, preset").
        simulated_s: rate factor -> the step simulated again at that rate; without it, the optimizer alone
            moves (``costmodel.offload.step_at_host_adam_rate``, from the plan's breakdown).
    """
    prediction = plan.prediction
    if prediction is None:
        return ""
    step_s, breakdown = prediction.step_time_s, prediction.breakdown
    share = host_adam_share(breakdown, step_s)
    if share <= HOST_ADAM_SHARE_SHOWN:
        return ""
    serial = plan.cluster.device == "cpu"
    steps = simulated_s or {
        factor: step_at_host_adam_rate(breakdown, step_s, factor, serial) for factor in HOST_ADAM_RATE_FACTORS
    }
    moved = ", ".join(f"{steps[factor]:.4g} s at {factor:g}x" for factor in HOST_ADAM_RATE_FACTORS)
    how = "simulated again" if simulated_s else "the optimizer alone moved; the profile would simulate it all"
    return (
        f"{breakdown['optimizer_cpu_s']:.4g} s of the {step_s:.4g} s step ({share:.0%}) is Adam on the host"
        + (f" ({rate_note})" if rate_note else "")
        + f": the step is {moved} that rate ({how}). Measure it with `elixir-tune probe` on the training machine"
    )


def placement_table(plan: Plan) -> Table:
    memory = plan.memory
    chunks = memory.chunks
    cacheable = sum(1 for c in chunks if not c.resident)
    table = Table(
        title=(
            f"chunk placement: {len(chunks)} chunks of {memory.chunk_size:,} elements, "
            f"{memory.cache_blocks} of {cacheable} cacheable held at once, prefetch {memory.prefetch}, "
            f"{sum(1 for c in chunks if c.offload)} shards on the host"
            + (" (all stages)" if plan.parallel.pipeline.stages > 1 else "")
        )
    )
    for name in ("chunks", "count", "placement", "elements", "parameters"):
        table.add_column(name, justify="right" if name in ("count", "elements") else "left")
    for run in placement_runs(plan):
        ids = str(run["first"]) if run["first"] == run["last"] else f"{run['first']}-{run['last']}"
        params = (
            run["first_param"]
            if run["first_param"] == run["last_param"]
            else f"{run['first_param']} .. {run['last_param']}"
        )
        table.add_row(ids, str(run["count"]), run["placement"], f"{run['numel']:,}", params)
    return table


def engine_line(plan) -> str:
    """Why the plan's engine: its prediction beside the best recorded candidate of each other engine
    (``search --engine any`` records them among the alternatives); "" for a plan of our engine searched alone."""
    from elixir_tune.costmodel.peers import describe

    rows = plan.search.alternatives if plan.search else []
    if plan.prediction is None or (plan.engine.name == "elixir" and not any("engine" in row for row in rows)):
        return ""
    step_s = plan.prediction.step_time_s
    line = (
        f"{describe(plan.engine)} chosen: {step_s:.3g} s/step predicted, "
        f"{plan.prediction.peak_gpu_bytes / 2**30:.2f} GiB per rank"
    )
    others: dict[str, dict] = {}
    for row in rows:  # best first: the first of each engine is its best
        others.setdefault(str(row.get("engine", "elixir")).split()[0], row)
    others.pop(plan.engine.name, None)
    parts = [
        f"{row.get('engine', 'elixir')} {row['step_time_s']:.3g} s ({row['step_time_s'] / step_s - 1:+.1%}), "
        f"{row['peak_gpu_bytes'] / 2**30:.2f} GiB"
        for row in sorted(others.values(), key=lambda row: row["step_time_s"])
    ]
    return line + ("; best of the other engines: " + "; ".join(parts) if parts else "")
