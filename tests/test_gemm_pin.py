"""trainprobes.numerics.gemm_pin: the accumulator presets pinned to real torch._scaled_mm
outputs saved by scripts/gpu_check.py on a GPU (tests/data/scaled_mm_outputs.json), and the
saving logic checked on the CPU with the emulator standing in for the kernel."""
import json
import sys
from pathlib import Path

import pytest
import torch
from trainprobes.numerics.gemm_pin import crafted_cases, mismatches, record
from trainprobes.reference.gemm import PRESETS, matmul

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "scaled_mm_outputs.json"
# the presets each GPU generation's record may match (docs/gemm.md: where each was read); on
# sm90 the sign of the alignment is unsettled (truncation toward zero as the H200 reveal read
# it on positive terms, or the sign-fill shift the DeepSeek-V3 report describes): the saved
# record decides, and must match exactly one
EXPECTED = {(9, 0): ("h200-scaled-mm", "h200-scaled-mm-signfill"), (10, 0): ("b200-25bit",)}


def emulated(preset):
    return lambda a, b: matmul(a.double(), b.double(), preset)


def test_the_saved_hardware_outputs_match_their_preset():
    if not DATA.exists():
        pytest.skip(f"{DATA.relative_to(ROOT)} is absent: no GPU has run scripts/gpu-check.sh "
                    "since it was added, so no real _scaled_mm outputs pin the presets yet")
    doc = json.loads(DATA.read_text())
    cap = tuple(doc["capability"])
    if cap not in EXPECTED:
        pytest.fail(f"outputs from {doc['device']} (sm{cap[0]}{cap[1]}) name no expected preset; "
                    f"presets that match them: {doc.get('presets_matched')}; add it to EXPECTED")
    matched = [p for p in EXPECTED[cap] if not mismatches(doc, p)]
    assert len(matched) == 1, (f"{doc['device']}: matches {matched} of {EXPECTED[cap]}: "
                               + "; ".join(f"{p}: {mismatches(doc, p)[:2]}" for p in EXPECTED[cap]))


@pytest.mark.slow
def test_the_crafted_cases_tell_every_preset_apart():
    # a record made by one preset matches that preset and no other: pinning means something
    for name in PRESETS:
        doc = record(emulated(name), device_name=name, capability=(0, 0), torch_version="-")
        assert mismatches(doc, name) == []
        assert all(mismatches(doc, other) for other in PRESETS if other != name), name
    assert len(json.dumps(doc)) < 8000  # a few KB


def test_an_edited_or_stale_record_is_named():
    doc = record(emulated("h200-scaled-mm"), device_name="x", capability=(9, 0), torch_version="-")
    doc["cases"]["big_then_ones"][0][0] += 1.0
    del doc["cases"]["random_mean0_k1024"]
    doc["cases"]["unknown"] = [[0.0]]
    found = " ".join(mismatches(doc, "h200-scaled-mm"))
    assert "big_then_ones: 1 of 64 outputs differ, the first at (0, 0)" in found
    assert "lacks cases ['random_mean0_k1024']" in found and "'unknown' is not one of" in found


def test_the_cases_are_the_same_bits_everywhere():
    # built on the CPU from constants and seeds, held as e4m3 values in float32
    for c in crafted_cases():
        assert c.a.shape[0] == 16 and c.b.shape[1] == 16 and c.a.shape[1] == c.b.shape[0]
        for t in (c.a, c.b):
            assert torch.equal(t.to(torch.float8_e4m3fn).float(), t)


@pytest.fixture
def gpu_check():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
        yield gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_the_script_saves_only_from_a_gpu_and_never_replaces(gpu_check, tmp_path, monkeypatch):
    out = tmp_path / "scaled_mm_outputs.json"
    report = {"checks": {}}
    gpu_check.scaled_mm_data(report, "cpu", out, force=False)  # a CPU dry run: nothing saved
    assert "skipped" in report["checks"]["scaled_mm_saved_outputs"] and not out.exists()
    # the GPU path, the emulated Hopper accumulator standing in for the kernel and the device
    import trainprobes.numerics.gemm_pin as pin
    monkeypatch.setattr(pin, "scaled_mm_runner", lambda device: emulated("h200-scaled-mm"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in H200")
    gpu_check.scaled_mm_data(report, "cuda", out, force=False)
    got = report["checks"]["scaled_mm_saved_outputs"]
    assert got["status"] == "ok" and got["presets_matched"] == ["h200-scaled-mm"], got
    assert out.stat().st_size < 8000
    gpu_check.scaled_mm_data(report, "cuda", out, force=False)  # exists: kept, an error
    again = report["checks"]["scaled_mm_saved_outputs"]
    assert again["status"] == "error" and "exists" in again["error"]


@pytest.mark.parametrize("base", ["h200-scaled-mm", "b200-25bit"])
def test_the_negative_cases_tell_the_sign_of_the_cut_apart_in_the_kept_rows(base):
    # the H200 reveal used positive terms, where truncation toward zero and a sign-fill
    # shift (toward -inf, DeepSeek-V3 section 3.5.2) agree: the kept rows of the two
    # negative cases must differ for each of the term cut and the sum's rounding
    from trainprobes.numerics.gemm_pin import ROWS_KEPT
    cases = {c.name: c for c in crafted_cases()}
    acc = PRESETS[base]

    def rows(a, name):
        c = cases[name]
        return matmul(c.a[:ROWS_KEPT].double(), c.b.double(), a)
    for change, differs in ((dict(term_rounding="down"), "negative_small_term"),
                            (dict(rounding="down"), "negative_carry")):
        other = acc.with_(**change)
        assert not torch.equal(rows(acc, differs), rows(other, differs)), (base, change)
    sign = PRESETS["h200-scaled-mm-signfill"]
    assert base != "h200-scaled-mm" or all(
        not torch.equal(rows(acc, n), rows(sign, n)) for n in ("negative_small_term", "negative_carry"))
