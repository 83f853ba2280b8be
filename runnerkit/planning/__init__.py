"""Memory planning: what a request needs of the device and the host, estimated before anything loads, and the
offload config that fits it (docs/memory_plan.md).

    fit.py             a family's estimate (`MemoryEstimate`: module footprints, per-stage activations) -> the
                       peak on the device and the host memory under an offload config; `MemoryFitError`
    host_advice.py     what a refusal over the host (or pinned) limit advises: only settings the config accepts
    workspaces.py      kernel workspaces and element sizes every family's estimate shares (SDPA, convolutions)
    offload_checks.py  offload keys judged against the family's modules before loading (`resident_modules`,
                       `keep_across_stages`)
    ladder.py          the candidate offload configs, measured and judged against the limits (pure functions)
    compute.py         the time model's compute side: device peaks, a family's FLOPs -> seconds per step
    report.py          what a plan says: per module placement, bytes and copies, the log line, the profile's
                       `memory_plan`, the refusal
    planner.py         `plan_offload`: the fastest candidate that fits (`offload.mode` auto)
    checks.py          `MemoryChecks`, the object a runner holds (`runner.memory_checks`): the run's device
                       budget, the plan before loading, and the fit check of each shape and request

Everything here but checks.py is a function of estimates, configs and limits; checks.py asks the runner for
the family's estimate through its hooks (`estimate_memory`, `denoise_flops`, `plan_steps_per_request`,
`estimate_sources`, declared on `DefaultRunner`).
"""
