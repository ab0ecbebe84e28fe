"""Which module reads which chunks: the map the engine's hooks work from.

A part of ``Engine`` (engine.py), built once with the chunks: each module that reads chunked
parameters (its own, or those the plan's ``model.foreign_reads`` lists) gets hooks; while it runs, its
non-resident chunks and those of its hooked ancestors stay gathered (``chain_chunks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from elixir_tune.engine.chunks.chunk import Chunk, ParamSlot
    from elixir_tune.plan import Plan


class ModuleMap:
    """The hooked modules of a model and the chunks each reads.

    Args:
        model: the user's module.
        plan: the engine's plan (its foreign reads).
        slot_of: id(param) -> its slot, for every chunked parameter.
        named: the model's parameters by name (as the engine found them before it placed them).

    Raises:
        ValueError: the plan's foreign reads name a module or parameter the model does not have.
    """

    def __init__(
        self, model: torch.nn.Module, plan: Plan, slot_of: dict[int, ParamSlot], named: dict[str, torch.nn.Parameter]
    ):
        self.model = model
        self.plan = plan
        self.slot_of = slot_of
        # hooked module -> its name, the non-resident chunks it reads, the slots it reads (model order)
        self.names, self.chunks, self.slots = self._map_modules(named)
        self.order = list(self.names)  # hooked modules by number (what a leader's announcements carry)
        self.index = {module: index for index, module in enumerate(self.order)}
        self.ancestors = self._hooked_ancestors()  # hooked module -> its hooked ancestors, outermost first
        self.sharing_ancestors = self._sharing_ancestors()

    def _map_modules(
        self, named: dict[str, torch.nn.Parameter]
    ) -> tuple[dict[torch.nn.Module, str], dict[torch.nn.Module, list[Chunk]], dict[torch.nn.Module, list[ParamSlot]]]:
        """Each module that reads chunked parameters (its own, or the plan's foreign reads): its name,
        the non-resident chunks it reads and the slots, in model order."""
        module_names: dict[torch.nn.Module, str] = {}
        module_chunks: dict[torch.nn.Module, list[Chunk]] = {}
        module_slots: dict[torch.nn.Module, list[ParamSlot]] = {}
        foreign = self._foreign_slots(named)
        for name, module in self.model.named_modules():
            slots = [self.slot_of[id(p)] for p in module.parameters(recurse=False) if id(p) in self.slot_of]
            owned = {id(slot) for slot in slots}
            slots += [slot for slot in foreign.get(module, []) if id(slot) not in owned]
            if slots:
                chunks = list(dict.fromkeys(slot.chunk for slot in slots))
                module_names[module] = name or "<model>"
                module_chunks[module] = [c for c in chunks if not c.resident]
                module_slots[module] = slots
        return module_names, module_chunks, module_slots

    def _sharing_ancestors(self) -> dict[torch.nn.Module, list[torch.nn.Module]]:
        """Each hooked module's ancestors that share parameters with it."""
        # A module that shares parameters with a running ancestor (it reads them too, or owns what the
        # ancestor reads) must not mark them idle when it returns: the ancestor may read them again.
        slot_ids = {module: {id(slot) for slot in slots} for module, slots in self.slots.items()}
        return {
            module: [a for a in ancestors if slot_ids[a] & slot_ids[module]]
            for module, ancestors in self.ancestors.items()
        }

    def _foreign_slots(self, named: dict[str, torch.nn.Parameter]) -> dict[torch.nn.Module, list[ParamSlot]]:
        """The plan's ``model.foreign_reads``: reading module -> slots of the chunked parameters it reads.

        Raises:
            ValueError: a reading module or parameter the model does not have (a plan for another model).
        """
        out: dict[torch.nn.Module, list[ParamSlot]] = {}
        for read in self.plan.model.foreign_reads:
            try:
                module = self.model.get_submodule(read.module)
            except AttributeError as error:
                raise ValueError(
                    f"the plan's model.foreign_reads names module {read.module!r}, which this model does not have "
                    "(a plan for another model?); search a plan for this model"
                ) from error
            missing = [name for name in read.params if name not in named]
            if missing:
                raise ValueError(
                    f"the plan's model.foreign_reads lists {missing[:3]} for module {read.module!r}, parameters "
                    "this model does not have (a plan for another model?); search a plan for this model"
                )
            # Parameters of another pipeline stage or frozen ones have no slot here: nothing to gather.
            out[module] = [self.slot_of[id(named[name])] for name in read.params if id(named[name]) in self.slot_of]
        return out

    def _hooked_ancestors(self) -> dict[torch.nn.Module, list[torch.nn.Module]]:
        """For each module owning chunked parameters, its ancestors that own some too."""
        ancestors: dict[torch.nn.Module, list[torch.nn.Module]] = {}

        def walk(module: torch.nn.Module, chain: list[torch.nn.Module]) -> None:
            if module in self.chunks:
                ancestors[module] = list(chain)
                chain = chain + [module]
            for child in module.children():
                walk(child, chain)

        walk(self.model, [])
        return ancestors

    def chain_chunks(self, module: torch.nn.Module) -> list[Chunk]:
        """Non-resident chunks a module needs while it runs: its own and its running ancestors'."""
        chunks = list(self.chunks[module])
        for ancestor in self.ancestors.get(module, []):
            chunks += self.chunks[ancestor]
        return list(dict.fromkeys(chunks))

    def check_cache_fits(self, cache_blocks: int) -> None:
        """A module runs inside its ancestors' forward: their chunks stay gathered meanwhile."""
        need = {module: len(self.chain_chunks(module)) for module in self.chunks}
        worst = max(need, key=need.__getitem__, default=None)
        if worst is not None and need[worst] > cache_blocks:
            raise ValueError(
                f"module {self.names[worst]!r} uses {need[worst]} non-resident chunks at once (its own and "
                f"those of the enclosing modules that own parameters) but the plan has memory.cache_blocks="
                f"{cache_blocks}; the minimum for this chunking is {need[worst]}"
            )
