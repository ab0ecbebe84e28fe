"""Where a causal LM's pipeline stages cut it: the model's stage plan, shared by the profiler and the engine.

A stage plan is the base model's top-level modules in the order its ``forward`` runs them, each with
the names of its inputs and outputs, in the format of transformers' ``config.base_model_pp_plan``::

    {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
     "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
     "norm": (["hidden_states"], ["hidden_states"])}

The repeated blocks are the one ``ModuleList`` among them; the modules before it run on the first
stage, those after it (and the causal LM's ``lm_head``) on the last. Transformers ships the plan for
most decoder families (``base_model_pp_plan`` on the config class, kept by the people who write the
models); for a family that ships none, ``HAND_PLANS`` holds ours in the same format (GPT-2, OPT).
``pipeline_problem`` says why a model cannot run pipeline stages (None: it can): the profiler records
it in the profile, and the engine refuses with the same sentence. Imports no torch (it reads the
model's attributes only), so that both sides can import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from elixir_tune.models.lora_layout import peft_base

# Our plans for families whose transformers config ships no base_model_pp_plan: (base module of the
# causal LM, its modules in forward order). A module that a configuration may leave out (OPT's
# projections, present only when word_embed_proj_dim differs from hidden_size) is optional.
HAND_PLANS: dict[str, tuple[str, dict[str, tuple[list[str], list[str]]]]] = {
    "gpt2": ("transformer", {
        "wte": (["input_ids"], ["inputs_embeds"]),
        "wpe": (["position_ids"], ["position_embeds"]),
        "drop": (["hidden_states"], ["hidden_states"]),
        "h": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "ln_f": (["hidden_states"], ["hidden_states"]),
    }),
    "opt": ("model.decoder", {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "embed_positions": (["attention_mask", "position_ids"], ["pos_embeds"]),
        "project_in": (["inputs_embeds"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "final_layer_norm": (["hidden_states"], ["hidden_states"]),
        "project_out": (["hidden_states"], ["hidden_states"]),
    }),
}  # fmt: skip
OPTIONAL_MODULES = {"opt": {"project_in", "project_out", "final_layer_norm"}}


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """A causal LM's pipeline cut points, resolved against the model.

    Attributes:
        source: where the plan comes from ("transformers base_model_pp_plan" or "elixir-tune table").
        body: dotted path of the base model whose ``forward`` runs the modules ("model", "transformer").
        first: names (under ``body``) of the modules before the blocks, in order.
        blocks: name (under ``body``) of the blocks' ``ModuleList``.
        last: names (under ``body``) of the modules after the blocks, in order (``lm_head`` follows them).
        io: module name -> (input names, output names), as the plan gives them.
    """

    source: str
    body: str
    first: tuple[str, ...]
    blocks: str
    last: tuple[str, ...]
    io: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]

    @property
    def block_list(self) -> str:
        """The blocks' dotted path from the causal LM (the plan's ``model.block_list``)."""
        return f"{self.body}.{self.blocks}" if self.body else self.blocks


def _raw_plan(model: Any) -> tuple[str, str, dict] | None:
    """(source, body path, plan) of ``model``: transformers' plan first, then ours."""
    config = getattr(model, "config", None)
    plan = getattr(type(config), "base_model_pp_plan", None) or getattr(config, "base_model_pp_plan", None)
    if plan:
        return "transformers base_model_pp_plan", str(getattr(model, "base_model_prefix", "") or ""), dict(plan)
    hand = HAND_PLANS.get(str(getattr(config, "model_type", "")))
    if hand is not None:
        return "elixir-tune table", hand[0], hand[1]
    return None


def _submodule(root: Any, path: str) -> Any:
    module = root
    for part in path.split(".") if path else ():
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _is_module_list(module: Any) -> bool:
    return type(module).__name__ == "ModuleList" or any(
        klass.__name__ == "ModuleList" for klass in type(module).__mro__
    )


def resolve_stage_plan(model: Any) -> StagePlan | str:
    """The model's stage plan, or the reason it has none that the engine can run.

    Args:
        model: an ``nn.Module`` (a transformers causal LM for a plan to exist).

    Returns:
        A ``StagePlan``, or one sentence saying what stands in the way.
    """
    base, prefix = peft_base(model)
    if prefix:  # a PEFT (LoRA) model: the wrapped causal LM's plan, under the PEFT model's path to it
        inner = resolve_stage_plan(base)
        if isinstance(inner, str):
            return inner
        return dataclasses.replace(inner, body=f"{prefix}{inner.body}" if inner.body else prefix.rstrip("."))
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", "") or "")
    what = f"model type {model_type!r}" if model_type else f"{type(model).__name__} (no transformers config)"
    raw = _raw_plan(model)
    if raw is None:
        return (
            f"{what} has no pipeline plan: its transformers config ships no base_model_pp_plan and elixir-tune "
            f"has no table for it (ours: {', '.join(sorted(HAND_PLANS))})"
        )
    source, body_path, plan = raw
    if not hasattr(model, "lm_head"):
        return f"pipeline stages run {model_type} causal LMs (with an lm_head) only; this is {type(model).__name__}"
    body = _submodule(model, body_path)
    if body is None:
        return f"{what}'s pipeline plan ({source}) names the base model {body_path!r}, which this model lacks"
    optional = OPTIONAL_MODULES.get(model_type, set())
    present = [name for name in plan if getattr(body, name, None) is not None]
    missing = [name for name in plan if name not in present and name not in optional]
    if missing:
        return f"{what}'s pipeline plan ({source}) names modules this model lacks: {', '.join(missing)}"
    lists = [name for name in present if _is_module_list(getattr(body, name))]
    if len(lists) != 1:
        return f"{what}'s pipeline plan ({source}) has {len(lists)} block lists ({lists}); stages need one"
    blocks = lists[0]
    split = present.index(blocks)
    io = {name: (tuple(plan[name][0]), tuple(plan[name][1])) for name in present}
    stage_plan = StagePlan(source, body_path, tuple(present[:split]), blocks, tuple(present[split + 1 :]), io)
    return _forward_problem(model, config, what, stage_plan) or stage_plan


def _forward_problem(model: Any, config: Any, what: str, stage_plan: StagePlan) -> str | None:
    """What in the model's forward a split into stages would change (None: nothing)."""
    if getattr(config, "output_router_logits", False):
        return (
            f"{what} adds the routers' auxiliary loss (config.output_router_logits), a sum over every block's "
            "router that a pipeline splits over stages; set output_router_logits False to train it on stages"
        )
    if float(getattr(config, "layerdrop", 0.0) or 0.0) > 0:
        return f"{what} drops blocks at random (config.layerdrop {config.layerdrop}), which stages cannot follow"
    prefix = f"{stage_plan.body}." if stage_plan.body else ""
    placed = [f"{prefix}{name}." for name in (*stage_plan.first, stage_plan.blocks, *stage_plan.last)]
    outside = [
        name
        for name, _ in model.named_parameters()
        if not name.startswith("lm_head.") and not any(name.startswith(p) for p in placed)
    ]
    if outside:
        return (
            f"{what} has parameters outside its pipeline plan's modules ({', '.join(outside[:3])}"
            f"{', ...' if len(outside) > 3 else ''}), so no stage would run them"
        )
    return None


def pipeline_problem(model: Any) -> str | None:
    """Why ``model`` cannot run on pipeline stages (None: it can): the sentence the profiler records in
    ``unsupported_layouts["pipeline"]`` and the engine raises."""
    plan = resolve_stage_plan(model)
    return plan if isinstance(plan, str) else None
