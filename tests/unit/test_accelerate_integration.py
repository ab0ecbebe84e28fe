"""elixir_tune/integrations/accelerate.py without processes: the refusals it makes before any setup.
The unchanged Trainer and accelerate scripts themselves run in tests/dropin/test_dropin_libraries.py."""

from __future__ import annotations

import types

import pytest
from torch import nn

from elixir_tune.integrations.accelerate import PrepareError, prepare_with_plan, refuse_patched_head


def test_a_forward_patched_with_trls_fused_head_is_refused():
    model = nn.Linear(2, 2)
    refuse_patched_head(model)  # the class's own forward: fine

    def _fused_forward(self, *args, fused_lm_head=False, **kwargs):  # the name TRL's add_fused_lm_head gives it
        return None

    model.forward = types.MethodType(_fused_forward, model)
    with pytest.raises(PrepareError, match="TRL's fused LM head"):
        refuse_patched_head(model)


def test_a_model_without_its_optimizer_or_two_models_are_refused():
    calls = []
    prepare = prepare_with_plan(lambda self, *args, device_placement=None: calls.append(args) or args)
    with pytest.raises(PrepareError, match="1 model\\(s\\) and 0 optimizer\\(s\\)"):
        prepare(object(), nn.Linear(2, 2))
    with pytest.raises(PrepareError, match="2 model\\(s\\)"):
        prepare(object(), nn.Linear(2, 2), nn.Linear(2, 2))
    assert prepare(object(), [1, 2]) == ([1, 2],) and calls  # no model: accelerate's own prepare
