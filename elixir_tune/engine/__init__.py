"""The chunk-based training engine: ``setup(model, optimizer, plan)`` runs a plan.

Public names:
    setup(model, optimizer, plan=None, weights=None, seed=None) -> (ElixirModel, ShardedOptimizer);
        plan: Plan, path, or None for $ELIXIR_TUNE_PLAN; the model may be on the meta device
        (elixir_tune.engine.io.materialize); weights: safetensors file / index / HF directory
        (elixir_tune.engine.io.weights); errors: MaterializeError, WeightsError (ValueErrors).
    save_pretrained(model, dir, max_shard_size="5GB", dtype=None): Hugging Face layout, streamed
        from rank 0 (elixir_tune.engine.io.pretrained).
    ElixirModel: call like the model; .state_dict(all_ranks=False) (collective: full fp32 weights,
        original names, on rank 0; {} elsewhere), .load_state_dict(full), .memory_report() (model-state bytes, keys
        elixir_tune.plan.MODEL_STATE_KEYS), .engine (Engine; .engine.memory_stats() for measured
        figures).
    ShardedOptimizer (a torch.optim.Optimizer): .backward(loss) (fp16 loss scaling),
        .clip_grad_norm(max_norm, norm_type=2.0) -> global norm, .step(), .zero_grad(),
        .param_groups (the user's groups: LR schedulers work), .loss_scale, .skipped_steps,
        .state_dict() / .load_state_dict() (this rank's shard state).
    model_fingerprint(model) -> the fingerprint a plan for this model carries.
    save_checkpoint(root, model, optimizer, step, extra=None, keep=2) / load_checkpoint(path, model, optimizer)
        -> meta: sharded checkpoints in root/step-NNNNNN (elixir_tune.engine.io.checkpoint); exact resume on
        the same plan layout; lock_checkpoint_dir(root, model); errors: CheckpointError (a ValueError).

Pipeline plans (parallel.pipeline.stages > 1, elixir_tune.engine.parallel.pipeline): GPT-2, Llama-family and
OPT causal LMs; each rank holds its stage's chunks (and the tied embedding's), other stages' modules
stay on meta; run steps with model.forward_backward(micro_batches) (model(...) raises).

Rules a plan must follow beyond validate():
    * cache_blocks >= the most non-resident chunks one module needs at once, counting the chunks
      of enclosing modules that own parameters directly (they stay gathered while their children
      run); setup raises ValueError naming the module and the minimum otherwise;
    * every rank runs the same modules in the same order (no data-dependent control flow), as
      with FSDP: the collectives are issued by the hooks;
    * a module that reads parameters it does not own (model.foreign_reads, found by the profiler)
      has their chunks gathered for it; any other read of a chunked parameter outside its modules
      raises UngatheredRead in the forwards before the first backward (elixir_tune.engine.read_guard).

Access order for eviction and prefetch: recorded at run time during the first micro-batch
(forward, recomputation, backward); before that, the plan's chunk order (ascending in forward,
descending in backward).
"""

from elixir_tune.engine.chunks.cache import CacheTooSmall
from elixir_tune.engine.chunks.states import TensorState
from elixir_tune.engine.engine import Engine
from elixir_tune.engine.io.checkpoint import load_checkpoint, lock_checkpoint_dir, save_checkpoint
from elixir_tune.engine.io.checkpoint_files import CheckpointError
from elixir_tune.engine.io.materialize import MaterializeError
from elixir_tune.engine.io.pretrained import save_pretrained
from elixir_tune.engine.io.weights import WeightsError
from elixir_tune.engine.model import ElixirModel
from elixir_tune.engine.optimizer import ShardedOptimizer
from elixir_tune.engine.read_guard import UngatheredRead
from elixir_tune.engine.setup import check_plan_matches, model_fingerprint, setup

__all__ = [
    "CacheTooSmall",
    "CheckpointError",
    "ElixirModel",
    "Engine",
    "MaterializeError",
    "ShardedOptimizer",
    "TensorState",
    "UngatheredRead",
    "check_plan_matches",
    "load_checkpoint",
    "lock_checkpoint_dir",
    "model_fingerprint",
    "save_checkpoint",
    "save_pretrained",
    "setup",
    "WeightsError",
]
