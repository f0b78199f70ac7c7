"""The repo's own test set-up: hypothesis profiles, and the suite spread over the cores.

"ci" (loaded when CI is set) keeps property tests short and derandomised so a CI run is
repeatable; "nightly" searches much harder. Pick one with --hypothesis-profile=NAME.
"""
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=2000, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The suite spread over every core by default (pytest-xdist, in the test extra): the
    README's `python -m pytest -q` then takes minutes, not the sum of every test's. `-n 0`
    runs it in one process, `-n N` on N; a debugger (--pdb) keeps one process."""
    if hasattr(config, "workerinput") or os.environ.get("PYTEST_XDIST_WORKER"):
        return   # a worker runs its share in its own process: it never starts workers of its own
    if (config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None) is None
            and config.getoption("dist", "no") == "no" and not config.getoption("usepdb", False)):
        config.option.numprocesses = "auto"
