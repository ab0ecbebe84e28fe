"""Worker for the expert-parallel tests: the engine with expert parallelism against plain PyTorch.

Run by ``engine_launch.py`` as N processes (gloo, CPU). Each case is a dict:

    model: zoo:NAME (a mixture-of-experts zoo model, tests/zoo/models.py)
    expert: expert degree E (divides the world: data = world)      chunk_size, clip, steps, accum
    resume_at: save a checkpoint before this step; after the run, load it and train the same steps
        again (forward_backward): rank 0's full weights must come out bitwise the same
    save_pretrained: write a Hugging Face directory; rank 0 reads it with transformers and compares
    loop: plain (``model(**batch)`` and ``optimizer.backward`` per micro-batch) or forward_backward
    from_dir: the model (routers skewed) is written by ``save_pretrained`` into a directory; the engine
        builds it on the meta device and starts from ``weights=`` that directory (each rank reads its
        experts' rows), plain PyTorch loads it with ``from_pretrained``; each rank's expert tensors,
        as its first forward sees them, must be its rows of the file's
    offload: the fraction of chunks offloaded (every other one at 0.5, expert chunks among them)
    meta_init: also start the model on the meta device without weights (the model's initializer,
        seed 7): the engine's full weights must equal the initializer's run on one process

Each data rank takes its own micro-batches of each step's global batch; rank 0 also trains plain
PyTorch on the whole global batch and reports the largest differences. Every model's routers are
skewed first (``skew_routers``), the same way in both, so that one expert gets most of the tokens
and the ranks exchange unequal numbers of rows.
"""

from __future__ import annotations

import torch

import elixir_tune
from tests.distributed.engine_plans import make_plan, param_groups
from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks
from tests.distributed.torch_reference import state_round_trip

SKEW = 10.0


def global_batches(case: dict, data: int) -> list[dict]:
    from tests.zoo.models import global_batches as zoo_batches

    size = case.get("micro", 2) * case.get("accum", 1) * data
    return zoo_batches(case["model"].removeprefix("zoo:"), case.get("steps", 6), size)


def _routers(model) -> list[torch.nn.Module]:
    return [module for name, module in model.named_modules() if name.endswith("mlp.gate")]


@torch.no_grad()
def skew_routers(model, batches: list[dict]) -> None:
    """Sets each router's row 0 to the least-squares fit of a logit of ``SKEW`` for every token of
    ``batches`` (the router's inputs, from a forward of the untouched model): expert 0 then wins
    most tokens. Deterministic: the same in every process."""
    inputs: dict[torch.nn.Module, list[torch.Tensor]] = {}

    def keep(module, args):
        inputs.setdefault(module, []).append(args[0].reshape(-1, args[0].shape[-1]))

    hooks = [router.register_forward_pre_hook(keep) for router in _routers(model)]
    for batch in batches:
        model(**batch)
    for hook in hooks:
        hook.remove()
    for router, parts in inputs.items():
        x = torch.cat(parts)
        target = torch.full((x.shape[0], 1), SKEW)
        router.weight[0] = torch.linalg.lstsq(x.double(), target.double()).solution[:, 0].float()


def write_dir(case: dict, data: int, base: str, rank: int) -> tuple[str, dict[str, torch.Tensor]]:
    """The zoo model, routers skewed, written by ``save_pretrained`` (transformers writes one tensor per
    expert); returns the directory and the model's state dict (fused experts).

    Once the process group runs (a case after the first), transformers writes on rank 0 only: the
    ranks then share rank 0's directory and wait for it; before, each rank writes its own copy."""
    import torch.distributed as dist

    from tests.zoo.models import build as build_zoo

    model = build_zoo(case["model"].removeprefix("zoo:"))
    skew_routers(model, global_batches(case, data))
    shared = dist.is_initialized()
    directory = f"{base}.src.rank{0 if shared else rank}"
    if not shared or rank == 0:
        model.save_pretrained(directory)
    if shared:
        dist.barrier()
    return directory, model.state_dict()


def build(case: dict, data: int, weights: str | None = None, meta: bool = False):
    """The model and its AdamW: from the zoo (routers skewed), or from the directory ``weights``, on the
    meta device (``meta``: the engine reads the weights) or loaded by transformers (plain PyTorch)."""
    if weights is not None:
        import transformers

        if meta:
            config = transformers.AutoConfig.from_pretrained(weights)
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    else:
        from tests.zoo.models import build as build_zoo

        model = build_zoo(case["model"].removeprefix("zoo:"))
        skew_routers(model, global_batches(case, data))
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def expert_rows_seen(model) -> dict[str, torch.Tensor]:
    """Hooks that keep each expert tensor as the first forward of its module sees it (this rank's rows)."""
    from elixir_tune.engine.parallel.expert_parallel import expert_modules

    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args):
            for pname, param in module.named_parameters(recurse=False):
                seen.setdefault(f"{name}.{pname}", param.detach().clone())

        return hook

    for name, module in expert_modules(model):
        module.register_forward_pre_hook(keep(name))
    return seen


def run_engine(case: dict, rank: int, world: int, checkpoint_dir: str) -> dict:
    from elixir_tune.profiler.blocks import find_block_list

    weights, written = None, {}
    if case.get("from_dir"):
        weights, written = write_dir(case, world, checkpoint_dir, rank)
    model, opt = build(case, world, weights, meta=weights is not None)
    accum = case.get("accum", 1)
    plan = make_plan(
        model,
        world,
        case["chunk_size"],
        offload=case.get("offload", 0.0),
        block_list=find_block_list(model)[0],
        micro_batch_size=case.get("micro", 2),
        grad_accum_steps=accum,
        seq_len=8,
        expert=case["expert"],
    )
    model, opt = elixir_tune.setup(model, opt, plan=plan, weights=weights)
    engine = model.engine
    offloaded_expert_chunks = sum(1 for c in engine.chunks if c.offload and c.grad_divisor is not None)
    seen = expert_rows_seen(model.module)
    local_shapes = {
        name: list(p.shape)
        for name, p in model.module.named_parameters()
        if name.endswith(("gate_up_proj", "down_proj"))
    }
    losses, norms = [], []
    batches = global_batches(case, world)
    rows_match = None
    saved_at = case.get("resume_at")
    for step, batch in enumerate(batches):
        if step == saved_at:
            elixir_tune.save_checkpoint(checkpoint_dir, model, opt, step)
        micro = [local_micro(batch, rank, world, accum, k) for k in range(accum)]
        losses.append(step_loss(model, opt, micro, case.get("loop", "forward_backward")))
        if case.get("clip"):
            norms.append(float(opt.clip_grad_norm(case["clip"])))
        if step == 0 and weights is not None:  # this rank's rows of each expert tensor written
            first = rank * 2  # 2 of the 4 experts per rank at degree 2
            rows_match = bool(seen) and all(torch.equal(v, written[k][first : first + 2]) for k, v in seen.items())
        opt.step()
        opt.zero_grad()
    full = model.state_dict()  # a collective: every rank calls it
    pretrained_equal = None
    if case.get("save_pretrained"):  # written by rank 0, read back by plain transformers
        directory = f"{checkpoint_dir}.hf"
        elixir_tune.save_pretrained(model, directory)
        if rank == 0:
            import transformers

            read = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
            experts = [k for k in full if k.endswith(("gate_up_proj", "down_proj"))]
            pretrained_equal = (
                bool(experts) and set(full) <= set(read) and all(torch.equal(read[k], v) for k, v in full.items())
            )
    resumed_equal = None
    if saved_at is not None:  # back to the checkpoint, the same steps again: the same weights bitwise
        elixir_tune.load_checkpoint(checkpoint_dir, model, opt)
        for batch in batches[saved_at:]:
            model.forward_backward([local_micro(batch, rank, world, accum, k) for k in range(accum)])
            if case.get("clip"):
                opt.clip_grad_norm(case["clip"])
            opt.step()
            opt.zero_grad()
        again = model.state_dict()
        resumed_equal = all(torch.equal(again[k], v) for k, v in full.items())
    round_trip = state_round_trip(model)
    return {
        "losses": losses,
        "norms": norms,
        "state": {k: v.tolist() for k, v in full.items()} if rank == 0 else None,
        "local_shapes": local_shapes,
        "round_trip": round_trip,
        "resumed_equal": resumed_equal,
        "pretrained_equal": pretrained_equal,
        "rows_match": rows_match,
        "offloaded_expert_chunks": offloaded_expert_chunks,
    }


def meta_init_equal(case: dict, world: int) -> bool:
    """A meta-device start without weights at the case's expert degree gives the weights the model's
    initializer gives on one process (the same seed): each rank initialized its experts' rows only."""
    import transformers

    from elixir_tune.engine.io.initializer import Initializer
    from elixir_tune.profiler.blocks import find_block_list
    from tests.zoo.models import build as build_zoo

    config = build_zoo(case["model"].removeprefix("zoo:")).config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
        whole = transformers.AutoModelForCausalLM.from_config(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = make_plan(
        model, world, case["chunk_size"], block_list=find_block_list(model)[0], seq_len=8, expert=case["expert"]
    )
    engine_model, _ = elixir_tune.setup(model, opt, plan=plan, seed=7)
    full = engine_model.state_dict(all_ranks=True)
    initializer = Initializer(whole, 7)
    expected = {name: initializer.value(param) for name, param in whole.named_parameters()}
    return set(expected) <= set(full) and all(torch.equal(full[k], v) for k, v in expected.items())


def run_reference(case: dict, data: int, weights: str | None = None) -> dict:
    """Plain PyTorch on each step's whole global batch; also the share of the (token, expert)
    assignments of each router that its most chosen expert got, over all steps."""
    model, opt = build(case, data, weights)
    counts: dict[torch.nn.Module, torch.Tensor] = {}

    def count(module, args, output):
        chosen = output[2].reshape(-1)
        counts[module] = counts.get(module, 0) + torch.bincount(chosen, minlength=module.num_experts)

    for router in _routers(model):
        router.register_forward_hook(count)
    losses, norms = [], []
    for batch in global_batches(case, data):
        loss = model(**batch).loss
        loss.backward()
        if case.get("clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    shares = [float(c.max() / c.sum()) for c in counts.values()]
    return {
        "losses": losses,
        "norms": norms,
        "state": {k: v.tolist() for k, v in model.state_dict().items()},
        "shares": shares,
    }


def step_loss(model, opt, micro: list[dict], loop: str) -> float:
    """One step's forward and backward: under the plain loop what a DDP user writes (each rank its own
    micro-batches, ``opt.backward(loss / accum)``), else ``forward_backward``; this rank's loss."""
    if loop != "plain":
        return float(model.forward_backward(micro))
    total = 0.0
    for part in micro:
        loss = model(**part).loss / len(micro)
        opt.backward(loss)
        total += float(loss.detach())
    return total


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    engine = run_engine(case, rank, world, f"{out_path}.ckpt{index}")
    world_losses = mean_over_ranks(engine["losses"], world)
    result = {
        "case": case,
        "world_losses": world_losses,
        "local_shapes": engine["local_shapes"],
        "round_trip": engine["round_trip"],
        "resumed_equal": engine["resumed_equal"],
        "pretrained_equal": engine["pretrained_equal"],
        "rows_match": engine["rows_match"],
        "offloaded_expert_chunks": engine["offloaded_expert_chunks"],
    }
    if case.get("meta_init"):
        result["meta_init_equal"] = meta_init_equal(case, world)
    if rank == 0:
        weights = f"{out_path}.ckpt{index}.src.rank0" if case.get("from_dir") else None
        reference = run_reference(case, world, weights)
        result.update(compare(engine, reference, world_losses))
        result["shares"] = reference["shares"]
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
