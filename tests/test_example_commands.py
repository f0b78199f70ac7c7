"""examples/compute_multiplier/README.md: its commands work as printed on a first run (a
fresh folder, no reports yet), each exiting as its comment says. A glob such as
reports/acc/*/report.json also matches latest/ and broke the gate: the lines are run by a
shell, globs and all."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "compute_multiplier"
BIN = Path(sys.executable).parent


def readme_commands(section: str) -> list[tuple[str, int]]:
    """(command, expected exit) for each trainprobes line of the code block after section."""
    text = (EXAMPLE / "README.md").read_text()
    block = text[text.index(section):].split("```")[1]
    out = []
    for line in block.splitlines():
        if line.startswith("trainprobes "):
            cmd, _, comment = line.partition("#")
            m = re.match(r"\s*exit (\d)", comment)
            out.append((cmd.strip(), int(m.group(1)) if m else 0))
    return out


def test_the_readme_lines_name_no_glob():
    lines = [ln for ln in (EXAMPLE / "README.md").read_text().splitlines()
             if ln.startswith("trainprobes ")]
    assert any("gate" in ln for ln in lines)
    for line in lines:
        assert "*" not in line, line  # a glob matches latest/ as well as the run folder


@pytest.mark.slow
def test_the_accumulation_commands_work_as_printed_on_a_first_run(tmp_path):
    work = tmp_path / "example"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("reports", "__pycache__"))
    cmds = [(c, e) for c, e in readme_commands("## Parallel transforms")
            if "acc" in c and "fsdp2" not in c]
    assert [c.split()[1] for c, _ in cmds] == ["audit", "audit", "gate"]
    for cmd, expected in cmds:
        run = subprocess.run(["bash", "-c", f"PATH={BIN}:$PATH {cmd} --no-progress"
                              if cmd.split()[1] == "audit" else f"PATH={BIN}:$PATH {cmd}"],
                             cwd=work, capture_output=True, text=True, timeout=600)
        assert run.returncode == expected, (cmd, run.stdout[-2000:], run.stderr[-2000:])
    assert "TP-T1" in run.stdout
