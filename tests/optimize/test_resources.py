"""The resource model's MMA padding, as codegen emits it, checked against torch."""

import pytest

from prism_serve.optimize.codegen import render
from prism_serve.optimize.gpus import get_gpu
from prism_serve.optimize.sgraph import instantiate
from prism_serve.optimize.workloads.oracles import oracle
from prism_serve.optimize.workloads.programs import WORKLOADS

from .kernel_check import check_instance

H100 = get_gpu("h100")


@pytest.mark.parametrize("name", ["rmsnorm_linear", "fused_add_rmsnorm_linear"])
def test_small_token_tiles_are_padded_to_the_mma_minimum(name):
    """Blocks of 4 tokens: a 4 x 64 x 32 broadcast product would outweigh 12 padded rows, so the
    token tile is padded to 16 masked rows and the matmul runs as tl.dot; the kernel matches
    torch at 1 and 7 tokens (7 leaves a partial second block), every output element written."""
    g = oracle(WORKLOADS[name].program(hidden=64, out=32, dtype="float32"))
    inst = instantiate(g, {"BT": 4, "F": 1, "G": 1}, H100)
    r = inst.resources(g.kernels[0])
    assert r.mma_padded and r.dots == ("p",)
    source = render(inst)
    assert "tl.dot(" in source and "tl.arange(0, 16) < 4" in source
    for num_tokens in (1, 7):
        check_instance(inst, num_tokens, "float32")


def test_no_padding_where_the_token_tile_already_fits_a_dot():
    g = oracle(WORKLOADS["rmsnorm_linear"].program(hidden=64, out=32, dtype="float32"))
    inst = instantiate(g, {"BT": 16, "F": 1, "G": 1}, H100)
    assert not inst.resources(g.kernels[0]).mma_padded and "tl.arange(0, 16) < " not in render(inst)
