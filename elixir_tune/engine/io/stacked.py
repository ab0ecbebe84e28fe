"""Expert tensors that a checkpoint stores one per expert: transformers' checkpoint conversions.

A mixture-of-experts model of transformers 5 holds each block's experts fused, in 3-D tensors
(Qwen3-MoE's ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``),
but its checkpoints, the ones on the Hub and the ones ``save_pretrained`` writes, keep one 2-D
tensor per expert and projection (``mlp.experts.3.gate_proj.weight``; Mixtral's ``w1`` / ``w3`` /
``w2`` under ``block_sparse_moe``). Transformers converts between the two with rules it ships per
family (``transformers.conversion_mapping``): ``WeightConverter``s that stack the per-expert tensors
(``MergeModulelist(dim=0)``), then concatenate the parts (``Concatenate(dim=1)``: gate then up),
and ``WeightRenaming``s of name fragments (``.block_sparse_moe.`` -> ``.mlp.``).

``StackRules`` reads those rules from the model, keeping the ones this module can follow (stack
along dimension 0, optionally concatenated along dimension 1; renamings of plain name fragments),
and ``find_stacked`` says which file tensors make up a model tensor. ``Stacked`` then reads any
element range of the fused tensor from the files, expert by expert, so that a rank that holds some
experts (expert parallelism) or some elements (a chunk's shard) reads only theirs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

_PLAIN = re.compile(r"^[\w.]+$")  # a renaming fragment without regex syntax (its dots read as dots)


@dataclass(frozen=True)
class StackRules:
    """The conversions of a model that stack per-expert tensors (see the module docstring).

    Attributes:
        converters: (target fragment, source fragments with ``*`` for the expert index), e.g.
            ``("mlp.experts.gate_up_proj", ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"))``.
        renamings: (checkpoint fragment, model fragment), e.g. ``(".block_sparse_moe.", ".mlp.")``.
    """

    converters: tuple[tuple[str, tuple[str, ...]], ...] = ()
    renamings: tuple[tuple[str, str], ...] = ()


def stack_rules(model: nn.Module) -> StackRules:
    """The stacking conversions transformers ships for ``model``'s family (none for other models)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
    except ImportError:
        return StackRules()
    if not isinstance(model, PreTrainedModel):
        return StackRules()
    converters, renamings = [], []
    for rule in get_model_conversion_mapping(model):
        sources, targets = list(rule.source_patterns), list(rule.target_patterns)
        if isinstance(rule, WeightConverter) and len(targets) == 1:
            ops = [(type(op), getattr(op, "dim", None)) for op in rule.operations]
            if ops in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]) and all(
                "*" in s for s in sources
            ):
                converters.append((targets[0].lstrip("."), tuple(s.lstrip(".") for s in sources)))
        elif isinstance(rule, WeightRenaming) and len(sources) == 1 and len(targets) == 1:
            if _PLAIN.match(sources[0]) and _PLAIN.match(targets[0]):
                renamings.append((sources[0], targets[0]))
    return StackRules(tuple(converters), tuple(renamings))


@dataclass(frozen=True)
class Stacked:
    """A fused expert tensor of ``shape`` ``[E, ...]`` held by the files as one tensor per expert and part.

    Attributes:
        shape: the fused tensor's shape.
        parts: for each expert, the file names of its parts; expert e's block is their concatenation
            along their dimension 0 (the fused tensor's dimension 1).
    """

    shape: tuple[int, ...]
    parts: tuple[tuple[str, ...], ...]

    def file_names(self) -> list[str]:
        return [name for names in self.parts for name in names]

    def experts(self, read: Callable[[str], torch.Tensor], first: int, last: int) -> torch.Tensor:
        """Experts ``[first, last)`` of the fused tensor, as the files store them (stored dtype)."""
        blocks = [torch.cat([read(name) for name in self.parts[e]], dim=0) for e in range(first, last)]
        return torch.stack(blocks) if blocks else torch.empty((0, *self.shape[1:]))

    def read_range(self, read: Callable[[str], torch.Tensor], begin: int, end: int) -> torch.Tensor:
        """Elements ``[begin, end)`` of the fused tensor, flattened, as fp32: only the experts they touch."""
        row = math.prod(self.shape[1:])
        first, last = begin // row, -(-end // row)
        return self.experts(read, first, last).reshape(-1)[begin - first * row : end - first * row].float()

    def read_piece(self, read: Callable[[str], torch.Tensor], runs: list[list[tuple[int, int]]]) -> torch.Tensor:
        """The fused tensor indexed by the product of ``runs`` (``WeightsReader.read_piece``), as fp32:
        only the experts of ``runs[0]`` are read."""
        experts = torch.cat([self.experts(read, begin, end) for begin, end in runs[0]])
        for axis, dim_runs in enumerate(runs[1:], start=1):
            index = torch.cat([torch.arange(begin, end) for begin, end in dim_runs])
            experts = experts.index_select(axis, index)
        return experts.float()


def find_stacked(
    name: str, shape: tuple[int, ...], file_shapes: dict[str, tuple[int, ...]], rules: StackRules
) -> Stacked | None:
    """The per-expert file tensors that make up the model tensor ``name`` of ``shape``, or None.

    Args:
        name: the model tensor's name (a candidate spelling of it: the caller tries prefixes).
        shape: its shape, ``[E, ...]``.
        file_shapes: every tensor the files hold, with its shape.
        rules: the model's stacking conversions (``stack_rules``).

    Returns:
        The fused tensor's parts when every one is in the files and their shapes add up to ``shape``.
    """
    if not shape:
        return None
    for target, sources in rules.converters:
        if not (name == target or name.endswith("." + target)):
            continue
        base = name[: len(name) - len(target)]
        for spelled in dict.fromkeys(
            [base] + [base.replace(model, checkpoint) for checkpoint, model in rules.renamings]
        ):
            parts = tuple(
                tuple(spelled + source.replace("*", str(expert)) for source in sources) for expert in range(shape[0])
            )
            if not all(part in file_shapes for names in parts for part in names):
                continue
            first = [file_shapes[part] for part in parts[0]]
            block = (sum(s[0] for s in first), *first[0][1:])
            same = all([file_shapes[part] for part in names] == first for names in parts)
            if same and all(s[1:] == first[0][1:] for s in first) and block == tuple(shape[1:]):
                return Stacked(tuple(shape), parts)
    return None
