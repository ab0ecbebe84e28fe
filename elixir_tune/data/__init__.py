"""Fine-tuning data: files read through ``datasets`` (local only), formats, masking, packing, rank shares.

``inspect_data(spec)`` is the cheap preflight (no tokenizer, no torch); ``load_data(spec, tokenizer,
seq_len)`` gives the ``TrainData`` whose ``batch(step, global_batch_size, data_rank, data_size)`` is a
rank's rows of a step. Modules: formats.py (reading, detection, the errors), text.py,
prompt_completion.py, chat.py (the three formats), packing.py (rows), sampling.py (epochs, rank
shares, the eval split), train_data.py (``TrainData``). torch, ``datasets`` and transformers are
imported on first use: importing this package is cheap.
"""

from elixir_tune.data.formats import DataError, DataInfo, DataSpec, inspect_data
from elixir_tune.data.packing import block_causal_mask
from elixir_tune.data.train_data import TrainData, load_data

__all__ = ["DataError", "DataInfo", "DataSpec", "TrainData", "block_causal_mask", "inspect_data", "load_data"]
