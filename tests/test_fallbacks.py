"""graphs/fallbacks.py: every ops/ custom op is an explicit Inductor fallback before a build, so Inductor
never takes the implicit-fallback path, whose argument string (every input's IR, recursively) torch 2.11
builds whether it is logged or not: the full-size whole-step build spent minutes in it (its stack
samples) and took 71 s once the ops were registered."""
import logging

import pytest
import torch

from graphs.fallbacks import custom_ops, register_inductor_fallbacks


def test_every_custom_op_is_registered_with_the_implicit_paths_layout():
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    register_inductor_fallbacks()
    ops = custom_ops()
    names = {op.name() for op in ops}
    # some of the kernels the step calls, and the sampler's draw
    assert {"nemo_duplex::mamba_step", "nemo_duplex::decode_attention", "nemo_duplex::bounded_attention_store",
            "nemo_duplex::rms_norm_rope_qk_store", "nemo_duplex::nucleus_draw", "nemo_duplex::fp16x3_linear"} <= names
    for op in ops:
        assert op in lowering.lowerings, op
        expected = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        assert lowering._maybe_layout_constraints.get(op) is expected, op
    assert register_inductor_fallbacks() == []   # a second call registers nothing


@torch.no_grad()
@pytest.mark.triton_interpret   # the ops' kernels on the CPU (their custom ops call them)
def test_inductor_never_formats_an_implicit_fallback(monkeypatch):
    """Inductor (CPU) compiles a function calling custom ops, with the log line that formats an implicit
    fallback's arguments switched on (torch 2.13 formats it only then; 2.11 always): once the ops are
    registered, the string is never built. Without the registration this test fails (the string is
    built for the first use of each op)."""
    import torch._inductor.exc as exc

    from ops.activation import relu_square_op
    from ops.rmsnorm import rms_norm_op

    formatted = []

    def recording_operator_str(target, args, kwargs):
        formatted.append(str(target))
        return f"target: {target}"
    monkeypatch.setattr(exc.OperatorIssue, "operator_str", staticmethod(recording_operator_str))
    class Formatting(logging.Handler):   # writes every record out, as a log at INFO would
        def emit(self, record):
            record.getMessage()
    logger, handler = logging.getLogger("torch._inductor.graph"), Formatting()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "propagate", False)
    register_inductor_fallbacks()

    def f(x, w):
        return relu_square_op(rms_norm_op(x * 2 + 1, w, 1e-6, 0.0, None, None, None, None)) - x

    x, w = torch.randn(4, 32), torch.randn(32)
    torch._dynamo.reset()
    try:   # no cache: a build loaded from Inductor's cache lowers nothing
        with torch._inductor.config.patch(force_disable_caches=True):
            got = torch.compile(f, fullgraph=True, backend="inductor")(x, w)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    torch.testing.assert_close(got, f(x, w), rtol=1e-5, atol=1e-5)
    assert formatted == [], formatted


def test_an_empty_namespace_registers_nothing():
    namespace = "nemo_duplex_nothing_here"
    assert custom_ops(namespace) == [] and register_inductor_fallbacks(namespace) == []
