"""The pretraining recipe under its old name: ``elixir-run plan.yaml scripts/train_gpt2.py ...`` runs the same as
``elixir-run plan.yaml pretrain ...`` (elixir_tune/recipes/pretrain.py), which works from any directory."""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from elixir_tune.recipes.pretrain import main

if __name__ == "__main__":
    sys.exit(record(main)())
