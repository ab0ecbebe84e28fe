"""gpu_validate.py's step 6: the search's best plan on the three engines through elixir-run.

The plan's engine section is set to fsdp2 and to deepspeed (mapped as ``elixir-tune export`` maps
it: export/peer_plans.on_engine) and trained with the same script as our engine's rows
(engine/peers/ runs it); each row records its step time and its ratio to our engine's.
"""

from __future__ import annotations

import importlib.util
from typing import Any


def run_engines(v: Any, best: dict, model: dict, estimate_s: float) -> None:
    """The search's best plan on FSDP2 and DeepSpeed through elixir-run and the same script
    (engine/peers/): the plan's ``engine`` section set to each, mapped as ``elixir-tune export`` maps it."""
    from elixir_tune.export.peer_plans import on_engine
    from elixir_tune.plan import EngineChoice, load_plan, save_plan
    from elixir_tune.plan.engine_choice import changed_fields

    for name in ("fsdp2", "deepspeed"):
        row = {"name": f"{best['name']}@{name}", "world": best["world"], "engine": name, "shape": best["shape"]}
        v.record["engines"].append(row)
        if name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            row["status"] = "skipped: deepspeed is not installed"
            continue
        plan = on_engine(load_plan(best["plan_path"]), name)
        row["plan_path"] = str(v.work / f"plan-{name}-w{best['world']}.yaml")
        save_plan(plan, row["plan_path"])
        row["engine_settings"] = {"name": name, **changed_fields(plan.engine, EngineChoice())}
        v.train(row, model, estimate_s)
        if row.get("status") == "measured":
            row["vs_elixir"] = row["measured_step_time_s"] / best["measured_step_time_s"]
        v.write()
