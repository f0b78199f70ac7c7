"""A file a command writes is named on stderr with the folder made for it: a typo in a folder
name no longer leaves the user hunting for the report."""
from __future__ import annotations

import json

from trainprobes.cli import main

GEMM = ["gemm", "--mean", "100", "--k", "64", "--rows", "16", "--samples", "64", "--trials", "8",
        "--presets", "fp32"]


def test_output_says_where_it_went_and_which_folder_it_made(tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "r.json"
    assert main([*GEMM, "--output", str(out)]) in (0, 1)
    err = capsys.readouterr().err
    assert f"report written to {str(out)!r} (created the folder {str(out.parent)!r})" in err
    assert json.loads(out.read_text())["results"]
    again = tmp_path / "new" / "deeper" / "r2.json"
    assert main([*GEMM, "--output", str(again)]) in (0, 1)
    err = capsys.readouterr().err
    assert f"report written to {str(again)!r}\n" in err and "created" not in err
