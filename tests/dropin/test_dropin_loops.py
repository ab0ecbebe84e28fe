"""Training loops written for DDP, ported to elixir-run by two lines, against the same loops under DDP.

Each loop runs as written under torchrun (the reference: plain PyTorch, 2 processes, gloo) and
ported under elixir-run with three plans the search wrote (harness.py): the default, one that
releases chunks and one that offloads half. fp32 throughout: losses within 1e-6 relative.

* nanoGPT's style: rank 0 alone evaluates and saves ``raw_model.state_dict()`` (served by the other
  rank, engine/uneven.py), ``torch.nn.utils.clip_grad_norm_``, lr set in ``param_groups``,
  accumulation; its checkpoint loads as its sampling code loads it;
* Hugging Face's style: a cosine warm-up scheduler built before the wrap, ``model.zero_grad()``;
* torchtitan's style (loss outside the model, blocks in a ModuleDict, ``LambdaLR``) and a minimal
  loop whose model returns a bare scalar loss, in one script.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.dropin.harness import HERE, changed_lines, plans, port, relative_gap, run_ddp, run_port
from tests.e2e.launch_helpers import REPO_DIR

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOSS_REL = 1e-6
PLANS = ("default", "released", "offload")
# CI's time budget: the nanoGPT loop runs every plan there; the others run the chunk-releasing plan
# there and all three with `scripts/test.sh --all`.
SOME_PLANS = [pytest.param(plan, marks=[] if plan == "released" else [pytest.mark.heavy]) for plan in PLANS]


def _workdir(tmp_path_factory, name: str, files: list[str]):
    work = tmp_path_factory.mktemp(name)
    for file in files:
        shutil.copy(HERE / file, work / file)
    return work


@pytest.fixture(scope="module")
def nanogpt(tmp_path_factory):
    work = _workdir(tmp_path_factory, "nanogpt", ["nanogpt_model.py", "train_nanogpt_ddp.py"])
    script = port(work / "train_nanogpt_ddp.py", work / "train.py")
    reference = run_ddp(work / "train_nanogpt_ddp.py", ["--out_dir=ddp"], work, "ddp")
    return work, script, reference, plans(work / "nanogpt_model.py", work, 32, 16, 8192)


def test_nanogpt_port_changes_two_lines(nanogpt):
    work, script, _, _ = nanogpt
    assert changed_lines(work / "train_nanogpt_ddp.py", script) == 2


def _sample_path_load(path):
    """nanoGPT's sample.py: the checkpoint's model args, the '_orig_mod.' prefix stripped, strict load."""
    from tests.dropin.nanogpt_model import GPT, GPTConfig

    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    model = GPT(GPTConfig(**checkpoint["model_args"]))
    state = checkpoint["model"]
    for key in list(state):
        if key.startswith("_orig_mod."):
            state[key[len("_orig_mod.") :]] = state.pop(key)
    model.load_state_dict(state)
    model.eval()
    return model, state


@pytest.mark.parametrize("plan", PLANS)
def test_nanogpt_loop_matches_ddp(nanogpt, plan):
    work, script, reference, plan_files = nanogpt
    found = run_port(plan_files[plan], script, [f"--out_dir={plan}"], work, plan)
    assert len(found["losses"]) == len(reference["losses"]) == 21
    assert relative_gap(found["losses"], reference["losses"]) < LOSS_REL
    evals = [value for row in found["evals"] for value in row[1:]]
    assert relative_gap(evals, [value for row in reference["evals"] for value in row[1:]]) < LOSS_REL
    model, state = _sample_path_load(work / plan / "ckpt.pt")
    _, expected = _sample_path_load(work / "ddp" / "ckpt.pt")
    assert state.keys() == expected.keys()
    for name, value in state.items():
        assert torch.isfinite(value).all(), f"{name} is not finite in the checkpoint"
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)
    generated = model.generate(torch.zeros((1, 1), dtype=torch.long), max_new_tokens=5)
    assert generated.shape == (1, 6)


def _resume(work, run: str, saved_by: str, plan=None, max_iters=24) -> dict:
    """nanoGPT's resume: a copy of ``saved_by``'s last checkpoint (iteration 20) trained on to ``max_iters``."""
    out = work / run
    out.mkdir()
    shutil.copy(work / saved_by / "ckpt.pt", out / "ckpt.pt")
    args = ["--init_from=resume", f"--out_dir={run}", f"--max_iters={max_iters}"]
    if plan is None:
        return run_ddp(work / "train_nanogpt_ddp.py", args, work, run)
    return run_port(plan, work / "train.py", args, work, run)


def test_nanogpt_resumes_from_its_own_checkpoint_and_from_a_ddp_one(nanogpt):
    """Rank 0 alone saved ``optimizer.state_dict()`` (torch's form, gathered); every rank loads it into
    the plain optimizer before setup and takes its shard's part: the resumed run trains as DDP's."""
    work, _, _, plan_files = nanogpt
    if not (work / "released" / "ckpt.pt").exists():
        run_port(plan_files["released"], work / "train.py", ["--out_dir=released"], work, "released")
    expected = _resume(work, "ddp-resumed", "ddp")
    assert len(expected["losses"]) == 5  # iterations 20 to 24
    own = _resume(work, "own-resumed", "released", plan_files["released"])
    assert relative_gap(own["losses"], expected["losses"]) < LOSS_REL
    from_ddp = _resume(work, "ddp-to-elixir", "ddp", plan_files["offload"])
    assert relative_gap(from_ddp["losses"], expected["losses"]) < LOSS_REL


@pytest.fixture(scope="module")
def hf_loop(tmp_path_factory):
    work = _workdir(tmp_path_factory, "hf", ["train_hf_ddp.py"])
    script = port(work / "train_hf_ddp.py", work / "train.py")
    model = REPO_DIR / "configs" / "models" / "gpt2-tiny.yaml"
    args = ["--model", str(model)]
    reference = run_ddp(work / "train_hf_ddp.py", [*args, "--out", "ddp"], work, "ddp")
    return work, script, args, reference, plans(model, work, 32, 16, 32768)


@pytest.mark.parametrize("plan", SOME_PLANS)
def test_hf_loop_with_scheduler_built_first_matches_ddp(hf_loop, plan):
    work, script, args, reference, plan_files = hf_loop
    assert changed_lines(work / "train_hf_ddp.py", script) == 2
    found = run_port(plan_files[plan], script, [*args, "--out", plan], work, plan)
    assert found["lrs"] == pytest.approx(reference["lrs"], rel=1e-12, abs=0)
    assert min(reference["lrs"][:3]) > 0  # the warm-up moved the lr the sharded optimizer used
    assert relative_gap(found["losses"], reference["losses"]) < LOSS_REL
    assert relative_gap(found["norms"], reference["norms"]) < 1e-5  # clip_grad_norm_'s returned global norm


@pytest.fixture(scope="module")
def titan_loops(tmp_path_factory):
    work = _workdir(tmp_path_factory, "titan", ["titan_model.py", "train_titan_ddp.py"])
    script = port(work / "train_titan_ddp.py", work / "train.py")
    reference = run_ddp(work / "train_titan_ddp.py", ["--out", "ddp"], work, "ddp")
    return work, script, reference, plans(work / "titan_model.py", work, 32, 8, 8192)


@pytest.mark.parametrize("plan", SOME_PLANS)
def test_titan_style_and_minimal_loops_match_ddp(titan_loops, plan):
    work, script, reference, plan_files = titan_loops
    found = run_port(plan_files[plan], script, ["--out", plan], work, plan)
    for loop in ("titan", "minimal"):
        assert relative_gap(found[loop], reference[loop]) < LOSS_REL, loop


# --- what cannot work ends in one clear line, not in silence or a hang -------------------------------


def _elixir(nanogpt, script_name: str, args: list[str], plan="released", timeout_s=180):
    from tests.e2e.launch_helpers import run_elixir

    work, _, _, plan_files = nanogpt
    if not (work / script_name).exists():
        shutil.copy(HERE / script_name, work / script_name)
    return run_elixir(
        ["--collective-timeout", 8, plan_files[plan], work / script_name, *args], timeout_s=timeout_s, cwd=work
    )


def test_an_unported_ddp_script_is_refused_at_once(nanogpt):
    done = _elixir(nanogpt, "train_nanogpt_ddp.py", ["--out_dir=unported"])
    assert done.returncode != 0
    assert "wraps the model in DistributedDataParallel" in done.stdout + done.stderr
    assert not (nanogpt[0] / "unported" / "record.json").exists()


def test_a_script_that_never_calls_setup_is_named_at_exit(nanogpt):
    (nanogpt[0] / "plain.py").write_text("print('trained without the plan')\n")
    done = _elixir(nanogpt, "plain.py", [])
    assert done.returncode == 0
    assert "never called elixir_tune.setup(model, optimizer), so the plan was not used" in done.stderr


def _trained_reference() -> dict[str, torch.Tensor]:
    """uneven_worker.py's 2 steps in one process: each rank's batch is the same, so DDP's mean is it."""
    from tests.dropin.nanogpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _assert_saved_the_trained_model(path, reference: dict[str, torch.Tensor]) -> None:
    saved = torch.load(path, weights_only=True)
    assert set(saved) == set(reference), set(saved) ^ set(reference)
    worst = max((saved[name] - value).abs().max().item() for name, value in reference.items())
    assert worst < 1e-6, worst


# A DDP script's last acts: rank 0 alone evaluates, samples or saves, while the others wait at a barrier,
# in the group's teardown or at the end of the script. The others serve its gathers there (engine/uneven.py);
# the file holds the trained model, and no rank waits out the collective timeout (8 s here).
# CI's time budget: three endings there (a barrier, accelerate's, a rank-0 sample); with --all also the end of
# the script, the group's teardown alone and model.module(x), whose mechanisms those three share.
LAST_ACTS = [
    pytest.param(case, marks=[] if case in ("save_barrier", "accelerate_save", "generate") else [pytest.mark.heavy])
    for case in ("save_barrier", "save_exit", "save_destroy", "accelerate_save", "generate", "inner_forward")
]


@pytest.mark.parametrize("case", LAST_ACTS)
def test_the_last_act_of_a_ddp_script_is_served_and_saves_the_trained_model(nanogpt, case):
    done = _elixir(nanogpt, "uneven_worker.py", ["--case", case, "--out", f"last-{case}"], timeout_s=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert done.stdout.replace("job finished", "").count("finished") == 2, output[-3000:]
    _assert_saved_the_trained_model(nanogpt[0] / f"last-{case}" / "final.pt", _trained_reference())


@pytest.mark.heavy  # CI time: the same ending on the chunk-releasing plan runs in CI
def test_the_last_save_on_a_plan_that_keeps_every_chunk_gathered(nanogpt):
    done = _elixir(nanogpt, "uneven_worker.py", ["--case", "save_barrier", "--out", "last-default"], plan="default")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    _assert_saved_the_trained_model(nanogpt[0] / "last-default" / "final.pt", _trained_reference())


def test_rank_0_evaluating_alone_before_the_final_barrier_is_served(nanogpt):
    done = _elixir(nanogpt, "uneven_worker.py", ["--case", "end_eval"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.replace("job finished", "").count("finished") == 2


def test_rank_0_training_alone_while_rank_1_waits_at_the_end_is_refused_at_once(nanogpt):
    done = _elixir(nanogpt, "uneven_worker.py", ["--case", "train_alone"])
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "rank 0: a training forward; rank 1: a barrier or the end of the script" in output
    assert "did not come within" not in output and "job finished" not in done.stdout


def test_rank_0_stepping_after_evaluating_alone_is_refused(nanogpt):
    done = _elixir(nanogpt, "uneven_worker.py", ["--case", "step_after_eval"])
    assert done.returncode != 0
    assert "then called optimizer.step(), which needs every rank" in done.stdout + done.stderr
