"""Triton kernels, each file with its torch reference and launcher."""
import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """A kernel's launcher runs the Triton kernel for CUDA tensors, or anywhere under TRITON_INTERPRET=1
    (the CPU tests); otherwise its torch reference."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
