"""elixir-tune: auto-tuned chunk-based sharding and CPU offload for training large models.

The public API is small and imports torch only when used:

    import elixir_tune
    plan = elixir_tune.load_plan("plan.yaml")
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
"""

__version__ = "0.1.0"

from elixir_tune.plan import load_plan, save_plan, validate  # noqa: E402  (torch-free)


def setup(model, optimizer, plan=None):
    """Shards ``model`` and ``optimizer`` as the plan says; see elixir_tune.engine.setup."""
    from elixir_tune.engine import setup as engine_setup

    return engine_setup(model, optimizer, plan=plan)


__all__ = ["__version__", "load_plan", "save_plan", "setup", "validate"]
