"""The repo's own test set-up: hypothesis profiles.

"ci" (loaded when CI is set) keeps property tests short and derandomised so a CI run is
repeatable; "nightly" searches much harder. Pick one with --hypothesis-profile=NAME.
"""
import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=2000, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
