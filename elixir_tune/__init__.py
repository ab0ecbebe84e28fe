"""elixir-tune: auto-tuned chunk-based sharding and CPU offload for training large models.

The public API is small and imports torch only when used:

    import elixir_tune
    plan = elixir_tune.load_plan("plan.yaml")
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
    elixir_tune.save_checkpoint("ckpt", model, optimizer, step)   # resume: elixir_tune.load_checkpoint
    elixir_tune.save_pretrained(model, "out")                      # Hugging Face layout
    elixir_tune.data_rank(), elixir_tune.data_size()               # this process's share of the data
"""

__version__ = "0.1.0"

from elixir_tune.errors import ContractError, NonFiniteError  # noqa: E402  (torch-free)
from elixir_tune.plan import load_plan, save_plan, validate  # noqa: E402  (torch-free)
from elixir_tune.ranks import data_rank, data_size  # noqa: E402  (torch-free)


def setup(model, optimizer, plan=None, weights=None, seed=None, find_unused_parameters=None, vocab_parallel_loss=False):
    """Shards ``model`` (real or on the meta device) and ``optimizer`` as the plan says, with the
    initial weights from ``weights`` (safetensors file, index or HF directory) when given; see
    elixir_tune.engine.setup."""
    from elixir_tune.engine import setup as engine_setup

    return engine_setup(
        model,
        optimizer,
        plan=plan,
        weights=weights,
        seed=seed,
        find_unused_parameters=find_unused_parameters,
        vocab_parallel_loss=vocab_parallel_loss,
    )


def save_pretrained(model, directory, max_shard_size="5GB", dtype=None):
    """Writes Hugging Face sharded safetensors + config from rank 0, streamed (every rank calls it);
    see elixir_tune.engine.io.pretrained."""
    from elixir_tune.engine import save_pretrained as engine_save_pretrained

    return engine_save_pretrained(model, directory, max_shard_size=max_shard_size, dtype=dtype)


def save_checkpoint(path, model, optimizer, step: int, extra: dict | None = None, keep: int | None = 2):
    """Saves a sharded checkpoint as ``path/step-NNNNNN``, keeping the newest ``keep`` (every rank
    calls it); see elixir_tune.engine.io.checkpoint."""
    from elixir_tune.engine import save_checkpoint as engine_save

    return engine_save(path, model, optimizer, step, extra=extra, keep=keep)


def lock_checkpoint_dir(path, model) -> None:
    """Makes this job the only writer of the checkpoint root ``path`` (every rank calls it)."""
    from elixir_tune.engine import lock_checkpoint_dir as engine_lock

    engine_lock(path, model)


def load_checkpoint(path, model, optimizer) -> dict:
    """Restores a checkpoint and returns its meta (``step``, ``extra``); see elixir_tune.engine.io.checkpoint."""
    from elixir_tune.engine import load_checkpoint as engine_load

    return engine_load(path, model, optimizer)


__all__ = [
    "ContractError",
    "NonFiniteError",
    "__version__",
    "data_rank",
    "data_size",
    "load_checkpoint",
    "load_plan",
    "lock_checkpoint_dir",
    "save_checkpoint",
    "save_plan",
    "save_pretrained",
    "setup",
    "validate",
]
