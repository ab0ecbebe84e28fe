"""Worker for the pipeline tests: a 4-block GPT-2 (tied embeddings) and a 4-block Llama-style model
trained on a pipeline plan (``parallel.pipeline``) through ``ElixirModel.forward_backward``, compared
with plain PyTorch on the same global batch.

Run by ``engine_launch.py`` as N = stages x data processes. Each case is a dict:

    arch: gpt2 | llama | llama_tied | opt (proj: OPT-350m's projections)     stages     assignment: modular | contiguous
    schedule: looped_bfs | interleaved_1f1b | gpipe | 1f1b     chunk_size     cache ("all" | "min")
    offload (fraction)     checkpoint (every)     accum     steps     clip (max norm, 0: none)
    predict: also the cost model's held gradient bytes for the rank's stage

Rank 0 (stage 0, data index 0) also trains the plain-PyTorch reference (fp32) and reports the largest
differences of the losses, the clipped norms and the weights (``model.state_dict()`` merges every
stage's weights onto it).
"""

from __future__ import annotations

import time

import torch

import elixir_tune
from tests.distributed.engine_archs_worker import arch_config
from tests.distributed.engine_plans import batches, make_plan, param_groups, tiny_gpt2_config
from tests.distributed.engine_worker import (
    compare,
    local_micro,
    mean_over_ranks,
    plain_accumulated_training,
    plain_training,
)

SEQ = 8
MICRO = 2
BLOCKS = 4
BLOCK_LIST = {
    "gpt2": "transformer.h",
    "llama": "model.layers",
    "llama_tied": "model.layers",
    "opt": "model.decoder.layers",
}


META_SEED = 5


def build(case: dict, meta: bool = False):
    """The case's model with 4 blocks (seeded: every rank and the reference build the same weights);
    ``meta``: on the meta device (the engine initializes each rank's shards, seed ``META_SEED``)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        if case["arch"] == "gpt2":
            config = tiny_gpt2_config()
            config.n_layer = BLOCKS
            model = transformers.GPT2LMHeadModel(config)
        elif case["arch"] == "opt":  # tied head, learned positions
            fields = arch_config(dict(arch="opt", tied=True, proj=case.get("proj", False)))
            model = transformers.OPTForCausalLM(transformers.OPTConfig(**dict(fields, num_hidden_layers=BLOCKS)))
        else:
            fields = arch_config(dict(arch="llama", tied=case["arch"] == "llama_tied"))
            config = transformers.LlamaConfig(**dict(fields, num_hidden_layers=BLOCKS))
            model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    return model, opt


def build_reference(case: dict):
    """The plain model the engine is compared with; for a meta case, with the initial weights the
    model's initializer gives for ``META_SEED`` (what the engine made, whatever the world)."""
    model, opt = build(case)
    if case.get("meta"):
        from elixir_tune.engine.io.initializer import Initializer

        meta_model, _ = build(case, meta=True)
        initializer = Initializer(meta_model, META_SEED)
        with torch.no_grad():
            for (_, param), (_, meta_param) in zip(
                model.named_parameters(), meta_model.named_parameters(), strict=True
            ):
                param.copy_(initializer.value(meta_param))
    return model, opt


def case_plan(case: dict, model, world: int):
    return make_plan(
        model,
        world,
        case["chunk_size"],
        cache=case.get("cache", "all"),
        offload=case.get("offload", 0.0),
        checkpoint_every=case.get("checkpoint", 0),
        block_list=BLOCK_LIST[case["arch"]],
        micro_batch_size=MICRO,
        grad_accum_steps=case["accum"],
        seq_len=SEQ,
        stages=case["stages"],
        assignment=case.get("assignment", "modular"),
        schedule=case.get("schedule", "looped_bfs"),
        dtype=case.get("dtype", "fp32"),
    )


def run_engine(case: dict, rank: int, world: int) -> dict:
    model, opt = build(case, meta=case.get("meta", False))
    plan = case_plan(case, model, world)
    model, opt = elixir_tune.setup(model, opt, plan=plan, seed=META_SEED if case.get("meta") else None)
    mesh = model.engine.mesh
    # Parameters of other stages' modules: never materialized on this rank.
    others = [p for group in opt.param_groups for p in group["params"] if id(p) not in model.engine.slot_of]
    others_on_meta = bool(others) and all(p.is_meta for p in others)
    accum = case["accum"]
    data = plan.data_parallel_size
    losses, norms = [], []
    for batch in batches(case["steps"], plan.training.global_batch_size, SEQ):
        micro_batches = [local_micro(batch, mesh.data_rank, data, accum, k) for k in range(accum)]
        before = model.engine.memory_stats()
        loss = model.forward_backward(micro_batches)
        after = model.engine.memory_stats()
        counts = {key: after[key] - before[key] for key in ("gathers", "reduce_scatters")}  # of the last step
        if case.get("clip"):
            norms.append(float(opt.clip_grad_norm(case["clip"])))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    errors = {}
    eval_loss = None
    if case.get("errors"):
        with torch.no_grad():  # forwards only (the schedule's eval), on the first step's batch
            first = batches(1, plan.training.global_batch_size, SEQ)[0]
            eval_loss = float(
                model.forward_backward([local_micro(first, mesh.data_rank, data, accum, k) for k in range(accum)])
            )
        errors = {"call": _error(lambda: model(**micro_batches[0]))}
        with_extra = [dict(b, token_type_ids=torch.zeros_like(b["input_ids"])) for b in micro_batches]
        errors["extra_keys"] = _error(lambda: model.forward_backward(with_extra))
    full = model.state_dict()  # a collective: every rank calls it
    # No-sync's gradients held through a step: the engine's figure (its virtual stages and schedule),
    # what the steps measured, and (predict) the cost model's for this rank's stage.
    held = {
        "report": model.memory_report()["held_grad_bytes"],
        "peak": model.engine.memory_stats()["peak_held_grad_bytes"],
        "predicted": predicted_held_grad_bytes(case, world, mesh.stage) if case.get("predict") else None,
    }
    return {
        "held": held,
        "counts": counts,
        "virtual_chunk_pairs": virtual_chunk_pairs(model.engine, BLOCK_LIST[case["arch"]]),
        "others_on_meta": others_on_meta,
        "errors": errors,
        "eval_loss": eval_loss,
        "losses": losses,
        "norms": norms,
        "state": {k: v.tolist() for k, v in full.items()} if rank == 0 else None,
        "global_batch": plan.training.global_batch_size,
        "stage": mesh.stage,
        "data_rank": mesh.data_rank,
        "chunks": [chunk.id for chunk in model.engine.chunks],
        "shared": [chunk.id for chunk, _ in model.engine.pipeline.shared],
        "elsewhere": sorted(model.engine.pipeline.layout.elsewhere),
    }


def predicted_held_grad_bytes(case: dict, world: int, stage: int) -> int:
    """The cost model's ``held_grad_bytes`` for this stage: the case's model profiled (on the meta
    device), a layered shape of the case's micro-batches, as the search makes pipeline shapes."""
    from elixir_tune.costmodel.model import CostModel, Shape
    from elixir_tune.costmodel.parallel import Layout
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import profile_model
    from elixir_tune.profiler.source import ModelSource

    def example(batch: int, seq: int) -> dict:
        ids = torch.zeros(batch, seq, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    source = ModelSource(
        name=case["arch"], source="engine_pipeline_worker", _build=lambda: build(case)[0], _batch=example
    )
    dtype = case.get("dtype", "fp32")
    profile = profile_model(source, batch_size=MICRO, seq_len=SEQ, dtype=dtype)
    layout = Layout(pipeline=case["stages"], assignment=case.get("assignment", "modular"))
    cost = CostModel(profile, load_hardware("cpu"), gpus_per_node=world, dtype=dtype, layout=layout, stage=stage)
    shape = Shape(case["chunk_size"], 1, 0, 0, case.get("checkpoint", 0), MICRO, case["accum"], layered=True)
    return cost.memory(shape).transient_bytes["held_grad_bytes"]


def virtual_chunk_pairs(engine, block_list: str) -> int:
    """(chunk, virtual stage) pairs of this rank: with no-sync, each is reduce-scattered once per step
    (after the virtual stage's last micro-batch's backward)."""
    from elixir_tune.plan.stages import block_index_of

    pipeline = engine.pipeline
    virtual = pipeline.layout.virtual
    of_block = {block: index for index, (_, blocks) in enumerate(virtual) for block in blocks}
    embeddings = {id(p) for module in pipeline.adapter.first_modules for p in module.parameters()}
    pairs = 0
    for chunk in engine.chunks:
        touched = set()
        for slot in chunk.slots:
            block = block_index_of(slot.name, block_list)
            if block is not None:
                touched.add(of_block[block])
            else:  # embeddings with the first virtual stage (on the last stage: the tied head), the rest last
                touched.add(0 if id(slot.param) in embeddings and pipeline.stage == 0 else len(virtual) - 1)
        pairs += len(touched)
    return pairs


def _error(call) -> str:
    try:
        call()
    except (RuntimeError, ValueError) as error:
        return str(error)
    return ""


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from elixir_tune.profiler.source import quiet_transformers

    start = time.perf_counter()
    with quiet_transformers():
        engine = run_engine(case, rank, world)
    result = {
        "case": case,
        "losses": engine["losses"],
        "world_losses": mean_over_ranks(engine["losses"], world),
        "norms": engine["norms"],
        "stage": engine["stage"],
        "data_rank": engine["data_rank"],
        "chunks": engine["chunks"],
        "shared": engine["shared"],
        "elsewhere": engine["elsewhere"],
        "errors": engine["errors"],
        "others_on_meta": engine["others_on_meta"],
        "counts": engine["counts"],
        "held": engine["held"],
        "virtual_chunk_pairs": engine["virtual_chunk_pairs"],
        "eval_loss": engine["eval_loss"],
        "engine_s": time.perf_counter() - start,
    }
    if rank == 0:
        with quiet_transformers():
            model, opt = build_reference(case)
            reference = plain_training(
                model, opt, batches(case["steps"], engine["global_batch"], SEQ), clip=case.get("clip", 0.0)
            )
            if engine["eval_loss"] is not None:  # the trained reference on the first step's global batch
                with torch.no_grad():
                    first = batches(1, engine["global_batch"], SEQ)[0]
                    result["ref_eval_loss"] = float(model(**first).loss)
            if case.get("control"):  # plain PyTorch against itself, accumulated: the fp32 floor for this case
                model, opt = build_reference(case)
                control = plain_accumulated_training(
                    model,
                    opt,
                    batches(case["steps"], engine["global_batch"], SEQ),
                    case["accum"],
                    case.get("clip", 0.0),
                )
                result["control_weight_abs"] = compare(control, reference, control["losses"])["weight_abs"]
        result.update(compare(engine, reference, result["world_losses"]))
        result["ref_losses"] = reference["losses"]
    return result


if __name__ == "__main__":
    from tests.distributed.engine_launch import worker_main

    worker_main(run_case)
