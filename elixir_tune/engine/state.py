"""What the engine reports and exchanges as a whole: full weights in and out, and its memory accounting.

A part of ``Engine`` (engine.py): these methods read the engine's chunks, cache and staging pool but
take no part in a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elixir_tune.engine.parallel.tensor_parallel import local_data
from elixir_tune.plan import DTYPE_BYTES, MODEL_STATE_KEYS
from elixir_tune.plan.memory import pinned_bytes

if TYPE_CHECKING:
    from elixir_tune.engine.chunks.cache import ChunkCache
    from elixir_tune.engine.chunks.chunk import Chunk, ParamSlot
    from elixir_tune.engine.comm import Comm
    from elixir_tune.engine.grad_path import GradPath
    from elixir_tune.engine.parallel.expert_parallel import ExpertSplit
    from elixir_tune.engine.parallel.tensor_parallel import TensorSplit
    from elixir_tune.plan import Plan


class EngineState:
    """Full state dicts and memory figures of an ``Engine``.

    Args:
        model: the user's module.
        plan: the engine's plan.
        comm: the data-parallel group.
        device: the engine's device.
        chunks: the engine's chunks.
        slot_of: id(param) -> its slot.
        cache: the engine's chunk cache.
        grads: the engine's gradient path (its staging pool and reduction count).
        upload_block: the host block of the offloaded shards' upload copies.
        pinned: host blocks are pinned.
        tensor_parallel: the model's tensor-parallel split, or None.
        experts: the model's expert split, or None.
        after_step: regathers the resident chunks after the masters changed (``Engine.after_step``).
        pipeline: returns the engine's ``Pipeline`` (engine/parallel/pipeline.py), None without one.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        plan: Plan,
        comm: Comm,
        device: torch.device,
        chunks: list[Chunk],
        slot_of: dict[int, ParamSlot],
        cache: ChunkCache,
        grads: GradPath,
        upload_block: torch.Tensor,
        pinned: bool,
        tensor_parallel: TensorSplit | None,
        experts: ExpertSplit | None,
        after_step: Callable[[], None],
        pipeline: Callable[[], Any],
    ):
        self.model = model
        self.plan = plan
        self.comm = comm
        self.device = device
        self.chunks = chunks
        self.slot_of = slot_of
        self.cache = cache
        self.grads = grads
        self.upload_block = upload_block
        self.pinned = pinned
        self.tensor_parallel = tensor_parallel
        self.experts = experts
        self.after_step = after_step
        self._pipeline = pipeline  # attached after the engine is built (engine.pipeline)

    @torch.no_grad()
    def gathered_chunks(self, all_ranks: bool = False, trainable_only: bool = False):
        """Yields ``(chunk, full fp32 chunk on the CPU)`` one chunk at a time (a collective).

        Args:
            all_ranks: every rank gets the chunk; otherwise rank 0 does and the others get None.
            trainable_only: leave out the frozen chunks.
        """
        for chunk in self.chunks:
            if trainable_only and chunk.frozen:
                continue
            shard = chunk.master.to(self.device, torch.float32)  # a frozen chunk's is in the compute dtype
            # An expert chunk (sharded over its expert-data group) goes to every rank: its experts are
            # then gathered over the expert group (full_state_dict), which every rank takes part in.
            everywhere = all_ranks or chunk.comm is not self.comm
            mine = everywhere or self.comm.rank == 0
            flat = torch.empty(chunk.chunk_size, dtype=torch.float32, device=self.device) if mine else None
            if everywhere:
                assert flat is not None  # every rank allocated it
                chunk.comm.all_gather_into_tensor(flat, shard, async_op=False)
            else:
                self.comm.gather_to(flat, shard, dst=0)
            yield chunk, (flat.cpu() if flat is not None else None)

    @torch.no_grad()
    def full_state_dict(self, all_ranks: bool = False, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 weights under the original names (frozen parameters and buffers included), on the CPU.

        A collective: every rank calls it. Rank 0 gets the dictionary, the others an empty one
        (all of them with ``all_ranks``). ``trainable_only``: the trained parameters alone (a LoRA
        model's adapters), without gathering the frozen chunks.
        """
        full: dict[int, torch.Tensor] = {}
        for chunk, flat in self.gathered_chunks(all_ranks, trainable_only):
            if flat is None:
                continue
            for slot in chunk.slots:
                full[id(slot.param)] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        if self.experts is not None:  # this rank's experts: the whole tensors over the expert group
            for slot in (slot for chunk in self.chunks for slot in chunk.slots):
                if id(slot.param) in self.experts.param_slices and id(slot.param) in full:
                    full[id(slot.param)] = self.experts.gather(slot.param, full[id(slot.param)])
        if not (all_ranks or self.comm.rank == 0):
            return {}
        state = {}
        values = self.model.state_dict(keep_vars=True)
        for name, value in values.items():
            if id(value) in full:
                state[name] = full[id(value)]
            elif trainable_only:
                continue
            else:
                tensor = local_data(value).detach()
                if isinstance(value, torch.nn.Parameter) and tensor.is_floating_point():
                    tensor = tensor.float()
                state[name] = tensor.cpu().clone()
        if self.tensor_parallel is not None:
            # This rank holds its pieces of the split parameters: assemble them over the tensor group.
            state = self.tensor_parallel.full_state(state, values)
            if not all_ranks and self.tensor_parallel.rank != 0:
                return {}
        return state

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> tuple[list[str], list[str]]:
        """Sets the weights from a full state dict (as ``full_state_dict`` returns), on every rank.

        Everything is checked before anything is written, so a refused dictionary loses nothing.

        Args:
            state: full weights by their original names.
            strict: as torch's: a missing or unexpected key is an error (False: they are returned).

        Returns:
            (missing keys, unexpected keys), as torch's ``load_state_dict`` reports them.

        Raises:
            RuntimeError: as torch words it: the missing or unexpected keys (strict), a key whose shape
                differs from the model's, or a chunked parameter missing (its shards cannot keep part
                of an old value).
        """
        live = self.model.state_dict(keep_vars=True)
        names = {id(value): name for name, value in live.items()}
        missing = [name for name in live if name not in state]
        unexpected = [name for name in state if name not in live]
        chunked_missing = [
            slot.name for slot in self.slot_of.values() if names.get(id(slot.param), slot.name) in missing
        ]
        if (strict and (missing or unexpected)) or chunked_missing:
            raise RuntimeError(
                "Error(s) in loading state_dict: "
                + "; ".join(
                    f"{what}: {', '.join(repr(k) for k in keys[:5])}{' ...' if len(keys) > 5 else ''}"
                    for what, keys in (("Missing key(s)", missing), ("Unexpected key(s)", unexpected))
                    if keys
                )
            )
        locals_by_slot = {}
        for chunk in self.chunks:
            for slot in chunk.slots:
                name = names.get(id(slot.param), slot.name)
                locals_by_slot[id(slot)] = self._local_value(slot.param, state[name], name, slot.numel)
        self.cache.wait_all()  # no gather in flight may read a master while it is written
        for chunk in self.chunks:
            flat = torch.zeros(chunk.chunk_size, dtype=torch.float32, device=self.device)
            for slot in chunk.slots:
                flat[slot.offset : slot.offset + slot.numel].copy_(locals_by_slot[id(slot)].reshape(-1))
            chunk.init_master(flat)
        for name, value in live.items():
            if id(value) not in self.slot_of and name in state:
                local_data(value).copy_(self._local_value(value, state[name], name, value.numel()))
        self.after_step()
        return missing, unexpected

    def _local_value(self, param: torch.Tensor, value: torch.Tensor, name: str, numel: int) -> torch.Tensor:
        """This rank's part of a full value (tensor and expert splits), checked against its size."""
        full_shape = list(value.shape)
        if self.tensor_parallel is not None:
            value = self.tensor_parallel.local_value(param, value)
        if self.experts is not None:
            value = self.experts.local_value(param, value)
        if value.numel() != numel:
            raise RuntimeError(
                f"Error(s) in loading state_dict: size mismatch for {name}: copying a param with shape "
                f"{full_shape}, the parameter in current model holds {numel} elements on this rank"
            )
        return value

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank's engine allocated: the model states under the keys of
        ``elixir_tune.plan.MODEL_STATE_KEYS`` and the rest under ``elixir_tune.plan.memory.TRANSIENT_KEYS``.

        Computed from the buffers the engine allocated: cache slots (capacity: cache_blocks chunk
        payloads in compute dtype), resident payloads, master + gradient + optimizer-state bytes of
        device and host shards; the staging pool, the upload copies and the landing buffers
        (pinned blocks as the CUDA host allocator rounds them); on a pipeline plan, the gradients its
        no-sync step holds at its peak, from this rank's virtual stages and the schedule
        (``memory_stats()["peak_held_grad_bytes"]`` measures them).
        """
        item = DTYPE_BYTES[self.plan.training.dtype]
        report = dict.fromkeys(MODEL_STATE_KEYS, 0)
        report["cache_bytes"] = self.cache.cache_blocks * self.plan.memory.chunk_size * item
        for chunk in self.chunks:
            if chunk.resident:
                report["resident_bytes"] += chunk.payload_bytes()
            key = "host_shard_bytes" if chunk.offload else "device_shard_bytes"
            report[key] += chunk.shard_bytes() + chunk.optimizer_state_bytes
        upload = self.upload_block.nbytes
        # Upload copies that are the masters themselves (fp32; frozen chunks in any dtype) count as host shards.
        masters_inside = sum(c.master.nbytes for c in self.chunks if c.upload is not None and c.master is c.upload)
        report["staging_bytes"] = self.grads.staging.device_bytes()
        report["host_copy_bytes"] = pinned_bytes(upload, self.pinned) - masters_inside
        report["landing_bytes"] = pinned_bytes(self.grads.staging.landing_nbytes(), self.pinned) + sum(
            pinned_bytes(c.landing.nbytes, self.pinned) for c in self.chunks if c.landing is not None
        )  # beside the pool's: each offloaded expert chunk's own (cuda)
        pipeline = self._pipeline()
        report["held_grad_bytes"] = pipeline.held_grad_bytes() if pipeline is not None else 0
        return report

    def memory_stats(self) -> dict[str, int]:
        """Measured figures beside the report: cache payloads and staging buffers actually held."""
        pipeline = self._pipeline()
        return {
            "peak_cache_bytes": self.cache.peak_bytes,
            "gathers": self.cache.gathers,
            "uploads": self.cache.uploads,
            "reduce_scatters": self.grads.reduce_scatters,
            "held_cache_bytes": sum(c.payload_bytes() for c in self.cache.held.values()),
            "peak_staging_buffers": self.grads.staging.peak_live,
            "peak_held_grad_bytes": pipeline.peak_held_grad_bytes if pipeline is not None else 0,
        }
