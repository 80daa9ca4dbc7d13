"""GPU specs: the known table, the spec from a device's properties, the launch/bandwidth probe."""

from types import SimpleNamespace

import pytest

from prism_serve.errors import PrismError, SGraphError
from prism_serve.optimize.instantiate.devbench import COPY_BYTES, measure
from prism_serve.optimize.target.gpus import GPUS, GpuSpec, get_gpu, spec_from_device


def _props(**over):
    """What torch.cuda.get_device_properties reports for an H100 PCIe (CUDA deviceQuery figures)."""
    base = dict(name="NVIDIA H100 PCIe", major=9, minor=0, multi_processor_count=114, L2_cache_size=50 * 2**20,
                regs_per_multiprocessor=65536, shared_memory_per_block_optin=232448,
                shared_memory_per_multiprocessor=233472, max_threads_per_multi_processor=2048, clock_rate=1755000)
    return SimpleNamespace(**base | over)


def test_the_table_knows_the_common_serving_gpus_and_cites_each_row():
    for name in ("h100", "h100-pcie", "h200", "a100", "a10g", "l4", "l40s", "b200"):
        assert GPUS[name].source
    assert get_gpu("NVIDIA L4") is GPUS["l4"] and get_gpu("nvidia h100 pcie") is GPUS["h100-pcie"]
    with pytest.raises(SGraphError, match="unknown GPU 'rtx 9090'"):
        get_gpu("rtx 9090")


def test_spec_from_device_properties_and_measurements():
    spec = spec_from_device(_props(), bandwidth_gbs=1900.0, eager_launch_us=4.2, graph_launch_us=0.8)
    assert (spec.name, spec.sms, spec.compute_capability) == ("h100-pcie", 114, (9, 0))
    # 114 SMs x 4096 dense fp16 flops per clock (Hopper) x 1.755 GHz; fp32 with 256 per clock
    assert spec.fp16_tensor_tflops == pytest.approx(114 * 4096 * 1.755e9 / 1e12)
    assert spec.fp32_tflops == pytest.approx(114 * 256 * 1.755e9 / 1e12)
    assert (spec.mem_bandwidth_gbs, spec.eager_launch_us, spec.graph_launch_us) == (1900.0, 4.2, 0.8)
    assert spec.l2_mb == 50.0 and spec.max_warps_per_sm == 64 and spec.smem_per_block == 232448


def test_an_unlisted_gpu_gets_a_spec_from_its_driver():
    props = _props(name="NVIDIA RTX PRO 6000", major=10, minor=0, multi_processor_count=188,
                   L2_cache_size=128 * 2**20, clock_rate=None)
    spec = spec_from_device(props, bandwidth_gbs=1700.0, eager_launch_us=3.0, graph_launch_us=1.0)
    assert spec.name == "rtx-pro-6000" and spec.sms == 188 and spec.l2_mb == 128.0
    assert spec.fp16_tensor_tflops == pytest.approx(188 * 8192 * 1.5e9 / 1e12)  # no clock: 1.5 GHz assumed
    with pytest.raises(SGraphError, match="compute capability 7.5"):
        spec_from_device(_props(major=7, minor=5), bandwidth_gbs=1.0, eager_launch_us=1.0, graph_launch_us=1.0)


def test_stored_specs_are_typed_and_checked():
    spec = spec_from_device(_props(), bandwidth_gbs=1900.0, eager_launch_us=4.2, graph_launch_us=0.8)
    assert GpuSpec.from_json(spec.to_json()) == spec
    bad = spec.to_json() | {"sms": "many"}
    with pytest.raises(SGraphError, match="malformed"):
        GpuSpec.from_json(bad)
    with pytest.raises(SGraphError, match="non-positive"):
        GpuSpec.from_json(spec.to_json() | {"mem_bandwidth_gbs": -1})


def test_a_stored_gpu_name_is_a_slug_and_generated_source_renders_nothing_else(tmp_path):
    """The GPU's name is written into a comment of every generated module: a stored spec whose name
    would close that docstring is refused when read, and codegen refuses to render it anyway."""
    import dataclasses

    from prism_serve.errors import CodegenError
    from prism_serve.optimize.codegen.render import render
    from prism_serve.optimize.target.gpus import canonical_name
    from prism_serve.optimize.target.instance import instantiate
    from prism_serve.optimize.workloads.oracles import default_assignment, oracle
    from prism_serve.optimize.workloads.programs import WORKLOADS

    evil = 'h100"""\nopen("' + str(tmp_path / "pwned") + '", "w").write("x")\n"""'
    spec = spec_from_device(_props(), bandwidth_gbs=1900.0, eager_launch_us=4.2, graph_launch_us=0.8)
    with pytest.raises(SGraphError, match="malformed name"):
        GpuSpec.from_json(spec.to_json() | {"name": evil})
    g = oracle(WORKLOADS["rms_norm"].program(hidden=256))
    inst = dataclasses.replace(instantiate(g, default_assignment(g), get_gpu("h100")), gpu=evil)
    with pytest.raises(CodegenError, match="refusing to render GPU name"):
        render(inst)
    assert not (tmp_path / "pwned").exists()
    # a driver's name becomes such a slug, whatever it holds
    assert canonical_name('NVIDIA "Odd" GPU/2 (rev a1)') == "odd-gpu-2-rev-a1"


class FakeProbe:
    """A device whose copies run at 2 TB/s, eager launches cost 4 us, graph nodes 1.5 us."""

    def copy_us(self, nbytes):
        return 2 * nbytes / 2000.0 / 1e3

    def eager_us(self, launches):
        return 30.0 + 4.0 * launches

    def graph_us(self, launches):
        return 8.0 + 1.5 * launches


def test_the_probe_arithmetic():
    figures = measure(FakeProbe(), reps=3)
    assert figures.bandwidth_gbs == pytest.approx(2000.0)
    assert figures.eager_launch_us == pytest.approx(4.0) and figures.graph_launch_us == pytest.approx(1.5)
    assert COPY_BYTES > 128 * 2**20  # past any L2

    class Flat(FakeProbe):
        def graph_us(self, launches):
            return 10.0

    with pytest.raises(PrismError, match="did not grow"):
        measure(Flat(), reps=1)
