"""The engine: chunks, cache and hooks put together for one model on one rank.

Life of a micro-batch:
    forward   module pre-hooks fetch the module's chunks through the cache (all-gather), post-hooks
              mark them idle and hook the module's outputs for backward;
    backward  output hooks fetch the chunks again (they may have been evicted; checkpointed blocks
              recompute through the forward hooks); each parameter's post-accumulate-grad hook
              copies its gradient into the chunk's staging buffer (a bounded pool, see
              staging.py), and a chunk whose gradients are all staged starts its reduce-scatter
              (asynchronous) into the fp32 shard gradient; an offloaded chunk's reduced shard
              drains to the host gradient meanwhile;
    end       a callback queued on the autograd engine reduces the chunks left incomplete
              (parameters unused in this step count as zero), in chunk order, and finishes the
              device-side reductions; host-side ones keep draining until the optimizer (or the
              next backward's need for a staging buffer) waits for them. Gradients accumulate in
              the shard until the optimizer step or zero_grad.

This file builds the engine (chunks and their shards, the cache, the hooks) and its parts, each given
what it reads: ``module_map`` (module_map.py: which module reads which chunks), ``passes`` (passes.py:
what the hooks do in a micro-batch's forward and backward), ``grads`` (grad_path.py: staging,
reductions, no-sync) and ``state`` (state.py: full state dicts and the memory accounting). Methods
other modules call on the engine forward to the parts.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from elixir_tune.device import ops_for
from elixir_tune.engine.chunks.cache import ChunkCache
from elixir_tune.engine.chunks.chunk import Chunk, ParamSlot
from elixir_tune.engine.comm import Comm, Mesh
from elixir_tune.engine.grad_path import GradPath
from elixir_tune.engine.hooks import install_grad_hooks, install_module_hooks, wrap_checkpointed
from elixir_tune.engine.io.materialize import (
    MaterializeError,
    WeightSource,
    materialize_replicated,
    swap_meta_for_placeholders,
)
from elixir_tune.engine.io.weights import WeightsError
from elixir_tune.engine.layered import Baton
from elixir_tune.engine.module_map import ModuleMap
from elixir_tune.engine.ownership import WriteWatch, check_no_new_params, registrations
from elixir_tune.engine.parallel.expert_parallel import ExpertSplit
from elixir_tune.engine.parallel.tensor_parallel import TensorSplit, local_data, set_local_data
from elixir_tune.engine.passes import ModulePasses
from elixir_tune.engine.state import EngineState
from elixir_tune.engine.uneven import ForwardAgreement
from elixir_tune.models.kv_cache import disable_kv_cache
from elixir_tune.plan import Plan

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Engine:
    """Runs ``model`` with its trainable parameters in chunks as ``plan`` says.

    Args:
        model: the user's module (its parameters' data is replaced by views of chunk payloads).
        plan: a valid plan for this model and world size.
        comm: the data-parallel group.
        source: where the first weights come from (a checkpoint, the model's initializer for a model
            on the meta device); None: the model's own weights, rank 0's.
        mesh: every process group of the run (default: the data group alone).
        elsewhere: ids of tensors of modules that run on other pipeline stages: left as they are
            (never materialized, moved or broadcast; engine/parallel/pipeline.py).
        tensor_parallel: the model's tensor-parallel split (``apply_tensor_parallel``), whose
            parameters' local pieces the chunks hold; None without tensor parallelism.
        experts: the model's experts split over expert groups (``split_experts``): the chunks of
            its expert tensors are sharded over the expert-data group; None without expert parallelism.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        plan: Plan,
        comm: Comm,
        source: WeightSource | None = None,
        mesh: Mesh | None = None,
        elsewhere: set[int] | None = None,
        tensor_parallel: TensorSplit | None = None,
        experts: ExpertSplit | None = None,
    ):
        self.model = model
        self.experts = experts
        # The model's split over mesh.tensor (engine/parallel/tensor_parallel.py).
        self.tensor_parallel = tensor_parallel
        self.plan = plan
        self.comm = comm
        self.mesh = mesh if mesh is not None else Mesh.data_only(comm)
        self.elsewhere = elsewhere or set()
        # engine/parallel/pipeline.py's Pipeline on a pipeline plan (it drives forward_backward).
        self.pipeline: Any = None
        self.norm_skip: set[int] = set()  # chunk ids the gradient norm leaves out (a shared chunk counted elsewhere)
        self.device = comm.device
        self.ops = ops_for(self.device)  # streams, events, pinned memory (elixir_tune/device.py)
        self.compute_dtype = COMPUTE_DTYPES[plan.training.dtype]
        self._nan = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=self.device)

        named = dict(model.named_parameters())
        self.pinned = self.ops.pinned
        self.chunks, self.upload_block = self._build_chunks(named)
        self.slot_of: dict[int, ParamSlot] = {id(slot.param): slot for chunk in self.chunks for slot in chunk.slots}
        self.slots: list[ParamSlot] = [slot for chunk in self.chunks for slot in chunk.slots]
        unaligned = [chunk.id for chunk in self.chunks if not chunk.aligned]
        if unaligned:
            warnings.warn(
                f"chunks {unaligned[:5]} of this plan were packed without alignment padding (an older "
                "elixir-tune): they run, with parameters not 16-byte aligned; run `elixir-tune search` again",
                stacklevel=2,
            )
        self._init_shards(source)
        self._place_replicated()

        side_stream = self.ops.new_stream() if self.ops.streams and plan.memory.prefetch else None
        self.cache = ChunkCache(
            self.chunks, plan.memory.cache_blocks, plan.memory.prefetch, self.placeholder, side_stream
        )
        self.module_map = ModuleMap(model, plan, self.slot_of, named)
        self.optimizer: Any = None  # the ShardedOptimizer, attached by it (model.zero_grad clears through it)
        self.trainable_params = [slot.param for slot in self.slots if not slot.chunk.frozen]
        self._scaling = False  # inside scaled_backward()
        self.unscaled_backward = False  # an fp16 backward ran without the loss scale (refused at the step)
        self.module_map.check_cache_fits(plan.memory.cache_blocks)
        # On a CPU device the reduced shard is added straight into the host gradient: device and host
        # are one memory, a landing copy would only hold the same bytes twice. Frozen chunks have no
        # gradients to land.
        trainable_offloaded = any(chunk.offload and not chunk.frozen for chunk in self.chunks)
        self.grads = GradPath(
            plan=plan,
            comm=comm,
            compute_dtype=self.compute_dtype,
            device=self.device,
            ops=self.ops,
            chunks=self.chunks,
            slots=self.slots,
            slot_of=self.slot_of,
            landing=trainable_offloaded and self.device.type != "cpu",
        )
        checkpointed_block: dict[torch.nn.Module, torch.nn.Module] = {}  # module -> its checkpointed block
        self.passes = ModulePasses(
            cache=self.cache,
            chunks=self.chunks,
            slots=self.slots,
            module_map=self.module_map,
            checkpointed_block=checkpointed_block,
            nan=self._nan,
            grads=self.grads,
            check_scaled=self._check_scaled,
        )
        self.state = EngineState(
            model=model,
            plan=plan,
            comm=comm,
            device=self.device,
            chunks=self.chunks,
            slot_of=self.slot_of,
            cache=self.cache,
            grads=self.grads,
            upload_block=self.upload_block,
            pinned=self.pinned,
            tensor_parallel=tensor_parallel,
            experts=experts,
            after_step=self.after_step,
            pipeline=lambda: self.pipeline,
        )
        passes = self.passes
        self._handles = install_module_hooks(
            self.module_map.names, passes.pre_forward, passes.post_forward, passes.pre_backward
        )
        self.known_param_ids: set[int] | None = None  # the model's parameters at the end of setup
        self.registrations_seen = -1  # ownership.registrations() when they were last checked
        self.write_watch: WriteWatch | None = None  # in-place writes to parameters after setup (ownership.py)
        # First of the root's hooks: a forward around the wrapper begins before any chunk is fetched.
        self._handles.append(model.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        # Frozen chunks' parameters get no gradient: nothing to stage or reduce for them.
        self._handles += install_grad_hooks([s.param for s in self.slots if not s.chunk.frozen], passes.on_grad)
        self._apply_checkpointing(checkpointed_block)
        self.scaler: Any = None  # the optimizer's fp16 loss scaler, attached by ShardedOptimizer
        # The optimizer's non-finite check (engine/finite.py; None for fp16) and its count of a step's
        # non-finite losses, attached by ShardedOptimizer.
        self.finite_guard: Any = None
        self.note_loss: Any = lambda loss: None
        for chunk in self.chunks:
            if chunk.resident:
                chunk.gather(async_op=False)
                chunk.bind()
            else:
                chunk.unbind(self.placeholder(chunk))

    # --- setup ---------------------------------------------------------------------------------

    def placeholder(self, chunk: Chunk) -> torch.Tensor:
        return self._nan

    def _build_chunks(self, named: dict[str, torch.nn.Parameter]) -> tuple[list[Chunk], torch.Tensor]:
        """The plan's chunks over the model's parameters, and the host block of the offloaded shards'
        upload copies."""
        plan = self.plan
        chunks: list[Chunk] = []
        groups = {cp.id: self._chunk_group(cp.id, [named[name] for name in cp.params]) for cp in plan.memory.chunks}
        # A shard is the chunk over its group: the data group, or an expert chunk's expert-data group.
        shard_numel = {cid: plan.memory.chunk_size // group.world_size for cid, (group, _) in groups.items()}
        offloaded = [chunk_plan.id for chunk_plan in plan.memory.chunks if chunk_plan.offload]
        # One host block for the upload copies of all offloaded shards: pinned blocks are rounded
        # up to a power of two by the CUDA host allocator, so one block wastes the least.
        upload_block = self.ops.host_empty(
            sum(shard_numel[cid] for cid in offloaded), self.compute_dtype, pin=bool(offloaded)
        )
        upload_of, begin = {}, 0
        for cid in offloaded:
            upload_of[cid] = upload_block[begin : begin + shard_numel[cid]]
            begin += shard_numel[cid]
        for chunk_plan in plan.memory.chunks:
            chunk_comm, grad_divisor = groups[chunk_plan.id]
            chunk = Chunk(
                chunk_plan.id,
                [(name, named[name]) for name in chunk_plan.params],
                plan.memory.chunk_size,
                chunk_comm,
                self.compute_dtype,
                self.device,
                chunk_plan.resident,
                chunk_plan.offload,
                upload_of.get(chunk_plan.id),
                frozen=chunk_plan.frozen,
                grad_divisor=grad_divisor,
                ops=self.ops,
            )
            chunks.append(chunk)
        return chunks, upload_block

    def _chunk_group(self, chunk_id: int, params: list[torch.nn.Parameter]) -> tuple[Comm, int | None]:
        """The group a chunk is sharded over and what its gradients are divided by: the data group
        (the mean over it), or for a chunk of experts the expert-data group (the data ranks holding the
        same experts) divided by the whole data size."""
        if self.experts is None:
            return self.comm, None
        is_expert = [id(param) in self.experts.param_ids for param in params]
        if not any(is_expert):
            return self.comm, None
        if not all(is_expert):
            raise ValueError(
                f"chunk {chunk_id} holds expert tensors beside other parameters; under expert parallelism the "
                "experts need chunks of their own: run `elixir-tune search` again"
            )
        return self.experts.replicas, self.experts.data_size

    def _init_shards(self, source: WeightSource | None) -> None:
        """Master shards from ``source`` chunk by chunk (this rank's part only), or from the model's
        weights (rank 0's win, as in DDP); then the tensors outside the chunks."""
        if source is None:
            for chunk in self.chunks:
                flat = chunk.flat_from_params()
                chunk.comm.broadcast(flat, src=0)  # an expert chunk: over the ranks holding the same experts
                chunk.init_master(flat)
            return
        failed: Exception | None = None
        for chunk in self.chunks:
            try:
                chunk.init_master(source.shard(chunk))
            except (MaterializeError, WeightsError) as error:
                failed = error
                break
        # Ranks read different parts: all must stop together, not wait in a later collective.
        if self.comm.any_rank(failed is not None):
            raise failed or MaterializeError("another rank could not produce its shards (its error says why)")
        materialize_replicated(self.model, set(self.slot_of) | self.elsewhere, source)
        swap_meta_for_placeholders([slot.param for slot in self.slots], self._nan)

    def _place_replicated(self) -> None:
        """Frozen parameters and buffers: ordinary replicated tensors on the device."""
        for param in self.model.parameters():
            if id(param) in self.slot_of or id(param) in self.elsewhere:
                continue
            data = local_data(param).to(self.device)
            if data.is_floating_point() and self.compute_dtype != torch.float32:
                data = data.to(self.compute_dtype)
            data = data.contiguous()
            self.comm.broadcast(data, src=0)
            set_local_data(param, data)
        for module in self.model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer is not None and buffer.device != self.device and id(buffer) not in self.elsewhere:
                    module._buffers[name] = buffer.to(self.device)

    def _apply_checkpointing(self, checkpointed_block: dict[torch.nn.Module, torch.nn.Module]) -> None:
        """Wraps the blocks the plan checkpoints; fills ``checkpointed_block`` (module -> its block)."""
        checkpointing = self.plan.training.activation_checkpointing
        if checkpointing.every <= 0:
            return
        if not self.plan.model.block_list:
            raise ValueError("training.activation_checkpointing is set but model.block_list names no blocks")
        disable_kv_cache(self.model)
        for index, block in enumerate(self.blocks()):
            if checkpointing.applies_to(index):
                wrap_checkpointed(block, selective=checkpointing.mode == "selective")
                self._handles.append(block.register_forward_pre_hook(lambda *_: self.passes.layer_boundary()))
                for module in block.modules():
                    checkpointed_block[module] = block

    def blocks(self) -> torch.nn.ModuleList | torch.nn.Sequential:
        """The plan's repeated blocks (``model.block_list``).

        Raises:
            ValueError: the plan names no block list.
        """
        if not self.plan.model.block_list:
            raise ValueError(
                "the plan's model.block_list names no blocks (activation checkpointing applies to its items)"
            )
        blocks = self.model.get_submodule(self.plan.model.block_list)
        if isinstance(blocks, torch.nn.ModuleDict):  # torchtitan's layers: keys "0".."n-1" (profiler/blocks.py)
            return torch.nn.ModuleList(blocks.values())
        if not isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise ValueError(
                f"model.block_list {self.plan.model.block_list!r} is a {type(blocks).__name__}, not a ModuleList"
            )
        return blocks

    def loss_context(self):
        """The context a forward and its backward run in: ``loss_parallel()`` when tensor parallelism
        keeps the logits split by vocabulary, else a no-op."""
        return self.tensor_parallel.loss_context() if self.tensor_parallel is not None else contextlib.nullcontext()

    def set_baton(self, baton: Baton | None) -> None:
        """Makes the hooks see a layered step's baton (None when it is done; engine/layered.py)."""
        self.passes.baton = baton

    @contextlib.contextmanager
    def scaled_backward(self):
        """The context of a backward whose loss carries the fp16 loss scale (``optimizer.backward``,
        ``forward_backward``); a backward outside it on an fp16 plan is refused at the step."""
        self._scaling = True
        try:
            yield
        finally:
            self._scaling = False

    def _check_scaled(self) -> None:
        """End of each backward (``ModulePasses.end_backward``): notes one outside ``scaled_backward``."""
        if self.scaler is not None and not self._scaling and self.pipeline is None:
            self.unscaled_backward = True  # plain loss.backward() on an fp16 plan: its gradients are not scaled

    def loss_scale(self) -> torch.Tensor | float:
        """The fp16 loss scale of the optimizer attached to this engine, a device tensor (reading it
        would synchronize); 1 otherwise."""
        return self.scaler.scale_tensor if self.scaler is not None else 1.0

    # --- around the optimizer step -------------------------------------------------------------

    def after_step(self) -> None:
        """The shards changed: drop stale gathered copies, gather resident chunks again."""
        self.cache.invalidate()
        for chunk in self.chunks:
            if chunk.resident:
                chunk.gather(async_op=False)
                chunk.fresh = True

    # --- forwarding to the parts, for the modules that call the engine ---------------------------

    @property
    def agreement(self) -> ForwardAgreement | None:
        """The agreement on forwards (uneven.py), set by setup; the forward hooks follow it."""
        return self.passes.agreement

    @agreement.setter
    def agreement(self, agreement: ForwardAgreement | None) -> None:
        self.passes.agreement = agreement

    def _root_pre_forward(self, *_: Any) -> None:
        if self.pipeline is None:  # a pipeline's stages run their own forwards (engine/parallel/pipeline.py)
            # A module added after setup would never train: walked for only when something registered.
            if self.known_param_ids is not None and registrations() != self.registrations_seen:
                check_no_new_params(self.model, self.known_param_ids)
                self.registrations_seen = registrations()
            if self.write_watch is not None:
                self.write_watch.check()
            self.passes.root_pre_forward()

    def begin_forward(self) -> None:
        """``ModulePasses.begin_forward``: called before each forward (one micro-batch)."""
        self.passes.begin_forward()

    def read_check(self) -> contextlib.AbstractContextManager:
        """``ModulePasses.read_check``: the first forwards' check of what they read."""
        return self.passes.read_check()

    def drain_grads(self) -> None:
        """``GradPath.drain_grads``: completes every reduction in flight."""
        self.grads.drain_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``GradPath.zero_grad``: zeroes the shard gradients after the reductions in flight."""
        self.grads.zero_grad(set_to_none)

    def hold_grads(self, passes: int) -> None:
        """``GradPath.hold_grads``: reduce each gradient once per ``passes`` backward passes (no-sync)."""
        self.grads.hold_grads(passes)

    def end_held_grads(self, flush: bool = True) -> None:
        """Ends no-sync: gradients still held (parameters used in fewer passes) are staged and reduced
        now as at the end of a backward (``flush``), or dropped (a step that failed)."""
        held = self.grads.end_held(flush)
        if held:
            self.passes.in_backward = True
            self.grads.stage_held(held)
            self.passes.end_backward()

    def full_state_dict(self, all_ranks: bool = False, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """``EngineState.full_state_dict``: full fp32 weights under the original names (a collective)."""
        return self.state.full_state_dict(all_ranks, trainable_only)

    def load_full_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> tuple[list[str], list[str]]:
        """``EngineState.load_full_state_dict``: sets the weights from a full state dict."""
        return self.state.load_full_state_dict(state, strict)

    def memory_report(self) -> dict[str, int]:
        """``EngineState.memory_report``: bytes this rank's engine allocated, by the plan's keys."""
        return self.state.memory_report()

    def memory_stats(self) -> dict[str, int]:
        """``EngineState.memory_stats``: measured figures beside the report."""
        return self.state.memory_stats()
