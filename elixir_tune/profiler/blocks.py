"""The model's repeated blocks and activation checkpointing around them."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from elixir_tune.selective_checkpoint import selective_context


def find_block_list(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """Finds the repeated blocks: the largest ModuleList whose items all have one type.

    A ModuleDict keyed "0", "1", ... in order (torchtitan's ``model.layers``) counts as a list too: its
    parameters are named ``layers.<i>.…`` as a ModuleList's are, which is what the plan's block indices
    (``plan.stages.block_index_of``) read. A ModuleDict with other keys is no block list.

    Args:
        model: the model.

    Returns:
        (dotted path, blocks); ("", []) when the model has no such list. Ties in length go to
        the list holding more parameters.
    """
    best: tuple[int, int, str, list[nn.Module]] = (0, 0, "", [])
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleDict):
            if list(module.keys()) != [str(index) for index in range(len(module))]:
                continue
        elif not isinstance(module, nn.ModuleList):
            continue
        if len(module) == 0:
            continue
        items = list(module.values()) if isinstance(module, nn.ModuleDict) else list(module)
        if len({type(item) for item in items}) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if (len(items), numel) > best[:2]:
            best = (len(items), numel, name, items)
    return best[2], best[3]


@contextlib.contextmanager
def checkpointed(
    blocks: list[nn.Module],
    around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    selective: bool = False,
) -> Iterator[None]:
    """Wraps each block's forward in non-reentrant activation checkpointing while inside.

    Module hooks stay outside the checkpoint (they run in ``__call__``), so the hooks of modules
    inside a block fire again when backward recomputes it.

    Args:
        blocks: the blocks to checkpoint.
        around: a context entered around every run of a block's forward, the recomputation in
            backward included (modes active in forward are not active in backward otherwise).
        selective: torchtitan's per-op policy, as the engine runs it (``elixir_tune.selective_checkpoint``).
    """
    originals = []
    for block in blocks:
        originals.append(block.__dict__.get("forward"))
        block.forward = functools.partial(_checkpointed_forward, block.forward, around, selective)
    try:
        yield
    finally:
        for block, original in zip(blocks, originals, strict=True):
            if original is None:
                del block.forward
            else:
                block.forward = original


def _checkpointed_forward(forward, around, selective, *args, **kwargs):
    def run(*args, **kwargs):
        with around():
            return forward(*args, **kwargs)

    # Whole blocks are recomputed, as the engine does: early stopping would end a recomputation
    # halfway and skip the forward hooks of the modules after the stop.
    early_stop = getattr(torch_checkpoint, "set_checkpoint_early_stop", None)
    with early_stop(False) if early_stop is not None else contextlib.nullcontext():
        context = {"context_fn": selective_context} if selective else {}
        return torch_checkpoint.checkpoint(run, *args, use_reentrant=False, **context, **kwargs)
