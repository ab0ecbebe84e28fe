"""The plan shapes scripts/bench_prediction.py trains: the search's best for 2 CPU worker processes and
its variants (cache, offload, checkpointing, micro-batch), or one plan per parallel layout."""

from __future__ import annotations

WORLD = 2
GLOBAL_BATCH = 16


def shape_of(plan) -> dict:
    """The choices of a plan, flat."""
    chunks = plan.memory.chunks
    return {
        "chunk_size": plan.memory.chunk_size,
        "num_chunks": len(chunks),
        "cacheable_chunks": sum(not c.resident for c in chunks),
        "cache_blocks": plan.memory.cache_blocks,
        "prefetch": plan.memory.prefetch,
        "offloaded_chunks": sum(c.offload for c in chunks),
        "offload": round(sum(c.offload for c in chunks) / len(chunks), 3),
        "checkpointing": plan.training.activation_checkpointing.every,
        "micro_batch_size": plan.training.micro_batch_size,
        "grad_accum_steps": plan.training.grad_accum_steps,
        "pipeline": plan.parallel.pipeline.stages,
        "tensor": plan.parallel.tensor.degree,
    }


def layout_shapes(profile, hardware):
    """(name, pins, SearchResult) of the search's best plan for each parallel layout the world allows:
    data parallelism only, pipeline 2 and tensor 2 (the rest left to the search)."""
    from elixir_tune.search import search

    shapes = []
    for name, pins in (
        ("data-only", {"pipeline": 1, "tensor": 1, "context": 1}),
        ("pipeline-2", {"pipeline": 2}),
        ("tensor-2", {"tensor": 2}),
    ):
        shapes.append(
            (
                name,
                pins,
                search(profile, hardware, WORLD, global_batch_size=GLOBAL_BATCH, fixed=pins, loop="forward_backward"),
            )
        )
    return shapes


def make_shapes(profile, hardware, say):
    """(name, pins, SearchResult) for every shape; shapes identical to an earlier one are dropped (and
    said so through ``say``)."""
    from elixir_tune.search import search

    # The chunk engine's data-parallel path: no pipeline or tensor layout.
    data_only = {"pipeline": 1, "tensor": 1, "context": 1}
    best = search(profile, hardware, WORLD, global_batch_size=GLOBAL_BATCH, fixed=data_only, loop="forward_backward")
    b = shape_of(best.plan)
    base = {
        **data_only,
        "chunk_size": b["chunk_size"],
        "micro_batch_size": b["micro_batch_size"],
        "checkpointing": b["checkpointing"],
        "cache_blocks": b["cache_blocks"],
        "prefetch": b["prefetch"],
        "offload": b["offload"],
    }
    min_cache = best.model.min_cache_blocks(b["chunk_size"], b["checkpointing"])
    variants = [
        ("cache-all", {"cache_blocks": "all"}),
        ("cache-min", {"cache_blocks": min_cache, "prefetch": 0}),
        ("offload-0.5", {"offload": 0.5}),
        ("offload-1", {"offload": 1.0}),
        ("ckpt-all", {"checkpointing": "all"}),
        ("mb2x4", {"micro_batch_size": 2}),
    ]
    shapes = [("search-best", {}, best)]
    seen = [shape_of(best.plan)]
    for name, change in variants:
        pins = {**base, **change}
        try:
            result = search(
                profile, hardware, WORLD, global_batch_size=GLOBAL_BATCH, fixed=pins, loop="forward_backward"
            )
        except ValueError:
            # The best's cache or prefetch may not suit the changed choice: pin only chunk size and the change.
            pins = {"chunk_size": base["chunk_size"], **data_only, **change}
            result = search(
                profile, hardware, WORLD, global_batch_size=GLOBAL_BATCH, fixed=pins, loop="forward_backward"
            )
        if shape_of(result.plan) in seen:
            say(f"{name}: same plan shape as an earlier one, skipped")
            continue
        seen.append(shape_of(result.plan))
        shapes.append((name, pins, result))
    return shapes
