"""Packaging: one top-level import package, the minimum Python, and a user's repository whose
own `probes/` and `reference/` folders must not shadow (or be shadowed by) trainprobes."""
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from trainprobes import _toml

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = _toml.loads((REPO / "pyproject.toml").read_text())


def _run(cmd, cwd, env=None, timeout=300):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_package_folder_is_installed():
    """pyproject lists packages by hand (package-dir maps folders to names): a new
    subpackage left out of the list would be missing from every non-editable install."""
    setup = PYPROJECT["tool"]["setuptools"]
    roots = {name: REPO / folder for name, folder in setup["package-dir"].items()}
    assert roots == {"trainprobes": REPO / "probes", "trainprobes.reference": REPO / "reference"}
    found = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            if "__pycache__" not in rel:
                found.add(".".join((name, *rel)))
    assert sorted(setup["packages"]) == sorted(found)


@pytest.mark.slow
def test_no_construct_newer_than_the_minimum_python():
    """requires-python says 3.10: vermin finds any module, function or syntax that needs
    more (tomllib, ExceptionGroup, `except*`, ...), in the package, tests and scripts."""
    assert PYPROJECT["project"]["requires-python"] == ">=3.10"
    vermin = shutil.which("vermin")
    assert vermin, "vermin is in the test extra: pip install -e '.[test]'"
    out = _run([vermin, "--target=3.10-", "--violations", "--no-tips", "--eval-annotations",
                "--exclude-regex", r"(^|/)\.", "."], cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_finds_nothing():
    """Undefined names, unused imports, unsorted imports ([tool.ruff] in pyproject)."""
    ruff = shutil.which("ruff")
    assert ruff, "ruff is in the test extra: pip install -e '.[test]'"
    out = _run([ruff, "check", "--no-cache", "."], cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


@pytest.mark.slow
def test_import_is_cheap_and_the_folder_names_are_refused():
    code = ("import sys, trainprobes; assert 'torch' not in sys.modules, 'torch imported'; "
            "from trainprobes import causality, drift, numerics; print(trainprobes.__version__)")
    out = _run([sys.executable, "-c", code], cwd=REPO.parent)
    assert out.returncode == 0, out.stderr
    # From a checkout's root the folders are on sys.path; importing them by folder name
    # would load a second copy of every class, so they refuse with the right name.
    for folder, name in (("probes", "'trainprobes'"), ("reference", "'trainprobes.reference'")):
        out = _run([sys.executable, "-c", f"import {folder}"], cwd=REPO)
        assert out.returncode == 1, out.stderr
        assert f"ImportError: this folder is the package {name}" in out.stderr, out.stderr


@pytest.mark.slow
def test_wheel_installs_one_top_level_package(tmp_path):
    # pip's isolated build, as a user's `pip install trainprobes` from source would run it
    out = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
                str(REPO)], cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (wheel,) = tmp_path.glob("trainprobes-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"trainprobes"}
    assert "trainprobes/reference/formats.py" in names
    assert "trainprobes/causality/check.py" in names
    (eps,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(eps).decode()
    assert "trainprobes = trainprobes.cli:main" in text
    assert "trainprobes = trainprobes.pytest_plugin" in text


USER_TEST = '''
import torch

import probes
import reference


def test_users_own_packages_and_the_plugin(trainprobes):
    assert probes.OWNER == reference.OWNER == "user"
    trainprobes.assert_causal(lambda x: x.cumsum(1).argmax(-1), torch.randn(2, 16, 4))
'''


@pytest.mark.slow
def test_a_repository_with_its_own_probes_and_reference(tmp_path):
    """The user's `probes` and `reference` packages win inside their repository, and the
    plugin, `python -m trainprobes` and the console script still work there."""
    for folder in ("probes", "reference"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text('OWNER = "user"\n')
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TEST))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("PYTEST_ADDOPTS", None)
    out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
               cwd=tmp_path, env=env)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]

    out = _run([sys.executable, "-m", "trainprobes", "stall", "--json"], cwd=tmp_path, env=env)
    assert out.returncode == 0 and '"stall_at"' in out.stdout, out.stderr[-3000:]
    script = shutil.which("trainprobes")
    if script is None:
        pytest.skip("the console script is not on PATH (installed without scripts)")
    out = _run([script, "--help"], cwd=tmp_path, env=env)
    assert out.returncode == 0 and "usage: trainprobes" in out.stdout, out.stderr[-3000:]


FACES = {"cli", "commands", "pytest_plugin", "audit", "gate", "report", "__main__"}


def _imports(path):
    """Every trainprobes module a file imports (absolute or relative), at any depth."""
    import ast
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("trainprobes")}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; use trainprobes.* names"
            if node.module and node.module.startswith("trainprobes"):
                out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


# The floor under both reference/ and the probes: these import no other trainprobes module.
FLOOR = ("trainprobes.errors", "trainprobes.validation", "trainprobes._toml", "trainprobes.display")


def _allowed(module, prefix):
    return module.startswith(prefix) or module in FLOOR or module.rsplit(".", 1)[0] in FLOOR \
        or module in {f"trainprobes.{f.split('.')[1]}" for f in FLOOR}


def test_arrows_point_faces_to_probes_to_reference():
    """reference never imports the probes; a probe never imports a face; the floor
    (errors, validation, TOML) imports nothing above it."""
    for name in FLOOR:
        path = REPO / "probes" / (name.split(".")[1] + ".py")
        bad = {m for m in _imports(path) if not _allowed(m, "trainprobes.errors")}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
    for path in (REPO / "reference").rglob("*.py"):
        bad = {m for m in _imports(path) if not _allowed(m, "trainprobes.reference")}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
    for path in (REPO / "probes").rglob("*.py"):
        rel = path.relative_to(REPO / "probes").parts
        if rel[0].removesuffix(".py") in FACES:
            continue
        bad = {m for m in _imports(path) if m.split(".")[1:2] and m.split(".")[1] in FACES}
        assert not bad, f"{path.relative_to(REPO)} imports the faces {sorted(bad)}"


@pytest.mark.slow
def test_a_folder_named_trainprobes_in_the_cwd_does_not_shadow_the_command(tmp_path):
    # a clone named trainprobes, run from its parent: Python makes the folder a namespace
    # package that wins over an editable install's finder; the command must still work
    import subprocess
    import sys
    (tmp_path / "trainprobes" / "docs").mkdir(parents=True)
    for argv in (["--version"], ["stall", "--json"]):
        p = subprocess.run([sys.executable, "-m", "trainprobes", *argv], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stderr
        assert p.stdout.strip()
