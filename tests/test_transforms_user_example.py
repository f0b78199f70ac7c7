"""examples/user_step/README.md (and docs/transforms.md's --step section, which prints the
same lines): a user's single-device step and parallel step modules, probed from their own
folder by the command lines as printed, each exiting as its comment says."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "user_step"


def commands(text: str) -> list:
    """(command, expected exit) of each command line of the first code block."""
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    out = []
    for line in block.strip().splitlines():
        cmd, _, comment = line.partition("#")
        m = re.match(r"\s*exit (\d)", comment)
        out.append((cmd.strip(), int(m.group(1)) if m else 0))
    return out


def test_the_docs_print_the_examples_lines():
    readme = commands((EXAMPLE / "README.md").read_text())
    docs = (ROOT / "docs" / "transforms.md").read_text()
    assert len(readme) == 3 and all(cmd in docs for cmd, _ in readme)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(3))
def test_each_line_runs_as_printed(tmp_path, i):
    work = tmp_path / "user_step"
    shutil.copytree(EXAMPLE, work)
    cmd, code = commands((EXAMPLE / "README.md").read_text())[i]
    cmd = cmd.replace("python -m", f"{sys.executable} -m", 1).replace(
        "trainprobes ", f"{Path(sys.executable).parent / 'trainprobes'} ", 1)
    p = subprocess.run(cmd, shell=True, cwd=work, capture_output=True, text=True, timeout=600,
                       env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                            "HOME": str(tmp_path)})
    assert p.returncode == code, (cmd, p.stdout[-2000:], p.stderr[-3000:])
    assert ("noise" if code == 0 else "biased") in p.stdout
