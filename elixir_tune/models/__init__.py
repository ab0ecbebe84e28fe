"""What elixir-tune knows about the models it trains (transformers and PEFT models), shared by the profiler
and the engine: LoRA through PEFT (``lora.py``) and where a PEFT model keeps its base (``lora_layout.py``),
transformers' key/value cache off for training (``kv_cache.py``), where a forward puts its loss
(``model_output.py``), where pipeline stages cut a causal LM (``stage_plans.py``) and a model's tensor table
(``tensor_table.py``, from transformers' plans as ``hf_plans.py`` reads them). Importing the package imports none of them."""
