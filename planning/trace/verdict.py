"""The trace beside the analytic plan (issue 78, item 3): each role's traced peak by category printed under the
estimate's, the categories where they differ by more than a tenth named, the step's time at the declared device's
dense peak (the role reports it: planning/trace/role.py), and a layout whose traced peak exceeds what a rank may use
refused, naming the category that overflows. It reads the roles' figures and the point's plan, not the config.

The two count the same things under other names: the estimate's `runtime` holds the reduction buffer of data
parallelism (the trace's communication buffers, and FSDP's gathered copies that it counts as parameters while they
are registered), and on a GPU the estimate's activations and gradients are not alive at once (the caching allocator
gives the one's blocks to the other), which the trace sees as it happens. The trace's peak is live bytes: a GPU
adds its allocator's fragmentation and the CUDA context on top, a few percent and about a GB.
"""
from __future__ import annotations

from typing import Optional

import time

from common.problem import Found, Problem

GB = 2**30
DIFFERS = 0.10  # a category whose trace and estimate differ by more than this share of the larger is named
# the estimate's fields under the trace's categories (the estimate keeps no communication of its own: its runtime
# holds the reduction buffer, and a CPU rank's process itself)
ESTIMATED = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer",
             "activations": "activations", "temporaries": "temporaries", "communication": "runtime"}


def role_name(role: dict) -> str:
    """A rank by its pipeline stages (its rank alone without a pipeline)."""
    if role["sizes"]["pp"] == 1:
        return f"rank {role['rank']}"
    return f"rank {role['rank']} (stage {','.join(map(str, role['stage_ids']))})"


def differing(role: dict, estimate) -> list[str]:
    """The categories of the role's peak that differ from the estimate's by more than DIFFERS, with both figures."""
    said = []
    for category, field in ESTIMATED.items():
        traced, estimated = role["category_peaks"][category], getattr(estimate, field)
        larger = max(traced, estimated)
        if larger >= GB / 100 and abs(traced - estimated) > DIFFERS * larger:  # under 10 MB: noise, not a category
            said.append(f"{category} traced {traced / GB:,.2f}, estimated {estimated / GB:,.2f}")
    return said


def lines(roles: list[dict], plan, seconds: float) -> list[str]:
    """What the plan prints of the trace: a line per role, then what differs from the estimate (plan: the point's,
    planning/plan.py)."""
    of = f" of {plan.rank_limit / GB:,.1f} GB ({plan.rank_limit_where})" if plan.rank_limit else ""
    out = [f"trace (plan.trace=true): one step of {len(roles)} rank role(s) on fake tensors and a fake process group "
           f"of {roles[0]['world_size']} ranks, through the run's own code ({seconds:,.0f} s)"]
    for role in roles:
        cats = ", ".join(f"{k} {v / GB:,.2f}" for k, v in role["by_category"].items() if v)
        out.append(f"  {role_name(role)}: peak {role['peak_bytes'] / GB:,.2f} GB{of} ({cats}); "
                   f"{role['flops'] / 1e12:,.1f} TFLOP a step; checkpoint {role['checkpoint_bytes'] / GB:,.2f} GB")
        if role.get("step_floor"):
            out.append(f"    step: {role['step_floor']}")
        collectives = ", ".join(f"{c['kind']} over {c['group']} x{c['count']} ({c['bytes'] / GB:,.2f} GB)"
                                for c in role["collectives"] if c["group"] != "world")
        if collectives:
            out.append(f"    collectives: {collectives}")
        apart = differing(role, plan.rank)
        if apart:
            out.append(f"    differs from the estimate by more than {DIFFERS:.0%} (GB): {'; '.join(apart)}")
        out += [f"    note: {note}" for note in role["notes"]]
    if plan.rank_limit:
        worst = max(r["peak_bytes"] for r in roles)
        over = f"; the estimate, {plan.rank.total / GB:,.2f} GB, would have refused it" \
            if plan.rank.total > plan.rank_limit else ""
        out.append(f"  fits: the traced peak {worst / GB:,.2f} GB of the {plan.rank_limit / GB:,.1f} GB a rank may use"
                   f"{over}")
    return out


def problems(roles: list[dict], plan, fixes: list[str]) -> list[Problem]:
    """The role whose traced peak exceeds what a rank may use, with the category that overflows (the largest at
    the peak) and the fixes."""
    if not plan.rank_limit:
        return []
    worst = max(roles, key=lambda r: r["peak_bytes"])
    if worst["peak_bytes"] <= plan.rank_limit:
        return []
    sizes = worst["sizes"]
    category, held = max(worst["by_category"].items(), key=lambda kv: kv[1])
    cats = ", ".join(f"{k} {v / GB:,.2f}" for k, v in worst["by_category"].items() if v)
    return [Problem("parallel", f"dp{sizes['dp']} hp{sizes['hp']} pp{sizes['pp']}",
                    f"the traced peak of {role_name(worst)}, {worst['peak_bytes'] / GB:,.2f} GB ({cats}), exceeds "
                    f"the {plan.rank_limit / GB:,.1f} GB a rank may use ({plan.rank_limit_where}); {category} "
                    f"overflow it most ({held / GB:,.2f} GB at the peak)", "; ".join(fixes))]


def traced(cfg, plan) -> Found:
    """plan.trace=true, validation's last check (orchestrator/config/validate.py: before anything is written, the
    command's pre-check included): each rank role's step traced in a process of its own, from the resolved config
    as a stage's process reads its own; the refusal where a role's traced peak exceeds what a rank may use (with
    the fixes a refusal by the estimate offers), else the plan's lines on the trace (Found.facts)."""
    from omegaconf import OmegaConf

    from planning.plan import layout_fixes
    from planning.trace.roles import trace_roles

    started = time.perf_counter()
    roles = trace_roles(OmegaConf.to_yaml(cfg, resolve=True))
    refused = problems(roles, plan, layout_fixes(cfg, plan, max(r["peak_bytes"] for r in roles)))
    return Found(refused) if refused else Found(facts=lines(roles, plan, time.perf_counter() - started))
