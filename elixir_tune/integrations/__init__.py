"""Training libraries whose unchanged scripts run a plan under elixir-run: transformers' ``Trainer``,
TRL's trainers and plain accelerate loops all prepare their model through accelerate
(``accelerate.py``). Importing the package imports none of them."""
