"""Modular pipeline parallelism (Lamy-Poirier 2021) on top of the chunk engine.

A plan with ``parallel.pipeline.stages`` P > 1 splits the model's blocks over P stages
(``plan/stages.py``: block i on stage i mod P for ``modular``, runs of consecutive blocks for
``contiguous``). Each maximal run of consecutive blocks on one stage is a *virtual stage* (modular:
every block is one, so a rank holds N/P non-contiguous virtual stages, the "looped" pipeline;
contiguous: one per rank). The embeddings run in virtual stage 0, the final norm, head and loss in
the last one; ``pipeline_adapters.py`` runs them through the model's own forward, cut where its stage
plan says (``elixir_tune/models/stage_plans.py``).

What each rank does:

* **Setup** (``prepare`` then ``Pipeline``): the rank's chunks are the plan's chunks of its stage
  (``chunks[].stage``) plus the chunks of parameters its modules share with another stage (tied
  embeddings: GPT-2's ``wte`` is also its ``lm_head``); the chunk engine shards them over the
  rank's data-parallel group (``mesh.data``), with the plan's cache, offload and prefetch. Modules
  of other stages are never materialized: the engine leaves their tensors alone (on the meta
  device they stay there; real ones are moved to meta) and they are replaced in the module tree by
  ``Elsewhere`` stubs that raise if called.
* **A step** (``forward_backward``): one ``PipelineStage`` of torch's pipelining package per
  virtual stage (static shapes: nothing is traced) and the plan's schedule (``pipeline_schedule.py``:
  ``looped_bfs`` for any split, uneven modular ones included; ``interleaved_1f1b`` for splits that
  give every rank as many virtual stages; ``gpipe`` / ``1f1b`` for one per rank) move activations and their gradients between stages
  over the pipeline group; the engine's hooks gather chunks and reduce gradients inside each
  stage's forward and backward exactly as without a pipeline. The loss of micro-batch k is the
  model's own (or ``loss_fn``'s) divided by the micro-batch count, or times its token weight
  (``engine/token_weights.py``); the step's loss is
  broadcast from the stage running the last virtual stage, so every rank returns it. Gradients are reduced once per step
  (no-sync, ``Engine.hold_grads``): each stays whole in ``param.grad`` from its parameter's first
  micro-batch's backward to its last, which ``held_grad_bytes`` counts for the memory report.
* **With tensor parallelism** (pipeline x tensor x data, ``pipeline_tensor.py``): the model was split
  over the rank's tensor group before ``prepare``; the stage's modules run on their tensor-parallel
  pieces, the chunks hold those pieces, and each tensor rank sends its sequence shard of the hidden
  states to the rank at the same tensor index of the next stage (``StageAdapter.boundary``).
* **With context parallelism** (``context_parallel.py``): the context group is the C ranks of a stage at
  one data index; the first stage slices each sequence, every stage sends this rank's 1/C of the tokens
  on, and the last stage's loss is ``ContextParallel.loss`` (the chunks shard over data x context).
* **Tied parameters**: both stages that use a shared chunk hold it, with the same shard layout;
  after the schedule the step's gradient of each such chunk is summed over the two ranks (a group
  of the stages that share it at the same data and tensor index, as Megatron's embedding group),
  so both copies take the same optimizer step. The gradient norm counts it once (on the stage the
  plan puts it on), in one all-reduce over the world (``ShardedOptimizer.clip_grad_norm``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from elixir_tune.engine.chunks.chunk import ParamSlot
from elixir_tune.engine.comm import Comm, Mesh, gather_objects, pipelining, subgroup
from elixir_tune.engine.engine import Engine
from elixir_tune.engine.hooks import install_grad_hooks
from elixir_tune.engine.io.materialize import WeightSource
from elixir_tune.engine.parallel.context_parallel import ContextParallel
from elixir_tune.engine.parallel.pipeline_adapters import StageAdapter
from elixir_tune.engine.parallel.pipeline_schedule import make_schedule
from elixir_tune.engine.parallel.pipeline_stages import (
    StageLayout,
    drop_elsewhere,
    prepare,
    virtual_stage_modules,
)
from elixir_tune.engine.parallel.pipeline_tensor import StageBoundary
from elixir_tune.engine.parallel.tensor_parallel import TensorSplit, local_data
from elixir_tune.plan import Plan
from elixir_tune.plan.stages import schedule_problem


class VirtualStage(nn.Module):
    """One virtual stage's forward: [embeddings], its blocks, [final norm and head], through the model's own
    forward (``StageAdapter.run``); ``micro_batch`` (the schedule passes it to every stage) picks the
    micro-batch's padding mask and position ids, which every rank of the pipeline has (it was fed the same
    micro-batches)."""

    def __init__(
        self,
        adapter: StageAdapter,
        blocks: list[int],
        first: bool,
        last: bool,
        model_inputs: Callable[[], Sequence[dict[str, torch.Tensor]]],
    ):
        super().__init__()
        self.adapter = adapter  # not a module: the model's modules stay registered in the model only
        self.block_indices = blocks
        self.first, self.last = first, last
        self.model_inputs = model_inputs

    def forward(self, inputs: torch.Tensor, micro_batch: torch.Tensor) -> torch.Tensor:
        extra = self.model_inputs()[int(micro_batch.reshape(-1)[0])]
        return self.adapter.run(inputs, self.block_indices, self.first, self.last, extra)


LossFn = Callable[[Any, dict], torch.Tensor]
# The micro-batch keys every stage passes to the model's forward besides the ids (read from its own copy of
# the micro-batches): the padding mask and the position ids (restarting at each sample of a packed row).
MODEL_INPUTS = ("attention_mask", "position_ids")
MAX_SCHEDULES = 8  # schedules kept, one per (micro-batch count, padded input shape)


class Pipeline:
    """Runs a step's micro-batches through this rank's virtual stages with torch's pipeline schedules.

    Args:
        engine: this rank's chunk engine (its chunks: this stage's and the shared ones).
        adapter: the model's stage adapter.
        layout: what ``prepare`` decided.
        mesh: the process groups.
        full_plan: the whole plan (``layout.plan`` holds this rank's chunks only).
    """

    def __init__(self, engine, adapter: StageAdapter, layout: StageLayout, mesh: Mesh, full_plan: Plan):
        self.engine = engine
        self.adapter = adapter
        self.layout = layout
        self.mesh = mesh
        self.plan = layout.plan
        self.full_plan = full_plan
        self.stage = layout.stage
        self.stages = self.plan.parallel.pipeline.stages
        self.schedule_name = self.plan.parallel.pipeline.schedule
        self.mine = [i for i, (stage, _) in enumerate(layout.virtual) if stage == self.stage]
        self._schedules: dict[tuple, Any] = {}
        self._batches: Sequence[dict] = ()
        # The step's model inputs besides the ids, one dict per micro-batch: its padding mask, its position ids.
        self._model_inputs: list[dict[str, torch.Tensor]] = []
        self._loss_fn: LossFn | None = None
        self._scales: list[Any] = []  # each micro-batch loss's factor in this step
        # Shared (tied) chunks: one group per set of stages sharing chunks, at this data/tensor index.
        self.shared: list[tuple[Any, Comm]] = []
        by_id = {chunk.id: chunk for chunk in engine.chunks}
        for users in sorted(set(layout.shared.values())):
            comm = self._stage_group(users)
            for chunk_id, chunk_users in layout.shared.items():
                if chunk_users == users and comm is not None:
                    self.shared.append((by_id[chunk_id], comm))
        # No-sync leaves each gradient in param.grad until its last micro-batch: the chunked parameters of
        # each of this rank's virtual stages, and what the step has held at most (measured by a hook that
        # runs after the engine's, which stages a gradient and clears param.grad on its last pass).
        self._held_slots = [self._chunked_params(index) for index in self.mine]
        self._held: dict[int, int] = {}  # id(param) -> bytes of its held gradient
        self._held_now = 0
        self.peak_held_grad_bytes = 0
        trained = [slot.param for slot in engine.slots if not slot.chunk.frozen]  # a LoRA base gets no gradient
        self._handles = install_grad_hooks(trained, self._track_held)
        owner = {chunk.id: chunk.stage for chunk in self.plan.memory.chunks}
        # The norm counts a shared chunk once: on the stage the plan puts it on.
        engine.norm_skip = {chunk.id for chunk, _ in self.shared if owner[chunk.id] != self.stage}
        if self.shared:
            # The copies start equal whatever each stage's data-rank 0 was built with (the first stage's win).
            for chunk, comm in self.shared:
                master = chunk.master.to(comm.device)
                comm.broadcast(master, src=0)
                chunk.set_master(master.to(chunk.master.device))
            engine.after_step()  # resident payloads gathered again from the agreed masters

    def _stage_group(self, users: tuple[int, ...]) -> Comm | None:
        """The group of the ranks at these stages with this rank's data and tensor index (a collective
        over the world: every rank creates every such group)."""
        world = self.mesh.world
        stages = self.stages
        tensor = self.mesh.tensor.world_size
        context = self.full_plan.parallel.context.degree  # rank = ((data * P + stage) * C + context) * T + tensor
        lists = []
        for index in range(world.world_size // (stages * context * tensor)):
            for c in range(context):
                for t in range(tensor):
                    lists.append([((index * stages + s) * context + c) * tensor + t for s in users])
        return subgroup(world, lists)

    # --- gradients held through a step (no-sync) ----------------------------------------------

    def held_grad_bytes(self, micro_batches: int | None = None) -> int:
        """Bytes of gradients a step holds unsharded at its peak: no-sync keeps each parameter's gradient
        in ``param.grad`` (compute dtype, whole) from its first micro-batch's backward to its last.

        ``looped_bfs`` runs this rank's virtual stages' backwards one after the other, all micro-batches
        of each (torch's ``ScheduleLoopedBFS``), ``gpipe`` and ``1f1b`` have one virtual stage per rank:
        the largest virtual stage's gradients. ``interleaved_1f1b`` runs rounds of micro-batches
        (``max(1, N // P)`` of them) through every virtual stage in turn: with two or more, every
        virtual stage's gradients are held at once, from the first round to the last.

        Args:
            micro_batches: per step (default: the plan's ``grad_accum_steps``); with one, nothing is held.

        Returns:
            Bytes (``memory_stats()["peak_held_grad_bytes"]`` is what steps have held).
        """
        count = self.full_plan.training.grad_accum_steps if micro_batches is None else micro_batches
        if count <= 1:
            return 0
        item = self.engine.compute_dtype.itemsize
        if self.schedule_name == "interleaved_1f1b" and count // self.stages > 1:
            every = {id(slot): numel for slots in self._held_slots for slot, numel in slots}
            return sum(every.values()) * item
        return max((sum(numel for _, numel in slots) * item for slots in self._held_slots), default=0)

    def _chunked_params(self, index: int) -> list[tuple[ParamSlot, int]]:
        """The chunk slots of the trained parameters virtual stage ``index`` runs, each once, with the
        elements of the gradient the step holds for it: the slot's, except that torch's vocabulary-parallel
        embedding (tensor 1d, ``RowwiseParallel`` on an ``nn.Embedding``) computes the whole table's
        gradient on every tensor rank (a replicated DTensor, sliced to this rank's rows when staged)."""
        tensor = self.engine.tensor_parallel
        whole = set()
        if index == 0 and tensor is not None and tensor.mode == "1d":
            whole = {id(m.weight) for m in self.adapter.first_modules if isinstance(m, nn.Embedding)}
        slots: dict[int, tuple[ParamSlot, int]] = {}
        for module in virtual_stage_modules(self.adapter, self.layout.virtual, index):
            for param in module.parameters():
                slot = self.engine.slot_of.get(id(param))
                if slot is not None and not slot.chunk.frozen:
                    slots[id(param)] = (slot, param.numel() if id(param) in whole else slot.numel)
        return list(slots.values())

    def _track_held(self, param: nn.Parameter) -> None:
        """After the engine's gradient hook: the gradient no-sync left in ``param.grad``, if any."""
        grad = param.grad
        # This rank's bytes: a tensor-split parameter's gradient is a DTensor, whose nbytes is the whole tensor's.
        nbytes = 0 if grad is None else local_data(grad).nbytes
        self._held_now += nbytes - self._held.pop(id(param), 0)
        if nbytes:
            self._held[id(param)] = nbytes
        self.peak_held_grad_bytes = max(self.peak_held_grad_bytes, self._held_now)

    # --- a step --------------------------------------------------------------------------------

    def _schedule(self, count: int, input_shape: tuple[int, ...]):
        key = (count, input_shape)
        if key in self._schedules:
            return self._schedules[key]
        if len(self._schedules) >= MAX_SCHEDULES:  # steps of many lengths: drop the oldest shape's
            del self._schedules[next(iter(self._schedules))]
        torch_pipelining = pipelining()
        engine = self.engine
        device = engine.device
        batch, seq = input_shape
        # Activations and logits need gradients: a stage's received input must be a leaf that
        # collects its gradient, to be sent back to the stage before.
        # A tensor-parallel piece (pipeline_tensor.py): a sequence shard in 1d, samples x columns in 2d.
        # Context parallelism (pipeline x context): stages exchange this rank's 1/C of the tokens.
        local = seq // self.adapter.context.comm.world_size if self.adapter.context is not None else seq
        sent = self.adapter.boundary.sent_shape(batch, local, self.adapter.hidden_size)
        hidden = torch.empty(*sent, dtype=engine.compute_dtype, device="meta")
        hidden.requires_grad_(True)
        logits = torch.empty(batch, local, self.adapter.vocab_size, dtype=engine.compute_dtype, device="meta")
        logits.requires_grad_(True)
        ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
        virtual = self.layout.virtual
        last = len(virtual) - 1
        stages = []
        for index in self.mine:
            module = VirtualStage(
                self.adapter, virtual[index][1], index == 0, index == last, lambda: self._model_inputs
            )
            stages.append(
                torch_pipelining.PipelineStage(
                    module,
                    index,
                    len(virtual),
                    device,
                    input_args=ids if index == 0 else hidden,
                    output_args=logits if index == last else hidden,
                    group=self.mesh.pipeline.group,
                )
            )
        pipeline = self.plan.parallel.pipeline
        problem = schedule_problem(
            len(self.adapter.blocks), self.stages, pipeline.assignment, self.schedule_name, count
        )
        if problem:
            raise ValueError(f"parallel.pipeline.schedule: {problem} (this step has {count} micro-batches)")
        schedule = make_schedule(self.schedule_name, stages, count, self._stage_loss)
        self._schedules[key] = schedule
        return schedule

    def _stage_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: ``target`` is the micro-batch's index, the loss the model's (or loss_fn's) on
        the micro-batch's own length (a shorter one was padded at the end to the step's longest)."""
        batch = self._batches[int(target.reshape(-1)[0])]
        if self.adapter.context is not None:
            return self._context_loss(logits, batch) * self._scales[int(target.reshape(-1)[0])]
        length = batch["input_ids"].shape[1]
        if length < logits.shape[1]:  # the loss views the logits flat
            logits = logits[:, :length].contiguous()
        labels = batch.get("labels")
        output = SimpleNamespace(
            logits=logits, loss=self.adapter.loss(logits, labels.to(logits.device)) if labels is not None else None
        )
        if self._loss_fn is not None:
            loss = self._loss_fn(output, batch)
        elif output.loss is None:
            raise AttributeError(
                "the micro-batch has no labels: pass labels or forward_backward(..., loss_fn=lambda output, batch: ...)"
            )
        else:
            loss = output.loss
        return loss * self._scales[int(target.reshape(-1)[0])]

    def _context_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """The loss of this rank's tokens under context parallelism (``ContextParallel.loss``): the labels
        padded as the ids were, to the step's longest micro-batch (the logits cover this rank's share of it)."""
        context = self.adapter.context
        assert context is not None
        labels = batch.get("labels")
        if labels is None:
            raise AttributeError(
                "the micro-batch has no labels: a context-parallel pipeline computes the loss from them"
            )
        pad = logits.shape[1] * context.comm.world_size - labels.shape[1]
        labels = torch.nn.functional.pad(labels.to(logits.device), (0, pad), value=-100) if pad else labels
        return context.loss(logits, labels.to(logits.device))

    def _step_inputs(
        self, micro_batches: Sequence[dict], loss_fn: LossFn | None
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """The step's ``input_ids`` (micro-batches one after the other, each padded at the end to the longest)
        and each micro-batch's other model inputs: its padding mask and its position ids, where it has them.

        A micro-batch's position ids (packed rows: ``elixir_tune/data/packing.py``) go to the model's forward on
        every stage, which builds the rotary or learned positions and, when there is no padding mask, the
        block-diagonal mask of the packed samples from them. Padding a micro-batch with position ids and no
        mask gives the padded tail positions restarting at 0, a sequence of its own that no real token sees
        (adding a mask instead would turn transformers' packed-sequence mask off)."""
        shapes = [tuple(batch["input_ids"].shape) if "input_ids" in batch else None for batch in micro_batches]
        if None in shapes or any(len(shape) != 2 for shape in shapes if shape) or len({s[0] for s in shapes if s}) != 1:
            raise ValueError(
                "a pipeline plan's micro-batches each need input_ids of shape (batch, length), the same batch size "
                f"in all (the stages exchange activations of one shape); got shapes {[str(s) for s in shapes]}"
            )
        if loss_fn is not None and self.adapter.context is not None:
            raise ValueError(
                "forward_backward(..., loss_fn=...) under context parallelism: each rank holds the logits of its "
                "share of the sequence only; drop loss_fn (the micro-batches' labels give the loss)"
            )
        carried = ("input_ids", "labels", *MODEL_INPUTS)
        extra = sorted({key for batch in micro_batches for key in batch} - set(carried))
        if extra and loss_fn is None:
            raise ValueError(
                f"a pipeline plan feeds input_ids, attention_mask and position_ids to the model; the micro-batches "
                f"also have {extra}: drop them, or read them in forward_backward(..., loss_fn=...)"
            )
        if self.adapter.boundary.grid and any(batch.get("position_ids") is not None for batch in micro_batches):
            raise ValueError(
                "position_ids with 2d tensor parallelism: each grid row runs its own samples, but the positions "
                "would reach the attention for every sample; drop position_ids (and packed rows), or search "
                "for a 1d tensor plan"
            )
        for index, batch in enumerate(micro_batches):
            for key in MODEL_INPUTS:
                value = batch.get(key)
                if value is not None and tuple(value.shape) != tuple(batch["input_ids"].shape):
                    raise ValueError(
                        f"micro-batch {index}: {key} has shape {tuple(value.shape)}, input_ids "
                        f"{tuple(batch['input_ids'].shape)}; a pipeline plan takes one {key} entry per token"
                    )
        longest = self.adapter.boundary.padded_length(max(shape[1] for shape in shapes if shape))
        padded = any(shape[1] != longest for shape in shapes if shape)
        device = self.engine.device
        ids, model_inputs = [], []
        for batch in micro_batches:
            batch_ids = batch["input_ids"].to(device)
            mask, positions = batch.get("attention_mask"), batch.get("position_ids")
            if mask is None and positions is None and padded:
                mask = torch.ones_like(batch_ids)
            pad = longest - batch_ids.shape[1]
            ids.append(torch.nn.functional.pad(batch_ids, (0, pad)) if pad else batch_ids)
            inputs: dict[str, torch.Tensor] = {}
            if mask is not None:
                # The padded tail is masked: no real token attends to it, and its logits are cut off before the loss.
                inputs["attention_mask"] = torch.nn.functional.pad(mask.to(device), (0, pad))
            if positions is not None:
                tail = torch.arange(pad, dtype=positions.dtype, device=device).expand(positions.shape[0], pad)
                inputs["position_ids"] = torch.cat([positions.to(device), tail], dim=1)
            model_inputs.append(inputs)
        return torch.cat(ids), model_inputs

    def forward_backward(
        self, micro_batches: Sequence[dict], loss_fn: LossFn | None, weights: list[float] | None = None
    ) -> torch.Tensor:
        """All micro-batches of a step through the pipeline; the step's loss on every rank (``weights``:
        each micro-batch's token weight, engine/token_weights.py; None: the mean of the micro-batch losses)."""
        ids, model_inputs = self._step_inputs(micro_batches, loss_fn)
        engine = self.engine
        count = len(micro_batches)
        schedule = self._schedule(count, (ids.shape[0] // count, ids.shape[1]))
        self._batches, self._loss_fn, self._model_inputs = micro_batches, loss_fn, model_inputs
        loss_scale = engine.loss_scale()
        self._scales = [loss_scale / count] * count if weights is None else [loss_scale * w for w in weights]
        before = [chunk.grad.clone() for chunk, _ in self.shared]
        engine.begin_forward()
        losses: list[torch.Tensor] = []
        args: tuple[torch.Tensor, ...] = (ids,) if 0 in self.mine else ()
        # Every stage gets the micro-batch's index (to find its padding mask); the schedule splits it.
        index = torch.arange(count, device=engine.device)
        training = torch.is_grad_enabled()
        # No-sync: every parameter's gradient is reduced over the data group once per step (after its
        # last micro-batch's backward), not after each of the schedule's backward passes.
        engine.hold_grads(count if training else 1)
        try:
            if training:
                schedule.step(*args, target=torch.arange(count), losses=losses, return_outputs=False, micro_batch=index)
            else:  # evaluation: forwards only, the same losses
                schedule.eval(*args, target=torch.arange(count), losses=losses, micro_batch=index)
        except BaseException:
            engine.end_held_grads(flush=False)
            raise
        finally:
            self._batches, self._loss_fn, self._model_inputs = (), None, []
            self._held.clear()  # the engine stages (or drops) what is left, without hooks
            self._held_now = 0
        engine.end_held_grads()
        if training:
            self._sum_shared(before)
        total = torch.zeros((), dtype=torch.float32, device=engine.device)
        for loss in losses if training else ():  # on the stage with the last block
            engine.note_loss(loss)
        if losses:
            summed = torch.stack([loss.detach().float() for loss in losses]).sum()
            total = (summed / (self._scales[0] * count) if weights is None else summed / loss_scale).reshape(())
        # From the stage that runs the last virtual stage (the last block's: stage P - 1 unless a modular
        # split is uneven, e.g. 3 blocks on 2 stages end on stage 0).
        self.mesh.pipeline.broadcast(total, src=self.layout.virtual[-1][0])
        return total

    def _sum_shared(self, before: list[torch.Tensor]) -> None:
        """Adds this step's gradient of each shared chunk from the other stages using it."""
        if not self.shared:
            return
        self.engine.drain_grads()
        for (chunk, comm), old in zip(self.shared, before, strict=True):
            step = chunk.grad - old
            on_device = step.to(comm.device)
            comm.all_reduce_sum(on_device)
            chunk.grad.copy_(old + on_device.to(chunk.grad.device))

    # --- weights out ---------------------------------------------------------------------------

    def full_state_dict(self, all_ranks: bool = False, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights: each stage's (gathered over its data group) merged over the pipeline
        group onto global rank 0 (every rank with ``all_ranks``). A collective. ``trainable_only``: the
        trained parameters alone (a LoRA model's adapters)."""
        part = self.engine.full_state_dict(all_ranks=all_ranks, trainable_only=trainable_only)
        if not all_ranks and self.mesh.data.rank != 0:
            return {}
        parts = gather_objects(self.mesh.pipeline, part, all_ranks)
        if parts is None:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for piece in parts:
            merged.update(piece)
        return merged


def build_engine(
    model: nn.Module,
    plan: Plan,
    mesh: Mesh,
    source: WeightSource | None,
    tensor_parallel: TensorSplit | None = None,
    context: ContextParallel | None = None,
) -> Engine:
    """This rank's chunk engine for a pipeline plan, with its ``Pipeline`` attached (``engine.pipeline``).

    Args:
        model: the user's model (already split over the tensor group when ``tensor_parallel``).
        plan: the whole plan.
        mesh: the process groups.
        source: where the first weights come from (None: the model's own).
        tensor_parallel: the model's tensor split (pipeline x tensor, ``pipeline_tensor.py``), or None.
        context: the model's context-parallel hooks (pipeline x context), or None.

    Raises:
        ValueError: no stage plan for the model, or the plan's stages do not match it.
    """
    adapter, layout = prepare(model, plan, mesh.stage)
    adapter.boundary = StageBoundary(tensor_parallel)
    adapter.context = context
    engine = Engine(
        model, layout.plan, mesh.data, source, mesh, elsewhere=layout.elsewhere_tensors, tensor_parallel=tensor_parallel
    )
    drop_elsewhere(model, layout)
    engine.pipeline = Pipeline(engine, adapter, layout, mesh, plan)
    return engine
