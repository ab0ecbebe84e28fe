"""Which modules and chunks each pipeline rank holds (the setup half of ``pipeline.py``).

``prepare`` walks the model once per rank: the rank's virtual stages (``plan/stages.py``), the
modules they run (``pipeline_adapters.py``), the chunks of its stage plus those it shares with
another stage (tied embeddings), and the modules of other stages, which ``drop_elsewhere`` replaces
by ``Elsewhere`` stubs that raise if called (their tensors never materialize here).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from elixir_tune.engine.comm import is_dtensor
from elixir_tune.engine.parallel.pipeline_adapters import StageAdapter, adapter_for
from elixir_tune.engine.parallel.tensor_parallel import local_data, set_local_data
from elixir_tune.plan import Plan
from elixir_tune.plan.stages import virtual_stages


def pipeline_call_message(stages: int, where: str = "") -> str:
    """What to change when a pipeline plan's model is called as ``model(...)``: each rank holds only its
    stage's blocks, so a step runs through ``forward_backward``."""
    return (
        f"model(...) cannot run under this plan{where}: it splits the model over {stages} pipeline stages "
        "(parallel.pipeline.stages) and this rank holds only its stage's blocks. Replace the step's per-micro-batch "
        "loop (`loss = model(**batch).loss; optimizer.backward(loss / n)` for each batch) by one call per step: "
        "`loss = model.forward_backward(micro_batches)` (micro_batches: this rank's list of dicts with input_ids "
        "and labels; it returns the mean loss), then optimizer.step() and optimizer.zero_grad() as before; "
        "or search a plan without a pipeline (`elixir-tune search` without --loop forward_backward)"
    )


class Elsewhere(nn.Module):
    """Stands in for a module that runs on another pipeline stage."""

    def __init__(self, name: str, stage: int, stages: int):
        super().__init__()
        self.where = f"{name}, pipeline stage {stage}"
        self.stages = stages

    def forward(self, *args, **kwargs):
        raise RuntimeError(pipeline_call_message(self.stages, f" ({self.where} runs on another stage)"))


@dataclasses.dataclass
class StageLayout:
    """What one rank of a pipeline holds, decided before the chunk engine is built.

    Attributes:
        stage: this rank's stage.
        virtual: every virtual stage (stage, blocks) in pipeline order.
        plan: the plan restricted to this rank's chunks (its stage's and the shared ones).
        shared: chunk id -> stages using it, for chunks used by more than one stage.
        elsewhere: module name -> stage, the outermost modules that run on other stages only.
        elsewhere_tensors: ids of their parameters and buffers (the engine leaves them alone).
    """

    stage: int
    virtual: list[tuple[int, list[int]]]
    plan: Plan
    shared: dict[int, tuple[int, ...]]
    elsewhere: dict[str, int]
    elsewhere_tensors: set[int]


def virtual_stage_modules(adapter: StageAdapter, virtual: list[tuple[int, list[int]]], index: int) -> list[nn.Module]:
    """The modules virtual stage ``index`` runs: its blocks, with the embeddings first and the final norm
    and head last."""
    modules = [adapter.blocks[i] for i in virtual[index][1]]
    if index == 0:
        modules += adapter.first_modules
    if index == len(virtual) - 1:
        modules += adapter.last_modules
    return modules


def _users(adapter: StageAdapter, virtual: list[tuple[int, list[int]]]) -> dict[int, set[int]]:
    """id(parameter) -> the stages whose modules use it."""
    users: dict[int, set[int]] = {}
    for index, (stage, _) in enumerate(virtual):
        for module in virtual_stage_modules(adapter, virtual, index):
            for param in module.parameters():
                users.setdefault(id(param), set()).add(stage)
    return users


def prepare(model: nn.Module, plan: Plan, stage: int) -> tuple[StageAdapter, StageLayout]:
    """Decides this rank's chunks and the modules it does not run.

    Raises:
        ValueError: the plan's stages disagree with where the adapter runs the parameters, or a
            chunk used by several stages holds parameters of one only.
    """
    pipeline = plan.parallel.pipeline
    adapter = adapter_for(model, plan.model.block_list)
    num_blocks = len(adapter.blocks)
    virtual = virtual_stages(num_blocks, pipeline.stages, pipeline.assignment)
    users = _users(adapter, virtual)
    named = dict(model.named_parameters())
    problems = []
    mine, shared = [], {}
    for chunk in plan.memory.chunks:
        chunk_users = [users.get(id(named[name]), set()) for name in chunk.params]
        union = set().union(*chunk_users)
        if len(union) > 1:
            if any(u != union for u in chunk_users):
                problems.append(
                    f"memory.chunks[{chunk.id}] holds parameters used on stages {sorted(union)} (tied) together "
                    "with parameters of one stage only; a chunk shared by stages must hold only the shared ones"
                )
            elif chunk.stage not in union:
                problems.append(
                    f"memory.chunks[{chunk.id}].stage: {chunk.stage}, but its parameters run on {sorted(union)}"
                )
            shared[chunk.id] = tuple(sorted(union))
        elif union and union != {chunk.stage}:
            problems.append(
                f"memory.chunks[{chunk.id}].stage: {chunk.stage}, but its parameters ({chunk.params[0]}, ...) run on "
                f"stage {min(union)} with {pipeline.assignment} assignment"
            )
        if stage in union or (not union and chunk.stage == stage):
            mine.append(chunk)
    if problems:
        raise ValueError(
            "the plan's pipeline stages do not match the model: "
            + "; ".join(problems)
            + ". Make the plan again with `elixir-tune search` for this model"
        )
    my_params = {id(named[name]) for chunk in mine for name in chunk.params}
    my_params |= {key for key, stages in users.items() if stage in stages}  # frozen ones too
    elsewhere: dict[str, int] = {}
    elsewhere_tensors: set[int] = set()

    def walk(module: nn.Module, name: str) -> None:
        params = list(module.parameters())
        if name and params and not any(id(p) in my_params for p in params):
            stages = {s for p in params for s in users.get(id(p), ())} or {-1}
            elsewhere[name] = min(stages)
            elsewhere_tensors.update(id(t) for t in list(params) + list(module.buffers()))
            return
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name)

    walk(model, "")
    cacheable = sum(1 for chunk in mine if not chunk.resident)
    memory = dataclasses.replace(
        plan.memory,
        chunks=mine,
        cache_blocks=min(plan.memory.cache_blocks, cacheable),
        prefetch=min(plan.memory.prefetch, max(min(plan.memory.cache_blocks, cacheable) - 1, 0)),
    )
    layout = StageLayout(stage, virtual, dataclasses.replace(plan, memory=memory), shared, elsewhere, elsewhere_tensors)
    return adapter, layout


def drop_elsewhere(model: nn.Module, layout: StageLayout) -> None:
    """Replaces the modules of other stages by ``Elsewhere`` stubs; real tensors they held go to meta
    (the user's optimizer may still reference the parameters: they no longer hold memory)."""
    for name, stage in layout.elsewhere.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = parent._modules[child]
        assert module is not None
        for param in module.parameters():
            if is_dtensor(param):  # a tensor-parallel piece (pipeline x tensor): its local tensor goes to meta
                set_local_data(param, torch.empty_like(local_data(param), device="meta"))
            elif not param.is_meta:
                meta = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), param.requires_grad)
                torch.utils.swap_tensors(param, meta)
        parent._modules[child] = Elsewhere(name, stage, layout.plan.parallel.pipeline.stages)
