"""The fine-tuning recipe under its old name: ``elixir-run plan.yaml scripts/finetune.py ...`` runs the same as
``elixir-run plan.yaml finetune ...`` (elixir_tune/recipes/finetune.py), which works from any directory and
checks its inputs before any worker starts."""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from elixir_tune.recipes.finetune import main

if __name__ == "__main__":
    sys.exit(record(main)())
