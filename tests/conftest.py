"""Test setup. Triton kernels run through Triton's interpreter on machines without a GPU, so the
variable must be set before any `ops` module defines its kernels."""
import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Define every kernel now, while the variable is set: Triton decides at definition whether a kernel is
    # interpreted, and a test that runs without the variable (the fixture below) and imports a model
    # module first would otherwise define them for a GPU driver that is not there.
    import importlib
    import pkgutil

    import ops
    for _module in pkgutil.iter_modules(ops.__path__):
        importlib.import_module(f"ops.{_module.name}")

import pytest  # noqa: E402

# The tiny model's ops are small: one thread avoids thread start-up costs and contention with other
# processes on a 2-core machine (measured ~10x faster on the talker tests).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The embedded tiny model written once per test session in the official layout (seed 0)."""
    from nemo_duplex.checkpoint.random_weights import make_random_checkpoint
    from nemo_duplex.models.config import tiny_config

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_random_checkpoint(tiny_config(), out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny(tiny_checkpoint):
    """(model, tokenizer, rnnt_vocab, cfg) loaded through the real loader, fp32, eval mode."""
    from nemo_duplex.checkpoint.load import load_model
    from nemo_duplex.models.config import tiny_config

    torch.manual_seed(0)
    with torch_references():  # a session fixture is set up before the per-test choice below
        model, tokenizer, rnnt_vocab, cfg = load_model(tiny_checkpoint, tiny_config(), torch.device("cpu"))
        return model.cast_for_inference().eval(), tokenizer, rnnt_vocab, cfg


def slim_model(llm_pattern: str = "M*-"):
    """(model, tokenizer): the tiny model with one layer of each kind where it has several (encoder 1 layer,
    LLM `llm_pattern`, talker backbone one sliding and one full layer, MoG 1 layer, codec 1 block), two turns
    of each unrolled loop (the RNN-T's symbols, the talker's RVQ iterations) and 4 codebooks, seeded random
    weights: every kind of op is still in the graph Inductor compiles, at a fraction of the tiny model's
    (cold builds alone on 2 CPU cores: 237 s for the tiny model's step, 104 s for this one's)."""
    import dataclasses

    from nemo_duplex.checkpoint.random_weights import random_model
    from nemo_duplex.models.config import tiny_config

    c = tiny_config()
    c = dataclasses.replace(
        c, encoder=dataclasses.replace(c.encoder, n_layers=1),
        llm=dataclasses.replace(c.llm, hybrid_override_pattern=llm_pattern),
        rnnt=dataclasses.replace(c.rnnt, max_symbols_per_step=2),
        talker=dataclasses.replace(c.talker, num_iter=2, num_quantizers=4,
                                   backbone=dataclasses.replace(c.talker.backbone, num_hidden_layers=2,
                                                                sliding_window_pattern=2),
                                   mog=dataclasses.replace(c.talker.mog, num_layers=1)),
        codec=dataclasses.replace(c.codec, num_blocks=1, num_quantizers=4))
    model, tok, _ = random_model(c, "cpu", seed=0)
    return model.cast_for_inference().eval(), tok


@pytest.fixture(scope="module")
def slim():
    """slim_model(): every kind of layer once."""
    return slim_model()


@pytest.fixture(scope="session")
def example_clip():
    from pathlib import Path

    from nemo_duplex.audio import read_wav

    return torch.from_numpy(read_wav(Path(__file__).resolve().parent.parent / "eval" / "clips" / "example.wav"))


@contextlib.contextmanager
def torch_references():
    """ops.torch_references on a machine without a GPU (the fixtures that build models); on a GPU the
    launchers take the kernels for CUDA tensors whatever the variable says, and it is left as it is."""
    if torch.cuda.is_available():
        yield
        return
    from ops import torch_references as references
    with references():
        yield


def _in_kernel_tests(node) -> bool:
    return "/tests/ops/" in str(node.fspath)


def _kernel_test(node) -> bool:
    return _in_kernel_tests(node) or node.get_closest_marker("triton_interpret") is not None


@pytest.fixture(autouse=True, scope="module")
def _module_fixtures_take_the_references(request):
    """A module's own fixtures (set up before any per-test fixture) build with the torch references,
    except in the kernel tests (tests/ops/)."""
    if _in_kernel_tests(request.node):
        yield
        return
    with torch_references():
        yield


@pytest.fixture(autouse=True)
def _triton_interpreter_only_for_kernel_tests(request, monkeypatch):
    """Kernel tests (tests/ops/) and tests marked `triton_interpret` run the Triton kernels through the
    interpreter; every other CPU test takes the ops' torch references, because whole frame steps through
    the interpreter are far too slow (seconds per frame)."""
    if torch.cuda.is_available():
        return
    if _kernel_test(request.node):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def serving_blas():
    """On CUDA: torch's GEMMs through the library the server selects (engine.blas_library's default,
    nemo_duplex/runtime.py select_blas), restored afterwards."""
    from nemo_duplex.runtime import select_blas
    from nemo_duplex.settings import EngineConfig

    before = torch.backends.cuda.preferred_blas_library()
    library = EngineConfig().blas_library
    select_blas(library)
    yield library
    torch.backends.cuda.preferred_blas_library(before)


# ---- the server tests' fixtures: a tokenizer, and servers on a scripted frame step (tests/server_support.py)
@pytest.fixture
def tok():
    from tests.server_support import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture
def server(monkeypatch, tok):
    made = []

    def factory(**kw):
        from tests.server_support import make

        srv, model = make(monkeypatch, tok, **kw)
        made.append(srv)
        return srv, model

    yield factory
    for s in made:
        s.close()
