"""Weights in and out: meta-device materialization (materialize.py, with the
model's own initializer run unit by unit in initializer.py), reading safetensors and Hugging
Face directories into shards (weights.py), Hugging Face output (pretrained.py) and sharded
checkpoints (checkpoint.py, checkpoint_files.py)."""
