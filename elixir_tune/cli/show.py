"""`elixir-tune show PLAN`: memory per device, predicted timeline, chunk placement."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from elixir_tune.cli.console import console, fail, print_json, print_wide
from elixir_tune.cli.show_tables import (
    engine_line,
    host_adam_line,
    memory_table,
    placement_runs,
    placement_table,
    stages_table,
    timeline_table,
)
from elixir_tune.costmodel.memory import model_state_bytes
from elixir_tune.costmodel.rates import BOUND_LABELS, binding_bound
from elixir_tune.plan import Plan, PlanError, load_plan
from elixir_tune.plan.capabilities import LOOP_CONTRACT, plan_loop
from elixir_tune.plan.schema import MODEL_STATE_KEYS
from elixir_tune.ranks import mesh_groups
from elixir_tune.units import human_bytes


def bound_line(plan: Plan) -> str:
    """Which plausibility bound is tightest for the plan's prediction, and whether the prediction beats it
    (a defect of the cost model: the bound is a check and never replaces the prediction)."""
    breakdown = plan.prediction.breakdown if plan.prediction else {}
    binding = binding_bound(breakdown)
    if binding is None:
        return "no plausibility bound recorded (the hardware has no published MFU and nothing is offloaded)"
    key, bound_s = binding
    excess_s = breakdown.get("bound_excess_s", 0.0)
    if excess_s > 0:
        return (
            f"DEFECT of the cost model: the predicted step ({bound_s - excess_s:.4g} s) is faster than "
            f"{BOUND_LABELS[key]} allows ({bound_s:.4g} s); the prediction is shown as the model made it"
        )
    step_s = plan.prediction.step_time_s if plan.prediction else 0.0
    return f"{BOUND_LABELS[key]} is the tightest bound, {bound_s:.4g} s ({bound_s / step_s:.0%} of the predicted step)"


def plan_states(plan: Plan) -> dict[str, int]:
    """Model-state bytes per rank by the plan's formula (the prediction's, or computed here)."""
    predicted = plan.prediction.model_state_bytes if plan.prediction is not None else {}
    if set(predicted) == set(MODEL_STATE_KEYS):  # a hand-edited plan may lack a part: computed here then
        return {str(key): value for key, value in predicted.items()}
    chunks = plan.memory.chunks
    trained = [c for c in chunks if not c.frozen]
    frozen = [c for c in chunks if c.frozen]
    return model_state_bytes(
        plan.memory.chunk_size,
        plan.shard_group_size,  # data x context
        plan.training.dtype,
        plan.memory.cache_blocks,
        sum(1 for c in chunks if c.resident),
        sum(1 for c in trained if not c.offload),
        sum(1 for c in trained if c.offload),
        sum(1 for c in frozen if not c.offload),
        sum(1 for c in frozen if c.offload),
    )


def parallel_summary(plan: Plan, expert_bytes: int | None = None, context_bytes: tuple[int, int] | None = None) -> dict:
    """The parallel layout of a plan and why it costs what it does: degrees, the pipeline's virtual
    stages and bubble fraction (``costmodel.parallel.bubble_fraction``), chunks per stage, the expert
    groups, and the predicted seconds of tensor collectives, expert all-to-alls, bubble and sends
    (``expert_bytes``: the all-to-all bytes a rank sends per micro-batch, when the profile is at hand)."""
    from elixir_tune.costmodel.parallel import bubble_fraction, virtual_stages

    pipeline, tensor = plan.parallel.pipeline, plan.parallel.tensor
    out: dict = {
        "world_size": plan.world_size,
        "data": plan.data_parallel_size,
        "pipeline": pipeline.stages,
        "tensor": tensor.degree,
    }
    breakdown = plan.prediction.breakdown if plan.prediction else {}
    if pipeline.stages > 1:
        virtual = virtual_stages(plan.model.num_blocks, pipeline.stages, pipeline.assignment)
        out.update(
            assignment=pipeline.assignment,
            schedule=pipeline.schedule,
            virtual_stages_per_rank=round(virtual, 3),
            bubble_fraction=round(bubble_fraction(pipeline.stages, plan.training.grad_accum_steps, virtual), 4),
            chunks_per_stage=[sum(1 for c in plan.memory.chunks if c.stage == s) for s in range(pipeline.stages)],
        )
    if tensor.degree > 1:
        out.update(tensor_mode=tensor.mode, sequence_parallel=tensor.sequence_parallel)
    expert = plan.parallel.expert.degree
    if pipeline.stages > 1 or tensor.degree > 1 or expert > 1:
        out["groups"] = mesh_groups(plan.world_size, pipeline.stages, tensor.degree, plan.parallel.context.degree)
    context = plan.parallel.context
    if context.degree > 1:  # C ranks T apart (rank = ((data_index x P + stage) x C + context_index) x T + tensor_index)
        out.update(context=context.degree, context_mode=context.mode)
        if context_bytes is not None:
            out.update(context_buffer_bytes=context_bytes[0], context_held_bytes_per_block=context_bytes[1])
        step = tensor.degree
        groups = out.get("groups", {})  # beside tensor parallelism: its tensor and data x context groups
        groups["context"] = [
            [start + index * step + offset for index in range(context.degree)]
            for start in range(0, plan.world_size, context.degree * step)
            for offset in range(step)
        ]
        out["groups"] = groups
    if expert > 1:  # E consecutive ranks of each data group; the ranks E apart hold the same experts
        data_groups = out["groups"]["data"]
        out.update(expert=expert, num_experts=plan.model.num_experts, expert_bytes_per_micro_batch=expert_bytes)
        out["groups"]["expert"] = [g[i : i + expert] for g in data_groups for i in range(0, len(g), expert)]
        out["groups"]["expert-data"] = [g[i::expert] for g in data_groups for i in range(expert)]
    for key in (
        "tensor_comm_s",
        "expert_comm_s",
        "context_comm_s",
        "context_attention_s",
        "pipeline_bubble_s",
        "p2p_s",
        "tied_allreduce_s",
    ):
        if key in breakdown:
            out[key] = breakdown[key]
    return out


def parallel_line(plan: Plan, expert_bytes: int | None = None, context_bytes: tuple[int, int] | None = None) -> str:
    """One sentence on the plan's parallel layout and what it costs ("" without pipeline, tensor,
    expert or context parallelism)."""
    info = parallel_summary(plan, expert_bytes, context_bytes)
    if info["pipeline"] == 1 and info["tensor"] == 1 and "expert" not in info and "context" not in info:
        return ""
    step = plan.prediction.step_time_s if plan.prediction else 0.0

    def share(key: str) -> str:
        return f", {info[key] / step:.1%} of the predicted step" if key in info and step else ""

    parts = [
        f"world {info['world_size']} = data {info['data']} x pipeline {info['pipeline']} x tensor {info['tensor']}"
    ]
    if info["pipeline"] > 1:
        # fewer micro-batches than stages on a looped pipeline: each loop waits P slots (bubble_fraction)
        looped_short = plan.training.grad_accum_steps < info["pipeline"] and info["virtual_stages_per_rank"] > 1
        formula = "1 - N v / ((v-1) P + N + P-1)" if looped_short else "(P-1)/(N v + P-1)"
        parts.append(
            f"pipeline: {info['pipeline']} stages, {info['assignment']} assignment ({info['virtual_stages_per_rank']:g} "
            f"virtual stages per rank), {info['schedule']} over {plan.training.grad_accum_steps} micro-batches: bubble "
            f"{formula} = {info['bubble_fraction']:.1%}{share('pipeline_bubble_s')}; chunks per stage "
            f"{info['chunks_per_stage']}"
        )
    if info["tensor"] > 1:
        mode = "1d (Megatron" + (", sequence-parallel)" if info["sequence_parallel"] else ")")
        if info["tensor_mode"] == "2d":
            mode = "2d (Optimus q x q grid)"
        parts.append(
            f"tensor: degree {info['tensor']}, {mode}: collectives on the compute stream{share('tensor_comm_s')}"
        )
    if "context" in info:
        parts[0] += f" x context {info['context']}"
        parts.append(_context_clause(info, plan, share))
    if "expert" in info:
        sent = info["expert_bytes_per_micro_batch"]
        parts.append(
            f"expert: degree {info['expert']}, each rank holds {info['num_experts'] // info['expert']} of the "
            f"{info['num_experts']} experts of every block; tokens go to them by all-to-all (4 per MoE block and "
            f"micro-batch{f', {human_bytes(sent)} out of each rank' if sent else ''}) on the compute stream"
            f"{share('expert_comm_s')}"
        )
    return "; ".join(parts)


def _context_clause(info: dict, plan: Plan, share) -> str:
    """``parallel_line``'s sentence on context parallelism: why (a rank holds 1/C of every sequence's
    activations and logits), the exchange's time and, with the profile at hand, its memory."""
    from elixir_tune.search.explain import CONTEXT_WORDS

    degree, t = info["context"], plan.training
    clause = (
        f"context: degree {degree} ({CONTEXT_WORDS.get(info['context_mode'], info['context_mode'])}), each rank "
        f"computes 1/{degree} of every sequence ({t.seq_len // degree} of its {t.seq_len} tokens) and keeps 1/{degree} "
        "of its activations and logits, which is why long sequences fit with less recomputation; chunks sharded "
        f"over data x context; the exchange inside attention takes {info.get('context_comm_s', 0.0):.3g} s"
        f"{share('context_comm_s')}"
    )
    if "context_attention_s" in info:
        clause += f", the masked half of the all-gather form's attention {info['context_attention_s']:.3g} s"
        clause += share("context_attention_s")
    if "context_buffer_bytes" in info:
        clause += f"; its buffers {human_bytes(info['context_buffer_bytes'])} at one block per micro-batch"
        if info["context_held_bytes_per_block"]:
            clause += f", the gathered keys, values and mask {human_bytes(info['context_held_bytes_per_block'])} kept by each block"
    return clause


SHOWN_GROUPS = 4  # groups of each kind listed by `show` (the JSON lists all)


def mesh_lines(plan: Plan) -> list[str]:
    """Which ranks form each group of the plan's mesh, one line per kind ([] without pipeline or tensor)."""
    groups = parallel_summary(plan).get("groups")
    if not groups:
        return []
    what = {
        "tensor": "split each block's matrices (consecutive ranks, one node)",
        "pipeline": "pass activations stage to stage (one per data and tensor index)",
        "data": "shard the chunks and reduce gradients (one per stage and tensor index)",
        "expert": "hold different experts and exchange tokens (all-to-all)",
        "expert-data": "hold the same experts and reduce their gradients",
        "context": "hold shares of the same sequences and exchange keys and values (consecutive ranks)",
    }
    lines = []
    for kind in [kind for kind in what if kind in groups]:
        listed = " ".join("[" + ",".join(map(str, group)) + "]" for group in groups[kind][:SHOWN_GROUPS])
        more = f" ... ({len(groups[kind])} groups)" if len(groups[kind]) > SHOWN_GROUPS else ""
        meaning = what[kind]
        if kind == "context" and plan.parallel.tensor.degree > 1:
            meaning = meaning.replace("consecutive ranks", f"{plan.parallel.tensor.degree} ranks apart")
        lines.append(f"{kind} groups {meaning}: {listed}{more}")
    return lines


def _summary(plan: Plan) -> dict:
    chunks = plan.memory.chunks
    states = plan_states(plan)
    return {
        "model": vars(plan.model),
        "cluster": vars(plan.cluster),
        "parallel": parallel_summary(plan),
        "training": {
            **{k: v for k, v in vars(plan.training).items() if k != "activation_checkpointing"},
            "checkpointing_every": plan.training.activation_checkpointing.every,
            "checkpointing_mode": plan.training.activation_checkpointing.mode,
            "loop": plan_loop(plan),
        },
        "memory": {
            "chunk_size": plan.memory.chunk_size,
            "cache_blocks": plan.memory.cache_blocks,
            "prefetch": plan.memory.prefetch,
            "num_chunks": len(chunks),
            "resident_chunks": sum(1 for c in chunks if c.resident),
            "offloaded_chunks": sum(1 for c in chunks if c.offload),
            "model_state_bytes": states,
        },
        "placement": placement_runs(plan),
        "prediction": dataclasses.asdict(plan.prediction) if plan.prediction else None,
        "bound": bound_line(plan) if plan.prediction else None,
        "search": ({k: v for k, v in vars(plan.search).items() if k != "alternatives"} if plan.search else None),
    }


def _expert_bytes(plan: Plan, given: str | None) -> int | None:
    """The all-to-all bytes a rank sends per micro-batch under the plan's expert parallelism, from
    its profile (given, or the one the plan names) when it is there; None otherwise."""
    named = given or (plan.search.profile if plan.search is not None else "")
    if plan.parallel.expert.degree <= 1 or not named or not Path(named).is_file():
        return None
    from elixir_tune.costmodel.expert import expert_all_to_all_bytes, expert_param_indices, moe_block_count
    from elixir_tune.plan.schema import DTYPE_BYTES
    from elixir_tune.profiler import load_profile

    profile = load_profile(named)
    arch, training = profile.arch, plan.training
    return expert_all_to_all_bytes(
        plan.parallel.expert.degree,
        training.micro_batch_size * training.seq_len,
        arch.hidden_size,
        arch.experts_per_token,
        moe_block_count(profile, expert_param_indices(profile)),
        DTYPE_BYTES[training.dtype],
    )


def _context_bytes(plan: Plan, given: str | None) -> tuple[int, int] | None:
    """(exchange buffers at one block, bytes each block keeps) of one micro-batch under the plan's
    context parallelism (``costmodel/context.py``), from its profile when it is there; None otherwise."""
    named = given or (plan.search.profile if plan.search is not None else "")
    context = plan.parallel.context
    if context.degree <= 1 or not named or not Path(named).is_file():
        return None
    from elixir_tune.costmodel.context import ContextWidths, exchange_bytes_per_sample, held_bytes_per_sample
    from elixir_tune.profiler import load_profile

    t = plan.training
    widths = ContextWidths.of(load_profile(named), context.degree, context.mode, t.dtype, plan.parallel.tensor.degree)
    return (
        t.micro_batch_size * exchange_bytes_per_sample(widths),
        t.micro_batch_size * held_bytes_per_sample(widths),
    )


def _profile_of(plan: Plan, plan_path: str, given: str | None) -> str:
    """The profile to simulate a plan from: the one given, else the one the plan names, else
    ``profile.yaml`` here; a clear error when none is there."""
    if given is not None:
        return given
    named = plan.search.profile if plan.search is not None else ""
    if named:
        if not Path(named).is_file():
            fail(
                f"{plan_path} was searched from the profile {named}, which is gone, and --timeline needs it",
                hint=f"profile the model again (elixir-tune profile MODEL --out {named}) or pass --profile FILE",
            )
        return named
    if not Path("profile.yaml").is_file():
        fail(
            f"{plan_path} does not name its profile (written before plans recorded it) and there is no "
            "profile.yaml here; --timeline needs the profile the plan was searched from",
            hint="pass it with --profile FILE",
        )
    return "profile.yaml"


def _simulation(plan: Plan, profile, hardware):
    """The cost model of the plan's cluster and the plan's shape in it, or a reason it cannot be simulated.

    Returns:
        (model, shape, None), or (None, None, (what is wrong, what to do)).
    """
    from elixir_tune.costmodel.model import CostModel, Shape
    from elixir_tune.costmodel.parallel import Layout

    if profile.fingerprint != plan.model.fingerprint:
        mismatch = (
            f"profiles another model than the plan's (fingerprint {profile.fingerprint}, the plan's "
            f"{plan.model.fingerprint})"
        )
        return None, None, (mismatch, "pass the profile the plan was searched from with --profile")
    layout = Layout.of_plan(plan.parallel)
    model = CostModel(
        profile, hardware, plan.cluster.gpus_per_node, plan.cluster.nodes, plan.training.dtype, layout=layout
    )
    memory = plan.memory
    # The search's critical stage is the one simulated (with one stage: every chunk); its chunks are
    # matched to the cost model's packing by their first parameter.
    planned = {chunk.params[0]: chunk for chunk in memory.chunks if chunk.stage == model.stage}
    packed = model.layout(memory.chunk_size).chunks
    first_names = [model.profile.params[chunk.params[0]].name for chunk in packed]
    if not set(planned) <= set(first_names):
        repacked = (
            f"the plan's chunks are not the search's packing of this profile at chunk size "
            f"{memory.chunk_size:,} (edited by hand?), so its timeline cannot be simulated"
        )
        return None, None, (repacked, "search the plan again, e.g. elixir-tune search --fix chunk_size=...")
    offloaded = tuple(i for i, name in enumerate(first_names) if name in planned and planned[name].offload)
    return model, Shape.of_plan(plan, len(offloaded), offloaded), None


def _draw(plan: Plan, path: str, profile_path: str, hardware_ref: str | None) -> None:
    """The plan's predicted step, simulated again from its profile and hardware, as SVG."""
    from elixir_tune.cli.search import _load_inputs
    from elixir_tune.costmodel.picture import picture_of, shape_title, write_svg

    profile, hardware, _ = _load_inputs(profile_path, hardware_ref or plan.cluster.hardware)
    model, shape, why = _simulation(plan, profile, hardware)
    if model is None or shape is None:
        message, hint = why or ("cannot be simulated", "")
        fail(f"{profile_path} {message}" if message.startswith("profiles") else message, hint=hint)
    estimate = model.step_time(shape)
    title = shape_title("this plan", shape, estimate.step_time_s, model.memory(shape).peak_gpu_bytes)
    try:
        write_svg(path, [picture_of(model, shape, title, hardware.usable_memory_bytes)])
    except OSError as error:
        fail(f"cannot write {path}: {error}", hint="pass another path with --timeline")


def _host_adam_steps(plan: Plan, profile_path: str | None, hardware) -> dict[float, float]:
    """The plan's step simulated again with the host Adam rate times each of ``HOST_ADAM_RATE_FACTORS``
    (the optimizer and the host's gradient adds move with it); {} when its profile is not at hand."""
    from elixir_tune.costmodel.offload import HOST_ADAM_RATE_FACTORS
    from elixir_tune.profiler.schema import load_profile

    named = profile_path or (plan.search.profile if plan.search is not None else "") or "profile.yaml"
    try:
        profile = load_profile(named)
    except (FileNotFoundError, ValueError):
        return {}
    steps = {}
    for factor in HOST_ADAM_RATE_FACTORS:
        scaled = dataclasses.replace(
            hardware,
            cpu_adam_elems_per_s=hardware.cpu_adam_elems_per_s * factor,
            cpu_adam_node_elems_per_s=hardware.cpu_adam_node_elems_per_s * factor,
        )
        model, shape, _ = _simulation(plan, profile, scaled)
        if model is None or shape is None:
            return {}
        steps[factor] = model.step_time(shape).step_time_s
    return steps


def _host_adam(plan: Plan, profile_path: str | None, hardware_ref: str | None) -> str:
    """``show_tables.host_adam_line`` with the plan's hardware's rate, its source, and the step simulated
    again at other rates where the profile and hardware are at hand."""
    from elixir_tune.hardware import load_hardware

    if not host_adam_line(plan):  # not mostly host Adam: nothing to load
        return ""
    ref = hardware_ref or plan.cluster.hardware
    try:
        hardware = load_hardware(ref)
    except (FileNotFoundError, ValueError):
        return host_adam_line(plan)
    node = hardware.cpu_adam_node_elems_per_s or hardware.cpu_adam_elems_per_s * hardware.gpus_per_node
    source = hardware.sources.get("cpu_adam_node_elems_per_s", "no source")
    how = "measured by the probe" if source.startswith("measured") else f"{ref}: {source}"
    return host_adam_line(
        plan, f"{node:.3g} elements/s per node, {how}", _host_adam_steps(plan, profile_path, hardware)
    )


@click.command("show")
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option(
    "--timeline",
    "timeline_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Draw the predicted step (one lane per resource, device memory over the step) to this SVG file.",
)
@click.option(
    "--profile",
    "profile_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="With --timeline: the profile the plan was searched from [default: the one the plan names "
    "(search.profile), else profile.yaml].",
)
@click.option(
    "--hardware",
    "hardware_ref",
    default=None,
    help="With --timeline: preset id or hardware file (default: the plan's cluster.hardware).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def show_command(
    plan_path: str, timeline_path: str | None, profile_path: str | None, hardware_ref: str | None, as_json: bool
) -> None:
    """Explain a plan: memory breakdown, predicted timeline, chunk placement.

    \b
    Example:
        elixir-tune show plan.yaml
        elixir-tune show configs/plans/example.yaml --json
        elixir-tune show plan.yaml --timeline step.svg --profile profile.yaml
    """
    try:
        plan = load_plan(plan_path)
    except PlanError as error:
        fail(
            f"{plan_path}: cannot be shown:\n" + "\n".join(f"  - {p}" for p in error.problems),
            hint=f"check it with `elixir-tune validate {plan_path}`",
        )
    if timeline_path:
        _draw(plan, timeline_path, _profile_of(plan, plan_path, profile_path), hardware_ref)
    summary = _summary(plan)
    if as_json:
        print_json({"plan": plan_path, **summary})
        return
    t, c = plan.training, plan.cluster
    every = t.activation_checkpointing.every
    console.print(
        f"[bold]{plan_path}[/]: {plan.model.name or plan.model.source} ({plan.model.num_params:,} parameters) "
        f"on {c.nodes} x {c.gpus_per_node} x {c.hardware} ({c.device}, {c.backend}); {t.dtype}, "
        f"global batch {t.global_batch_size} = micro-batch {t.micro_batch_size} x accumulation "
        f"{t.grad_accum_steps} ({t.accumulation}) x {plan.data_parallel_size} data-parallel ranks, seq {t.seq_len}, "
        f"checkpointing {'none' if every == 0 else 'all blocks' if every == 1 else f'every {every} blocks'}"
        + (" (selective)" if every and t.activation_checkpointing.mode == "selective" else ""),
        soft_wrap=True,
    )
    loop = plan_loop(plan)
    also = "; model.forward_backward(micro_batches) runs it too" if loop == "plain" else ""
    console.print(f"[bold]training script:[/] runs {LOOP_CONTRACT[loop]} (training.loop: {loop}){also}", soft_wrap=True)
    layout_line = parallel_line(plan, _expert_bytes(plan, profile_path), _context_bytes(plan, profile_path))
    if layout_line:
        console.print(f"[bold]parallel:[/] {layout_line}", soft_wrap=True)
        order = "rank = (data_index x P + stage) x T + tensor_index"
        console.print(f"[bold]mesh[/] ({order}):", soft_wrap=True)
        for line in mesh_lines(plan):
            console.print(f"  {line}", soft_wrap=True)
    print_wide(memory_table(plan, summary["memory"]["model_state_bytes"]))
    per_stage = stages_table(plan)
    if per_stage is not None:
        print_wide(per_stage)
    if plan.prediction is None:
        console.print(
            "[yellow]no prediction in this plan[/] (written by hand?): model-state bytes above follow "
            "the plan's formula; run `elixir-tune search` for a predicted timeline",
            soft_wrap=True,
        )
    else:
        print_wide(timeline_table(plan))
        console.print(f"[bold]plausibility bound:[/] {bound_line(plan)}", soft_wrap=True)
        host_adam = _host_adam(plan, profile_path, hardware_ref)
        if host_adam:
            console.print(f"[bold]mostly host Adam:[/] {host_adam}", soft_wrap=True)
    print_wide(placement_table(plan))
    if plan.search is not None:
        console.print(
            f"found by the {plan.search.strategy} search: {plan.search.candidates} candidates in "
            f"{plan.search.elapsed_s:.2f} s, {len(plan.search.alternatives)} alternatives recorded"
        )
        engines = engine_line(plan)
        if engines:
            console.print(f"[bold]engine:[/] {engines}", soft_wrap=True)
