"""``setup``: from an ordinary model and optimizer to the chunk engine a plan describes."""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable

import torch

from elixir_tune import ranks
from elixir_tune.engine.comm import init_mesh
from elixir_tune.engine.comm.control import ControlChannel, settle_before_world_waits
from elixir_tune.engine.engine import Engine
from elixir_tune.engine.grad_view import GradPlaceholders
from elixir_tune.engine.io.materialize import has_meta, make_source
from elixir_tune.engine.model import ElixirModel
from elixir_tune.engine.optimizer import ShardedOptimizer
from elixir_tune.engine.optimizer_state import gather_whole_state
from elixir_tune.engine.ownership import WriteWatch, check_optimizer_is_over, registrations, watch_optimizers
from elixir_tune.engine.parallel.expert_parallel import split_experts
from elixir_tune.engine.parallel.pipeline_tensor import check_combined
from elixir_tune.engine.parallel.tensor_parallel import split_for_plan
from elixir_tune.engine.uneven import ForwardAgreement, Replay, UnevenForwardError
from elixir_tune.engine.worker import collective_timeout_s
from elixir_tune.plan import PLAN_ENV_VAR, Plan, PlanError, load_plan, validate
from elixir_tune.plan.fingerprint import model_fingerprint as _plan_fingerprint


def model_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint a plan for ``model`` must carry (names, shapes, dtypes, frozen marks in order)."""
    return _plan_fingerprint(model)


def resolve_plan(plan: Plan | str | os.PathLike | None) -> Plan:
    """The plan ``setup`` runs: ``plan`` itself (validated), a file, or ``$ELIXIR_TUNE_PLAN`` when None."""
    if plan is None:
        path = os.environ.get(PLAN_ENV_VAR)
        if not path:
            raise ValueError(
                f"no plan: pass plan= to setup or set ${PLAN_ENV_VAR} "
                "(elixir-run sets it); make one with `elixir-tune search`"
            )
        return load_plan(path)
    if isinstance(plan, Plan):
        problems = validate(plan)
        if problems:
            raise PlanError("<plan>", problems)
        return plan
    return load_plan(plan)


def check_plan_matches(model: torch.nn.Module, plan: Plan) -> None:
    """Raises ValueError when the plan was made for another model or misses its parameters."""
    found = model_fingerprint(model)
    if found != plan.model.fingerprint:
        raise ValueError(
            f"the plan was made for another model: its model fingerprint is {plan.model.fingerprint}, this model's "
            f"is {found} (parameter names, shapes or dtypes differ); run `elixir-tune profile` and "
            "`elixir-tune search` again for this model"
        )
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    planned = [name for chunk in plan.memory.chunks for name in chunk.params]
    in_frozen_chunks = {name for chunk in plan.memory.chunks if chunk.frozen for name in chunk.params}
    problems = []
    missing = sorted(trainable - set(planned))
    if missing:
        problems.append(f"trainable parameters in no chunk: {', '.join(missing[:5])}")
    unknown = sorted(set(planned) - trainable - frozen)
    if unknown:
        problems.append(f"chunks name unknown parameters: {', '.join(unknown[:5])}")
    # Frozen parameters outside every chunk stay replicated on the device (a hand-written plan).
    trained_in_frozen = sorted(trainable & in_frozen_chunks)
    if trained_in_frozen:
        problems.append(f"trainable parameters in frozen chunks: {', '.join(trained_in_frozen[:5])}")
    frozen_in_trained = sorted((set(planned) - in_frozen_chunks) & frozen)
    if frozen_in_trained:
        problems.append(
            "frozen parameters (requires_grad False) in chunks not marked frozen: " + ", ".join(frozen_in_trained[:5])
        )
    if problems:
        raise ValueError("the plan does not match the model's parameters: " + "; ".join(problems))
    check_lora_matches(model, plan)


def check_lora_matches(model: torch.nn.Module, plan: Plan) -> None:
    """Raises ValueError when the model's LoRA adapters are not the ones the plan was searched for.

    The fingerprint already covers the adapters' names and shapes (targets and rank); this also
    compares alpha and dropout, which change the training but no parameter.
    """
    from elixir_tune.models.lora import lora_settings

    found = lora_settings(model)
    if found == plan.model.lora:
        return
    if not plan.model.lora:
        raise ValueError(
            f"the model has LoRA adapters {found} but the plan was made for full fine-tuning; profile the LoRA "
            "model (`elixir-tune profile MODEL --lora-rank R ...`) and search again"
        )
    raise ValueError(
        f"the model's LoRA adapters {found or '(none)'} differ from the plan's model.lora {plan.model.lora}; "
        "apply the same LoRA settings as the profile (`elixir-tune profile ... --lora-rank`), or profile and "
        "search again"
    )


def agreed_seed(comm, seed: int | None) -> int:
    """``seed``, or rank 0's ``torch.initial_seed()`` (what its last ``torch.manual_seed`` set), on every rank."""
    value = torch.tensor(
        [int(seed if seed is not None else torch.initial_seed()) & ((1 << 63) - 1)], device=comm.device
    )
    comm.broadcast(value, src=0)
    return int(value.item())


def setup(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan | str | None = None,
    weights: str | os.PathLike | None = None,
    seed: int | None = None,
    find_unused_parameters: bool | None = None,
    vocab_parallel_loss: bool = False,
):
    """Shards ``model`` and ``optimizer`` as the plan says.

    Starts the process group when needed (nccl for cuda, gloo for cpu; from the torchrun
    environment), checks the plan against the model, packs the trainable parameters into chunks,
    installs the hooks and rebuilds the optimizer over this rank's shards.

    The model may be built on the meta device (``with torch.device("meta"):``): the weights are then
    made chunk by chunk straight into this rank's shards, read from ``weights`` or produced by the
    model's own initializer (deterministic for a seed whatever the world size, chunk size and
    offload), so no rank ever holds the whole model. Under a tensor-parallel plan the model is split
    on the meta device first, and each rank reads or initializes only its own pieces; under expert
    parallelism each rank reads or initializes only its own experts.

    Args:
        model: the user's module: real weights (rank 0's are used everywhere) or on the meta device.
        optimizer: an optimizer built on ``model.parameters()`` (Adam, AdamW, SGD, param groups kept).
        plan: a Plan, a path to a plan YAML, or None to read ``$ELIXIR_TUNE_PLAN``.
        weights: a safetensors file, a ``model.safetensors.index.json``, or a Hugging Face model
            directory: the initial weights (each rank reads only its shards' slices).
        seed: seeds the initializer of a meta-device model; default rank 0's ``torch.initial_seed()``.
        find_unused_parameters: True when some parameters may get no gradient in some steps (they
            are then skipped, as torch skips grad None; costs a small all-reduce and a host sync per
            step); False when every parameter always gets one; None learns it from the first step.
        vocab_parallel_loss: with 1d tensor parallelism, keep the logits split by vocabulary and run
            the model's loss under ``loss_parallel`` (no rank holds the whole logits); the loss is then
            a DTensor whose backward must go through ``optimizer.backward(loss)`` or
            ``model.forward_backward``, not ``loss.backward()``.

    A plan whose ``engine.name`` is fsdp2 or deepspeed runs on that engine (engine/peers/), with
    the same script contract where the engine can keep it.

    Returns:
        (model, optimizer): an ElixirModel to call like the original module, and a
        ShardedOptimizer with ``backward(loss)``, ``clip_grad_norm(max_norm)``, ``step()`` and
        ``zero_grad()``.
    """
    plan = resolve_plan(plan)
    model = _uncompiled(model)
    check_plan_matches(model, plan)
    check_optimizer_is_over(model, optimizer)
    if plan.engine.name != "elixir":  # a peer engine (engine/peers/): FSDP2 or DeepSpeed
        from elixir_tune.engine.peers import setup_peer

        return setup_peer(model, optimizer, plan, weights=weights, vocab_parallel_loss=vocab_parallel_loss)
    check_combined(plan, vocab_parallel_loss)
    parallel = plan.parallel
    mesh = init_mesh(
        plan.world_size,
        plan.cluster.device,
        plan.cluster.backend,
        pipeline=parallel.pipeline.stages,
        tensor=parallel.tensor.degree,
        context=parallel.context.degree,
    )
    ranks.use_plan(plan, mesh.world.rank)
    seed = agreed_seed(mesh.world, seed)
    # Tensor parallelism splits the model first (on the meta device when it is there): the source
    # then gives each rank its own pieces of the split parameters only.
    fresh = weights is not None or has_meta(model)
    tensor_parallel = split_for_plan(model, optimizer, plan, mesh, fresh, vocab_parallel_loss)
    context = None
    if parallel.context.degree > 1:
        # The context group computes different tokens with the same weights: the chunks stay sharded
        # over the whole data x context world (mesh.data), only attention talks within the group.
        from elixir_tune.engine.comm.context import context_group
        from elixir_tune.engine.parallel.context_parallel import install as install_context

        if vocab_parallel_loss:
            raise ValueError(
                "vocab_parallel_loss with context parallelism: each context rank computes its tokens' loss on "
                "whole logits; call setup without vocab_parallel_loss for this plan"
            )
        group = context_group(mesh.world, parallel.context.degree, parallel.tensor.degree)
        context = install_context(model, group, parallel.context.mode)
    source = make_source(model, weights, seed, tensor_parallel)
    experts = None
    if parallel.expert.degree > 1:
        # After the source, which matched the file's and the initializer's tensors at their whole
        # shapes: it then gives each rank its experts' rows (a model with weights: rank 0's, broadcast).
        experts = split_experts(model, mesh, parallel.expert.degree, from_source=source is not None)
        if source is not None:
            source.experts = experts
    # The chunks are sharded over the data-parallel group; pipeline and tensor parallelism read the
    # rest of the mesh from engine.mesh.
    if parallel.pipeline.stages > 1:
        from elixir_tune.engine.parallel.pipeline import build_engine

        engine = build_engine(model, plan, mesh, source, tensor_parallel, context)
    else:
        engine = Engine(model, plan, mesh.data, source, mesh, tensor_parallel=tensor_parallel, experts=experts)
        engine.agreement = forward_agreement(engine, plan, mesh)
        if parallel.tensor.degree == 1:  # a DTensor parameter takes no plain placeholder
            engine.grads.grad_placeholders = GradPlaceholders(engine.trainable_params)
    global setup_calls
    setup_calls += 1
    sharded = ShardedOptimizer(optimizer, engine, find_unused_parameters)
    if parallel.pipeline.stages == 1:  # objects beside the engine that would train it wrongly (ownership.py)
        watch_optimizers(engine, [(slot.name, slot.param) for slot in engine.slots], sharded)
        engine.known_param_ids = {id(param) for param in model.parameters()}
        engine.registrations_seen = registrations()
        engine.write_watch = WriteWatch([(slot.name, slot.param) for slot in engine.slots])
    return ElixirModel(model, engine), sharded


# How many times this process called setup: the launcher's worker says so at exit when a script
# launched with a plan never did (launcher/worker_main.py).
setup_calls = 0


def _discard(_: object) -> None:
    """A follower takes part in the leader's state dict gathers; the result is the leader's."""


def _uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped, when ``model`` is its wrapper (its parameter names carry
    ``_orig_mod.``, so the plan would not match). The engine runs it uncompiled, and says so."""
    original = getattr(model, "_orig_mod", None)
    if not isinstance(original, torch.nn.Module):
        return model
    warnings.warn(
        "elixir_tune.setup got a torch.compile'd model: the engine's hooks run the original module uncompiled",
        stacklevel=3,
    )
    return original


def _live(ref: weakref.ref) -> Callable[[], Engine]:
    """The engine behind ``ref``; raises when the script dropped it on this rank while another leads."""

    def engine() -> Engine:
        found = ref()
        if found is None:
            raise UnevenForwardError(
                "another rank evaluates or saves a model alone, but this rank already dropped that model; keep "
                "the model on every rank until every rank is done with it"
            )
        return found

    return engine


def forward_agreement(engine: Engine, plan: Plan, mesh) -> ForwardAgreement | None:
    """The agreement on forwards and state dicts (engine/uneven.py), where a forward has collectives.

    None for one process, and where every chunk stays gathered and nothing else in a forward
    communicates (any rank may then run a forward alone, as under DDP).
    """
    parallel = plan.parallel
    if mesh.world.world_size == 1:
        return None
    gathers = any(not chunk.resident for chunk in engine.chunks) and mesh.data.world_size > 1
    refusal = None
    if parallel.tensor.degree > 1:
        refusal = "under tensor parallelism the ranks of a tensor group compute every forward together"
    elif parallel.expert.degree > 1:
        refusal = "under expert parallelism the ranks exchange tokens inside every forward"
    elif parallel.context.degree > 1:
        refusal = "under context parallelism the ranks of a context group exchange keys and values in every forward"
    if refusal is None and not gathers:
        return None
    # The replay holds the engine weakly: the agreement outlives it as the one a barrier settles
    # (engine/comm/control.py), and must not keep a model the script dropped in memory.
    live = _live(weakref.ref(engine))
    replay = Replay(
        begin=lambda: live().passes.start_microbatch(),
        pre_forward=lambda index: live().passes.pre_forward(live().module_map.order[index]),
        post_forward=lambda index: live().passes.post_forward(live().module_map.order[index]),
        state_dict=lambda all_ranks: _discard(live().full_state_dict(all_ranks=all_ranks)),
        optimizer_state=lambda: _discard(gather_whole_state(live().optimizer)),
    )
    channel = ControlChannel(mesh.world.world_size, mesh.world.rank, collective_timeout_s())
    agreement = ForwardAgreement(channel, replay, refusal)
    settle_before_world_waits(agreement.settle)
    return agreement
