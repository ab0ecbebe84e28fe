"""Each engine's own configuration from a plan (``elixir-tune export``): DeepSpeed's ``ds_config.json``,
an FSDP2 setup file, an accelerate config; each says what of the plan it cannot express. Imports no torch."""
