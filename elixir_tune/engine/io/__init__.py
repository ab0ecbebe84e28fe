"""Weights in and out: meta-device materialization (materialize.py), reading safetensors and Hugging
Face directories into shards (weights.py), Hugging Face output (pretrained.py) and sharded
checkpoints (checkpoint.py, checkpoint_files.py)."""
