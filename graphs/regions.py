"""Regional compilation: Inductor fusion for the step's pure, small-op-heavy pieces, inside the hand capture.

Why: the whole frame step compiled by Inductor builds in ~70 s per bucket at full size and runs slower
than the hand capture (graphs/capture.py), while most of the step is already one kernel per op (ops/).
What is left of the small kernels sits in a few fixed-size pieces that do not depend on the layer counts
(scripts/dev/census_step.py): the talker's MoG passes with their residual quantisation (~500 ops in torch, 176
with the trunk's joints, the stacked heads and the latent draw as kernels) and the RNN-T's unrolled symbol
loop (~260, now 182). Those are pure functions of their inputs (no state pools), so each is
compiled on its own, `fullgraph=True`, and the step around them is captured by hand as before
(`cudagraph-regions`).

Batch sizes: the first call compiles for its shape; the second shape makes the batch dimension dynamic
(torch.compile's automatic dynamic shapes), so a set of capture buckets costs about three compiles per
region (the largest bucket, the dynamic graph, and bucket 1, which is specialised), not one per bucket.

Numerics: at full size in bf16 the step with these regions does not reproduce the plain step: on the H200
the talker's codes differed at the first frame for 5 of 8 calls (tests/test_graphs.py, the full-size GPU
test; the text is computed before any region and its margins there were 0.47-0.63, so the codes, from the
MoG region, are what differed). The same happens on the CPU with the tiny model in bf16 (codes differed
in 51 of 120 rows over 20 frames; 24 with Inductor's `emulate_precision_casts`), so it is the compiled
arithmetic, not the capture: Inductor fuses the region's bf16 ops (keeping some intermediates in fp32
that eager rounds, and its own exp/erf and reduction order), and the residual quantisation then picks
other codes where the nearest codewords are close. Measured on the CPU (tiny, bf16, 20 frames x 6 calls):
at the first codebook that differs in a row, eager's gap between the two nearest codewords (relative to
|r| max|e|) had a median of 2.8e-3, the 3rd percentile of all codebooks' gaps (median 7e-2), but reached
8.8e-2: most flips are RVQ near-ties, some are not, most likely a different mixture component chosen
where the Gumbel-max was close. A GPU criterion for codes would need both margins; until then the
plain capture is what serves.
The regions are ~1 ms per step faster (docs/performance.md); the serving default stays the plain capture.

A region whose compilation fails logs why and runs eagerly from then on: a compiler bug costs speed, not
the server. Regions are installed on the model instance (the compiled callable shadows the method), so
the model's code stays plain and `remove_regions` restores it.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from graphs.fallbacks import register_inductor_fallbacks

log = logging.getLogger(__name__)

# (path to the module from the model, method): the pure pieces compiled on their own
REGIONS = (("talker", "generate_step"), ("stt_model.rnnt_decoder", "decode_frame"))


class _Region:
    """A method compiled once, with an eager fallback if compiling or running the compiled code fails."""

    def __init__(self, name: str, method, compiler: str):
        self.name, self.eager = name, method
        self.compiled = torch.compile(method, fullgraph=True, backend=compiler)
        self.failed: str | None = None

    def __call__(self, *args, **kwargs):
        if self.failed is None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any compiler failure: run this region eagerly from now on
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("region %s: compilation failed, running it eagerly (%s)", self.name, self.failed)
        return self.eager(*args, **kwargs)


def _owner(model, path: str):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def install_regions(model, compiler: str = "inductor") -> list[_Region]:
    """Compile every region the model has (a model without an RNN-T skips that one)."""
    register_inductor_fallbacks()
    installed = []
    for path, method in REGIONS:
        owner = _owner(model, path)
        if owner is None or isinstance(owner.__dict__.get(method), _Region):
            continue
        region = _Region(f"{path}.{method}", getattr(owner, method), compiler)
        owner.__dict__[method] = region  # shadows the class's method on this instance only
        installed.append(region)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    return installed


def _installed(model):
    """(owner, method name) of every region installed on `model`."""
    for path, method in REGIONS:
        owner = _owner(model, path)
        if owner is not None and isinstance(owner.__dict__.get(method), _Region):
            yield owner, method


def remove_regions(model) -> None:
    for owner, method in list(_installed(model)):
        del owner.__dict__[method]


@contextlib.contextmanager
def regions_bypassed(model):
    """The model's plain methods for the duration (the references of tests: a frame step with the regions
    installed runs them even uncaptured); the compiled regions stay built and come back afterwards."""
    saved = [(owner, method, owner.__dict__.pop(method)) for owner, method in list(_installed(model))]
    try:
        yield
    finally:
        for owner, method, region in saved:
            owner.__dict__[method] = region
