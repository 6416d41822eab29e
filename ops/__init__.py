"""Triton kernels, each file with its torch reference and launcher."""
import contextlib
import os

import torch


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on the CPU through Triton's interpreter (the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def torch_references():
    """CPU tensors take the ops' torch references inside, not the interpreter: TRITON_INTERPRET is unset
    there and restored after. For building models (cast_for_inference makes the talker's per-token table
    through the char encoder: ~100 s under the interpreter for the tiny model, under a second without)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def use_triton(t: torch.Tensor) -> bool:
    """A kernel's launcher runs the Triton kernel for CUDA tensors, or anywhere under TRITON_INTERPRET=1
    (the CPU tests); otherwise its torch reference."""
    return t.is_cuda or interpreting()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; an H200's 132 elsewhere (the interpreter runs the GPU's
    launch choices)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def check_fp8_device(device: torch.device, setting: str = "model.dtype.llm_weights=fp8") -> None:
    """Float8 GEMMs, and Triton's e4m3 type, need compute capability 8.9 or later (L4/L40S, H100/H200, ...):
    refuse at load, naming the setting, rather than fail in the first step. The CPU runs the torch statements."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"{setting} needs float8 support (compute capability 8.9 or later); "
                         f"{name} has {'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
