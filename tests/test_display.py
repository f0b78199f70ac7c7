"""The one number format and the one GitHub step-summary writer."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trainprobes.display import append_step_summary, format_number


@pytest.mark.parametrize("value,text", [
    (True, "true"), (False, "false"), (2048, "2048"), (2048.0, "2048"), (-0.0, "0"),
    (0.001, "0.001"), (1.5e-05, "1.5e-05"), (-0.23556536777008227, "-0.2356"),
    (1e20, "1e+20"), (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"),
    ("nan", "nan"), ("bf16", "bf16"), (None, "None"),
])
def test_format_number(value, text):
    assert format_number(value) == text


def test_format_number_digits_and_numpy_scalars():
    import numpy as np
    import torch
    assert format_number(0.1234567, digits=6) == "0.123457"
    assert format_number(np.float64(0.25)) == "0.25" and format_number(np.int64(7)) == "7"
    assert format_number(torch.tensor(2048.0)) == "2048"
    assert format_number(np.array([1.0, 2.0])) == "[1. 2.]"  # an array is not a number


@given(st.floats(min_value=-1e300, max_value=1e300))
def test_format_number_reads_back_close(x):
    assert math.isclose(float(format_number(x)), x, rel_tol=1e-3, abs_tol=0.0)


@pytest.mark.parametrize("set_env", [True, False])
def test_step_summary_appended_only_when_set(tmp_path, set_env):
    target = tmp_path / "summary.md"
    target.write_text("earlier step\n")
    env = {"GITHUB_STEP_SUMMARY": str(target)} if set_env else {}
    got = append_step_summary("## trainprobes audit\n\n", env=env)
    text = target.read_text()
    if set_env:
        assert got == target and text == "earlier step\n## trainprobes audit\n"
    else:
        assert got is None and text == "earlier step\n"


def test_gate_and_report_use_the_one_step_summary_writer():
    """Was: report/__init__.py and commands/gate.py each wrote $GITHUB_STEP_SUMMARY."""
    import trainprobes.commands.gate as gate_cmd
    import trainprobes.report as report
    assert report.append_step_summary is append_step_summary
    assert gate_cmd.append_step_summary is append_step_summary
