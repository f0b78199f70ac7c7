"""`trainprobes isolation`: each subcommand as a user runs it, JSON, exit codes, errors."""
import json

import pytest
from trainprobes.cli import main
from trainprobes.result import load_results

pytestmark = pytest.mark.usefixtures("one_torch_thread")

C = "trainprobes.isolation.controls"


def run(capsys, *argv):
    code = main(["isolation", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_documents_leak_exits_1_and_prints_the_matrix(capsys, tmp_path):
    report = tmp_path / "r.json"
    code, out, _ = run(capsys, "documents", "--make", f"{C}:causal_over_row", "--vocab", "50",
                       "--lengths", "6,7,5", "--no-causal", "--output", str(report))
    assert code == 1 and "TP-I1" in out and "doc 0" in out and " L" in out
    (r,), meta = load_results(report)
    assert meta["command"] == "isolation documents" and r.metrics["isolated"] is False


def test_documents_isolated_json_document_shape(capsys):
    code, out, _ = run(capsys, "documents", "--make", f"{C}:block_diagonal", "--vocab", "50",
                       "--lengths", "6,7/5,8", "--no-causal", "--json")
    doc = json.loads(out)
    assert code == 0 and set(doc) == {"schema_version", "command", "options", "results"}
    assert doc["command"] == "isolation documents"
    (r,) = doc["results"]
    assert r["metrics"]["isolated"] is True and r["metrics"]["n_documents"] == 4
    assert r["metrics"]["n_evaluations"] == 4 + 2


def test_batch_variant_is_a_finding_and_invariant_is_fine(capsys):
    args = ["batch", "--target", f"{C}:split_by_batch", "--inputs", f"{C}:integer_rows",
            "--sizes", "2,3"]
    code, out, _ = run(capsys, *args)
    assert code == 1 and "batch-variant" in out and "TP-I2" in out
    code, out, _ = run(capsys, "batch", "--target", f"{C}:exact_matmul", "--inputs",
                       f"{C}:integer_rows", "--sizes", "2,3", "--json")
    assert code == 0 and json.loads(out)["results"][0]["metrics"]["batch_invariant"] is True


def test_ops_map_rows(capsys):
    code, out, _ = run(capsys, "ops", "--ops", "embedding,softmax", "--dtype", "fp32",
                       "--sizes", "2,3", "--quick")
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.startswith(("embedding", "softmax"))]
    assert [row[0] for row in rows] == ["softmax", "embedding"]
    # a gather copies rows: invariant by construction, whatever this machine is
    assert rows[1][3] == "True"


@pytest.mark.parametrize("argv, match", [
    (["documents", "--make", f"{C}:nope", "--vocab", "50"], "has no attribute"),
    (["documents", "--make", f"{C}:block_diagonal", "--vocab", "50", "--lengths", "3,3/4"], "same length"),
    (["ops", "--ops", "matmull"], "did you mean 'mm'|one of"),
    (["vllm", "missing.npz"], "not a readable vLLM sample"),
])
def test_mistakes_exit_2_with_a_message(capsys, argv, match):
    code, out, err = run(capsys, *argv)
    assert code == 2 and pytest.importorskip("re").search(match, err), err


@pytest.mark.parametrize("argv, match", [
    (["batch", "--sizes", "1", "--target", "x:y"], "--sizes"), (["batch"], "--target"),
    (["documents"], "one of the arguments"), (["frobnicate"], "invalid choice"),
    (["documents", "--hf", "lama"], "did you mean 'llama'"),
    (["documents", "--make", "x:y", "--lengths", "6,x"], "must be document lengths")])
def test_usage_errors_exit_2(capsys, argv, match):
    assert main(["isolation", *argv]) == 2
    assert match in capsys.readouterr().err
