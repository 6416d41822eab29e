"""The ops/ kernels as explicit Inductor fallbacks, registered before any build that compiles them.

Why: Inductor has no lowering for a custom op, so the first time a build meets one it creates an
"implicit fallback" for it, and torch 2.11 (the GPU machine's) formats a log line for that at once, logged
or not: `operator_str` prints every argument's IR, and an argument's IR prints its inputs' IR in turn, a
DAG written out as a tree. At full size, with custom ops first met deep in the step, that is what the
whole-step build did for minutes: a build of one bucket was still lowering when stopped at 7 minutes,
and every stack sample of another from minute 2 to minute 10 sat in `ir.py`'s `__str__` under
`operator_str`. With the ops registered here first, each is already in `lowerings`, the implicit path
never runs, and the same build took 71 s (docs/performance.md). torch 2.13 defers the string (a LazyString).
The ops of the model's own modules (nemo_duplex::nucleus_draw) are registered when those modules are
imported, which a model to compile has been; the ops/ kernels are imported here.
The layout constraint is the one the implicit path would take (the op's tag, else the default tag), so
what Inductor builds is unchanged.
"""
from __future__ import annotations

import torch

NAMESPACE = "nemo_duplex"


def custom_ops(namespace: str = NAMESPACE) -> list[torch._ops.OpOverload]:
    """Every overload registered under `namespace` (the modules that define them must be imported)."""
    packets = sorted({name.split("::", 1)[1].split(".", 1)[0] for name in torch._C._dispatch_get_all_op_names()
                      if name.startswith(namespace + "::")})
    ns = getattr(torch.ops, namespace)
    return [getattr(getattr(ns, p), o) for p in packets for o in getattr(ns, p).overloads()]


def register_inductor_fallbacks(namespace: str = NAMESPACE) -> list[torch._ops.OpOverload]:
    """Register each custom op of `namespace` that Inductor has no lowering for; returns those registered."""
    import importlib
    import pkgutil

    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    import ops

    for module in pkgutil.iter_modules(ops.__path__):   # every kernel's custom op defined
        importlib.import_module(f"ops.{module.name}")

    registered = []
    for op in custom_ops(namespace):
        if op in lowering.lowerings:
            continue
        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        lowering.make_fallback(op, layout_constraint=constraint, warn=False)
        registered.append(op)
    return registered
