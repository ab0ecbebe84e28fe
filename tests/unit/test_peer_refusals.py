"""What a peer engine's run refuses, with a message, before any process group: a meta-device model,
``weights=``, fp16 on FSDP2, a vocabulary-parallel loss, and the chunk engine's ``model.engine``."""

from __future__ import annotations

import pytest
import torch

from elixir_tune.engine.comm import Comm
from elixir_tune.engine.peers.common import PeerEngineError, PeerModel, PeerRunner, check_peer_arguments
from elixir_tune.plan.engine_choice import EngineChoice
from tests.distributed.engine_plans import make_plan


def _plan(name: str, dtype: str = "fp32"):
    model = torch.nn.Linear(4, 4)
    plan = make_plan(model, 1, 64, dtype=dtype)
    plan.engine = EngineChoice(name=name)  # type: ignore[arg-type]
    return model, plan


def test_meta_models_and_weight_files_are_the_chunk_engines():
    model, plan = _plan("fsdp2")
    with pytest.raises(PeerEngineError, match="real weights"):
        check_peer_arguments(plan, model, "model.safetensors", False)
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    with pytest.raises(PeerEngineError, match="meta-device"):
        check_peer_arguments(plan, meta, None, False)


def test_fsdp2_refuses_fp16_and_vocab_parallel_loss():
    model, plan = _plan("fsdp2", "fp16")
    with pytest.raises(PeerEngineError, match="fp16 needs a loss scaler"):
        check_peer_arguments(plan, model, None, False)
    model, plan = _plan("deepspeed", "fp16")
    check_peer_arguments(plan, model, None, False)  # DeepSpeed keeps its own loss scaler
    with pytest.raises(PeerEngineError, match="vocab_parallel_loss"):
        check_peer_arguments(plan, model, None, True)


def test_model_engine_is_refused_with_what_to_do():
    model, plan = _plan("fsdp2")
    runner = PeerRunner(plan, Comm(0, 1, "local", torch.device("cpu")), model)
    runner.name = "fsdp2"
    wrapped = PeerModel(model, runner)
    with pytest.raises(PeerEngineError, match="not available on engine fsdp2.*model.state_dict"):
        _ = wrapped.engine
    assert wrapped.in_features == 4  # other attributes reach the user's module
