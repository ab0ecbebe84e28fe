"""elixir_tune/integrations/accelerate.py without processes: what it adds to the plan and refuses before setup.
The unchanged Trainer and accelerate scripts themselves run in tests/dropin/test_dropin_libraries.py."""

from __future__ import annotations

import pytest
from torch import nn

from elixir_tune.integrations.accelerate import (
    PrepareError,
    check_engine,
    check_precision,
    prepare_with_plan,
    with_fused_head_read,
)


def _plan_for(model: nn.Module, dtype: str = "fp32"):
    from tests.distributed.engine_plans import make_plan

    return make_plan(model, 1, 4096, dtype=dtype)


def test_trls_fused_head_becomes_the_models_own_read_of_its_head():
    pytest.importorskip("trl", reason="trl is not installed (scripts/test.sh --oldest leaves it out)")
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32
    )
    model = LlamaForCausalLM(config)
    plan = _plan_for(model)
    assert with_fused_head_read(model, plan) is plan  # the class's own forward: the plan as it is
    add_fused_lm_head(model)
    read = with_fused_head_read(model, plan).model.foreign_reads
    assert [(r.module, r.params) for r in read] == [("", ["lm_head.weight"])] and plan.model.foreign_reads == []


@pytest.mark.parametrize(
    "asked,plan_dtype,message",
    [
        ("bf16", "fp32", r"mixed precision 'bf16' .*the plan trains in fp32: set bf16=False and fp16=False, or "
         r"search again with --fix dtype=bf16"),
        ("no", "bf16", r"mixed precision 'no' .*the plan trains in bf16: set bf16=True, or search again with "
         r"--fix dtype=fp32"),
        ("fp16", "fp16", r"accelerate's GradScaler and the engine's own loss scaling would both apply"),
    ],
)  # fmt: skip
def test_accelerates_mixed_precision_must_be_the_plans_dtype(asked, plan_dtype, message):
    check_precision("no", "fp32")
    check_precision("bf16", "bf16")
    with pytest.raises(PrepareError, match=message):
        check_precision(asked, plan_dtype)


def test_a_model_without_its_optimizer_or_two_models_are_refused():
    calls = []
    prepare = prepare_with_plan(lambda self, *args, device_placement=None: calls.append(args) or args)
    with pytest.raises(PrepareError, match="1 model\\(s\\) and 0 optimizer\\(s\\)"):
        prepare(object(), nn.Linear(2, 2))
    with pytest.raises(PrepareError, match="2 model\\(s\\)"):
        prepare(object(), nn.Linear(2, 2), nn.Linear(2, 2))
    assert prepare(object(), [1, 2]) == ([1, 2],) and calls  # no model: accelerate's own prepare


def test_a_peer_plan_is_refused_under_accelerate_with_the_way_that_works():
    check_engine("elixir")
    with pytest.raises(PrepareError, match=r"engine fsdp2, .*elixir-tune export PLAN --to accelerate"):
        check_engine("fsdp2")
