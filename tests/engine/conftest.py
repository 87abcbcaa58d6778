"""Hypothesis profiles for the engine's property tests.

``ci`` (the default): derandomized, so every run checks the same examples and a
failure reproduces; no per-example deadline (CPU speed varies). Set
``HYPOTHESIS_PROFILE=explore`` to draw new random examples on each run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
