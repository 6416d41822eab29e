"""engine.blas_library (nemo_duplex/runtime.py select_blas): a clear error for a library it does not know;
on a GPU, the library it names is the one torch's GEMMs then go through."""
import pytest
import torch

from nemo_duplex.runtime import select_blas


def test_unknown_library_names_the_setting():
    with pytest.raises(ValueError, match=r"engine.blas_library must be one of \('cublaslt', 'cublas'\), got 'cublas-lt'"):
        select_blas("cublas-lt")


@pytest.mark.gpu
def test_selects_the_library(serving_blas):
    assert serving_blas == "cublaslt"   # the default (conf/config.yaml), which the fixture selected
    assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    select_blas("cublas")
    assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublas
