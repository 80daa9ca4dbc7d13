"""Export files: validated record by record, refused with a clear reason, imported atomically."""

from __future__ import annotations

import copy
import json

import pytest

from prism_serve.registry import RegistryError, exchange, open_registry
from prism_serve.registry.exchange import export_document, import_results, parse_export, read_export
from prism_serve.registry.gate import admit
from prism_serve.registry.store import add_kernel, counts, list_kernels
from tests.registry.factory import DEVICES, result


@pytest.fixture
def doc(registry):
    with registry.write() as s:
        add_kernel(s, result())
        add_kernel(s, result(workload="swiglu", hidden=256, device=DEVICES[0]))
        add_kernel(s, result(workload="rmsnorm_linear", hidden=256, bucket=(17, 64)))
    with registry.read() as s:
        return export_document(s)


def _bad(doc, edit):
    bad = copy.deepcopy(doc)
    edit(bad)
    return bad


CASES = {
    "wrong export version": (lambda d: d.update(export_version=99), "export_version 99"),
    "not an export": (lambda d: d.pop("format"), "not a prism-serve registry export"),
    "records not a list": (lambda d: d.update(records={}), "'records' must be a list"),
    "missing field": (lambda d: d["records"][1].pop("dtype"), r"record #1 lacks fields: \['dtype'\]"),
    "missing nested field": (lambda d: d["records"][0]["versions"].pop("codegen"), r"versions lacks fields: \['codegen'\]"),
    "wrong type": (lambda d: d["records"][2].update(bucket="1-16"), r"record #2.bucket must be a list"),
    "wrong nested type": (lambda d: d["records"][0]["device"].update(sm_count="132"), "sm_count must be int"),
    "bool for a number": (lambda d: d["records"][0].update(measured_us=True), "measured_us must be float"),
    "unknown field": (lambda d: d["records"][0].update(source_code="x"), "unknown fields"),
    "bad status": (lambda d: d["records"][0].update(status="yolo"), "status 'yolo'"),
    "relabelled dtype": (lambda d: d["records"][0].update(dtype="bfloat16"),
                         r"dtype bfloat16 is not its program's \(float16\)"),
    "bad params": (lambda d: d["records"][0].update(params={"BT": -1}), "param 'BT' must be int in"),
    "hash mismatch": (lambda d: d["records"][0]["program"].update(hash="f" * 32), "is not the hash of its IR"),
    "malformed IR": (lambda d: d["records"][0]["program"]["ir"]["nodes"][0].update(op="conv"), "unsupported op"),
    # sympy would evaluate this dim string and codegen would render these names: both must be refused
    "python in a dim": (lambda d: d["records"][0]["sgraph"]["json"]["program"]["nodes"][0]["attrs"].update(
        shape=["__import__('os').system('touch /tmp/pwned')", 1024]), "attribute 'shape' dim must be int"),
    "python in an intermediate": (lambda d: d["records"][0]["sgraph"]["json"].update(intermediates=[
        {"name": "t", "shape": ["exec(open('/etc/passwd').read())"], "dtype": "float32"}]),
        "is not part of the dim grammar"),
    "python in a name": (lambda d: d["records"][0]["sgraph"]["json"].update(
        name='x"""\nimport os; os.system("id")\n"""'), "sGraph name must be a name"),
    "escape sequence in the reason": (lambda d: d["records"][0].update(reason="ok\x1b]0;owned\x07"),
                                      "reason must be text .* without control characters"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_export_is_refused_and_nothing_written(registry, doc, tmp_path, case):
    edit, message = CASES[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_bad(doc, edit)))
    with registry.read() as s:
        before = counts(s)
    with pytest.raises(RegistryError, match=message):
        results = read_export(path)
        with registry.write() as s:
            import_results(s, results)
    with registry.read() as s:
        assert counts(s) == before


def test_not_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"format": "prism-serve-registry", ')
    with pytest.raises(RegistryError, match="not JSON"):
        read_export(path)


def test_import_failing_halfway_leaves_registry_unchanged(registry, doc, tmp_path, monkeypatch):
    from prism_serve.registry.db import open_registry
    target = open_registry(tmp_path / "target.db")
    with target.write() as s:
        add_kernel(s, result(hidden=512))
    with target.read() as s:
        before = counts(s)
    calls = []
    real = exchange.add_kernel

    def flaky(session, r, ids=None, **kw):
        calls.append(r)
        if len(calls) == 3:
            raise RegistryError("disk full (simulated)")
        return real(session, r, ids, **kw)

    monkeypatch.setattr(exchange, "add_kernel", flaky)
    with pytest.raises(RegistryError, match="simulated"), target.write() as s:
        import_results(s, parse_export(doc))
    assert len(calls) == 3
    with target.read() as s:
        assert counts(s) == before
    target.close()


def test_an_import_leaves_the_registrys_kernel_and_its_sgraphs_proof_as_they_are(registry):
    """A record for a kernel the registry holds changes nothing; a record for the same sGraph at
    another bucket adds its kernel but keeps the stored sGraph's proof and tests (warmup's vLLM
    check and the design it reuses), whatever the export claims."""
    proof, tests = {"egglog": "proved", "design": {"ops": "x"}}, {"vllm_max_rel_error": 1e-3}
    with registry.write() as s:
        add_kernel(s, result(proof=proof, tests=tests))
    with registry.read() as s:
        doc = export_document(s)
    same = copy.deepcopy(doc["records"][0])
    same.update(status="verified", measured_us=1.0)
    same["sgraph"].update(proof={"claimed": "proven"}, tests={"claimed": "checked"})
    doc["records"] = [same, {**copy.deepcopy(same), "bucket": [17, 64]}]
    with registry.write() as s:
        assert import_results(s, parse_export(doc)) == 1
    with registry.read() as s:
        kept, added = sorted(list_kernels(s), key=lambda k: k.bucket_lo)
        assert (kept.status, kept.measured_us) == ("enabled", 10.0)
        assert added.bucket_lo == 17 and added.sgraph_id == kept.sgraph_id
        assert (kept.sgraph.proof, kept.sgraph.tests) == (proof, tests)


def test_an_imported_kernel_carries_the_versions_it_was_checked_with_here(doc, tmp_path):
    """The gate rebuilds and checks every imported kernel with this machine's software: the record's
    claimed versions (an old codegen, which `registry gc --incompatible` would then remove) are not kept."""
    from prism_serve.optimize.codegen.render import CODEGEN_VERSION
    from prism_serve.registry.store import current_versions

    doc["records"] = [r for r in doc["records"] if r["program"]["ir"]["name"] == "rms_norm"]
    for rec in doc["records"]:
        rec["versions"].update(codegen=1, triton="0.1.0")
    target = open_registry(f"sqlite:///{tmp_path / 'target.db'}")
    with target.write() as s:
        assert import_results(s, admit(parse_export(doc), imported=True)) == len(doc["records"])
    here = current_versions()
    with target.read() as s:
        for k in list_kernels(s):
            assert (k.codegen_version, k.triton_version, k.torch_version) == (CODEGEN_VERSION, here.triton, here.torch)
    target.close()


def test_a_kernel_warmed_on_a_gpu_the_table_lacks_travels_with_its_measured_spec(tmp_path):
    """The export carries a device's measured spec (typed again on import), so the gate can bound a
    kernel for a GPU the known table lacks; an import never replaces a spec measured here."""
    import dataclasses

    from prism_serve.optimize.target.gpus import GPUS
    from prism_serve.registry.store import DeviceInfo, device_spec

    l20 = dataclasses.replace(GPUS["l40s"], name="l20", sms=92, mem_bandwidth_gbs=864.0, source="driver")
    source = open_registry(f"sqlite:///{tmp_path / 'a.db'}")
    with source.write() as s:
        add_kernel(s, result(device=DeviceInfo.from_spec(l20, measured=True), status="enabled"))
    with source.read() as s:
        doc = export_document(s)
    source.close()
    assert doc["records"][0]["device"]["spec"]["name"] == "l20"
    target = open_registry(f"sqlite:///{tmp_path / 'b.db'}")
    local = dataclasses.replace(l20, mem_bandwidth_gbs=700.0)  # what a warmup measured here
    with target.write() as s:
        add_kernel(s, result(workload="fused_add_rms_norm", device=DeviceInfo.from_spec(local, measured=True)))
    with target.write() as s:
        assert import_results(s, admit(parse_export(doc), imported=True)) == 1
    with target.read() as s:
        (imported,) = [k for k in list_kernels(s) if k.program.name == "rms_norm"]
        assert imported.status == "verified" and device_spec(imported.device) == local
    target.close()
    bad = copy.deepcopy(doc)
    bad["records"][0]["device"]["spec"]["sms"] = 93
    with pytest.raises(RegistryError, match=r"spec must be the measured spec of gpu:l20:sm8.9:92sms"):
        parse_export(bad)
