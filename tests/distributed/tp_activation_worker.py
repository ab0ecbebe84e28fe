"""Worker for the activation-memory measurement of tensor parallelism (CPU, gloo).

Each case: ``model`` (gpt2 | llama), ``tensor`` (T), ``mode`` (1d | 2d), ``sp`` (sequence
parallelism), ``micro`` (samples per tensor group), ``seq``. Every rank runs one warm-up step
through the engine, then one measured micro-batch:

* ``saved_bytes``: the bytes of the distinct storages autograd saves for backward during the
  forward (``torch.autograd.graph.saved_tensors_hooks``; a DTensor counts its local tensor), minus
  the parameters' own storages (chunk payloads): the activation memory of this rank;
* ``forward_collective_bytes`` / ``backward_collective_bytes``: bytes this rank moved in the
  tensor-parallel collectives of that forward and its backward, by collective (``CollectiveBytes``);
* ``step_peak_bytes`` / ``live_bytes``: the measured step's allocation peak above its start and
  the live storages at its start (``memory_probe.peak_step_bytes``, as the engine's memory harness).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

import elixir_tune
from tests.distributed.engine_launch import worker_main
from tests.distributed.engine_plans import make_plan
from tests.distributed.memory_probe import peak_step_bytes


def build(case: dict) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if case["model"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_embd=128, n_layer=2, n_head=8, vocab_size=512, n_positions=case["seq"],
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = GPT2LMHeadModel(config)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=case["seq"],
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"  # the same kernels (and saved tensors) at every degree
    return model


def storages(tensor: torch.Tensor) -> list:
    """The storages holding a tensor's values: its own, or its inner tensors' for a wrapper subclass
    (a DTensor, an asynchronous collective's result)."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in names]
        return [storage for t in inner if isinstance(t, torch.Tensor) for storage in storages(t)]
    return [tensor.untyped_storage()]


def saved_activation_bytes(run, exclude: set[int]) -> int:
    """Bytes of distinct storages saved for backward while ``run()`` runs, storages in ``exclude`` left out."""
    sizes: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        for storage in storages(tensor):
            address = storage.data_ptr()
            if address and address not in exclude:
                sizes[address] = max(sizes.get(address, 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(sizes.values())


class CollectiveBytes(TorchDispatchMode):
    """Bytes each rank moves in the tensor-parallel collectives (DTensor's functional collectives;
    the chunk engine's own gathers and reductions are not functional and are not counted), by the
    ring algorithm's volume: all-gather (g - 1) x input, reduce-scatter (g - 1) / g x input,
    all-reduce 2 (g - 1) / g x input, for a group of g ranks."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, name = func._schema.name.partition("::")
        names = [arg for arg in (*args, *kwargs.values()) if isinstance(arg, str)]
        if namespace == "_c10d_functional" and names and args and isinstance(args[0], torch.Tensor):
            size = args[0].numel() * args[0].element_size()
            group = dist.distributed_c10d._resolve_process_group(names[-1]).size()  # the group comes last
            factor = {"all_gather_into_tensor": group - 1, "reduce_scatter_tensor": (group - 1) / group}
            moved = size * factor.get(name, 2 * (group - 1) / group)
            self.bytes[name] = self.bytes.get(name, 0) + moved
        return func(*args, **kwargs)


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    tensor = case["tensor"]
    model = build(case)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    block = "transformer.h" if case["model"] == "gpt2" else "model.layers"
    plan = make_plan(
        model,
        world,
        1 << 20,
        tensor=tensor,
        tensor_mode=case.get("mode", "1d"),
        sequence_parallel=case.get("sp", True),
        block_list=block,
        micro_batch_size=case["micro"],
        seq_len=case["seq"],
    )
    model, opt = elixir_tune.setup(model, opt, plan=plan)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (case["micro"], case["seq"]), generator=generator)
    batch = {"input_ids": ids, "labels": ids}

    def step() -> None:
        loss = model(**batch).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()

    step()  # records the access order; the payloads are gathered from here on
    payloads = {chunk.payload.untyped_storage().data_ptr() for chunk in model.engine.chunks}
    losses: list[torch.Tensor] = []
    forward, backward = CollectiveBytes(), CollectiveBytes()
    with forward:
        saved = saved_activation_bytes(lambda: losses.append(model(**batch).loss), payloads)
    with backward:
        opt.backward(losses[0])
    opt.zero_grad()
    measured = peak_step_bytes(step, model.engine.device, warmup=step)
    return {
        "case": case,
        "saved_bytes": saved,
        "forward_collective_bytes": forward.bytes,
        "backward_collective_bytes": backward.bytes,
        **measured,
    }


if __name__ == "__main__":
    worker_main(run_case)
