"""Worker for the pipeline shape tests: a tiny Qwen2 causal LM (tied head) of 2 to 5 blocks on 2 or 3
pipeline stages, every assignment and schedule plan validation accepts, trained 2 steps through
``model.forward_backward`` and compared with plain PyTorch on the same global batch.

Run by ``engine_launch.py`` on one world for every case; a case whose stages do not divide the world
is skipped on every rank alike. Each case is a dict:

    blocks     stages     assignment: modular | contiguous
    schedule: looped_bfs | interleaved_1f1b | gpipe | 1f1b     accum (micro-batches per step)

Rank 0 also trains the plain-PyTorch reference (fp32; once per model and global batch) and reports
the largest differences of the losses and the weights (``model.state_dict()`` merges every stage's
weights onto it).
"""

from __future__ import annotations

import torch

import elixir_tune
from tests.distributed.engine_plans import VOCAB, batches, make_plan, param_groups
from tests.distributed.engine_worker import compare, local_micro, mean_over_ranks, plain_training

SEQ = 8
MICRO = 2
STEPS = 2
BLOCK_LIST = "model.layers"
# Plain PyTorch's run per (blocks, global batch size): the cases of one model and batch (assignments,
# schedules) share it; the reference does not depend on the pipeline shape.
_REFERENCES: dict[tuple[int, int], dict] = {}


def build(blocks: int):
    """A tiny tied Qwen2 of ``blocks`` blocks (seeded: every rank and the reference build the same weights)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=blocks,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        use_cache=False,
    )
    model = transformers.Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.profiler.source import quiet_transformers

    if world % case["stages"]:
        return {"case": case, "skipped": True}
    with quiet_transformers():
        model, opt = build(case["blocks"])
        plan = make_plan(
            model,
            world,
            4096,
            block_list=BLOCK_LIST,
            micro_batch_size=MICRO,
            grad_accum_steps=case["accum"],
            seq_len=SEQ,
            stages=case["stages"],
            assignment=case["assignment"],
            schedule=case["schedule"],
        )
        model, opt = elixir_tune.setup(model, opt, plan=plan)
        mesh = model.engine.mesh
        data = plan.data_parallel_size
        accum = case["accum"]
        global_batches = batches(STEPS, plan.training.global_batch_size, SEQ)
        losses = []
        for batch in global_batches:
            loss = model.forward_backward([local_micro(batch, mesh.data_rank, data, accum, k) for k in range(accum)])
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        refused = ""
        if case["schedule"] == "1f1b":  # fewer micro-batches than stages: refused before any communication
            try:
                model.forward_backward([local_micro(batch, mesh.data_rank, data, accum, 0)])
            except ValueError as error:
                refused = str(error)
        state = model.state_dict()
    pipeline = model.engine.pipeline
    result = {
        "case": case,
        "skipped": False,
        "stage": mesh.stage,
        "data_rank": mesh.data_rank,
        "virtual": [blocks for stage, blocks in pipeline.layout.virtual if stage == mesh.stage],
        "losses": losses,
        "refused": refused,
        "world_losses": mean_over_ranks(losses, world),
    }
    if rank == 0:
        key = (case["blocks"], plan.training.global_batch_size)
        if key not in _REFERENCES:
            with quiet_transformers():
                reference_model, reference_opt = build(case["blocks"])
                _REFERENCES[key] = plain_training(reference_model, reference_opt, global_batches)
        reference = _REFERENCES[key]
        engine = {"state": {k: v.tolist() for k, v in state.items()}, "norms": []}
        result.update(compare(engine, reference, result["world_losses"]))
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
