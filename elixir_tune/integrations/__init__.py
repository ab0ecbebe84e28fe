"""Training libraries whose unchanged scripts run a plan under elixir-run: transformers' ``Trainer`` and
plain accelerate loops prepare their model through accelerate (``accelerate.py``; TRL's fused LM head
is refused there). Importing the package imports none of them."""
