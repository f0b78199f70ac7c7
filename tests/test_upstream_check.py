"""The tested set and the upstream check (docs/upstream.md): constraints.txt pins every
library the README's commands install beside the user's torch, the README and CI use it, and
the check's report says what changed (releases, newly broken tests, findings fixed upstream,
types the map lacks). The check's venv itself is exercised by running it (docs/upstream.md has
its last report); here its parts."""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("upstream_check", ROOT / "scripts" / "upstream_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _requirements(extra: str) -> list[str]:
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"][extra]
    return [re.split(r"[<>=;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs]


def test_every_dependency_but_torch_is_pinned_and_torch_stays_the_users(check):
    pins = check.pins(ROOT / "constraints.txt")
    names = [n for n in _requirements("test") if n != "tomli"]       # tomli: Python 3.10 only
    assert "torch" in names and "torch" not in pins
    missing = [n for n in names if n != "torch" and n not in pins]
    assert not missing, f"constraints.txt lacks {missing}: a fresh install would take their newest release"
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r'[A-Za-z0-9_.\-]+==\S+ ; python_version >= "3\.11"', line), line
    for torch_pins in ("sympy", "networkx", "filelock", "fsspec", "jinja2", "typing-extensions"):
        assert torch_pins not in pins       # left to the user's torch, which constrains them itself


def test_the_readme_commands_and_ci_install_the_tested_set():
    readme = (ROOT / "README.md").read_text().split("```")[1]
    commands = [ln for ln in readme.splitlines() if ln.startswith("pip install")]
    assert len(commands) == 2 and all('-e ".[test]" -c constraints.txt' in c for c in commands)
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_the_report_lists_releases_broken_tests_findings_and_what_the_harness_lacks(check):
    args = argparse.Namespace(torch="torch==2.13.0")
    found = [{"outcome": "fixed upstream", "news": "fixed upstream in transformers 5.25.0: x", "target": "bert a"},
             {"outcome": "fixed upstream", "news": "fixed upstream in transformers 5.25.0: x", "target": "bert b"},
             {"outcome": "cannot judge", "news": "cannot be measured on transformers 5.26.0", "target": "opt c"},
             {"outcome": "reproduced", "news": "", "target": "doge d"}]
    import datetime
    text = check.report(args, datetime.datetime(2026, 12, 5), {"transformers": "5.25.0", "numpy": "2.4.6"},
                        {"transformers": "5.26.0", "numpy": "2.4.6"}, {"tests/test_a.py::t": "boom", "old": "x"},
                        {"old": "x"}, found, "", ["newtype"], None)
    assert "| transformers | 5.25.0 | 5.26.0 |" in text and "numpy" not in text
    assert "## Newly broken tests (1)" in text and "`tests/test_a.py::t`: boom" in text
    assert "**fixed upstream**: 2" in text and "(2: bert a, bert b)" in text
    assert "model types registered now that the published map lacks (1): newtype" in text
    assert "- opt c: cannot be measured on transformers 5.26.0" in text


def test_the_check_refuses_to_replace_a_report_or_fill_a_used_folder(check, tmp_path, capsys):
    (tmp_path / "r.md").write_text("someone's")
    with pytest.raises(SystemExit) as e:
        check.main(["--report", str(tmp_path / "r.md"), "--no-tests"])
    assert e.value.code == 2 and "exists" in capsys.readouterr().err
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "x").write_text("")
    with pytest.raises(SystemExit) as e:
        check.main(["--report", str(tmp_path / "new.md"), "--venv", str(tmp_path / "v")])
    assert e.value.code == 2 and "not empty" in capsys.readouterr().err
    assert (tmp_path / "r.md").read_text() == "someone's"


def test_a_report_path_that_is_a_folder_is_refused_before_any_work(check, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        check.main(["--report", str(tmp_path), "--force", "--no-tests"])
    assert e.value.code == 2 and "is a folder" in capsys.readouterr().err


def test_a_step_of_the_check_that_cannot_run_is_cannot_judge_with_the_report_it_names(check, tmp_path, capsys,
                                                                                     monkeypatch):
    import subprocess
    monkeypatch.setattr(check, "run", lambda cmd, log, **kw: subprocess.CompletedProcess(cmd, 1, "", "no index"))
    out = tmp_path / "up.md"
    assert check.main(["--report", str(out), "--venv", str(tmp_path / "venv"), "--no-tests"]) == 2
    err = capsys.readouterr().err
    assert "cannot judge" in err and str(out) in err
    assert out.is_file() and "Not judged: creating the venv" in out.read_text()
