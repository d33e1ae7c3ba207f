"""The suite's hypothesis profiles reach every contract check: under `ci` (the default) each property of each
check runs 25 examples, under `thorough` (HYPOTHESIS_PROFILE=thorough) 1,000. A check given no
max_examples takes the active profile's count (refusion.testing.checks.base._settings), and a property run
under that count runs exactly that many examples."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st

import refusion.testing.checks as checks
from refusion.core.registry import get_registry

pytestmark = pytest.mark.property

PROFILES = [("ci", 25), ("thorough", 1000)]


@pytest.fixture
def load_profile():
    """Load a profile for one test; the session's profile is back afterwards."""
    before = settings.get_current_profile_name()
    yield settings.load_profile
    settings.load_profile(before)


@pytest.mark.parametrize("profile,examples", PROFILES)
def test_every_check_runs_the_active_profiles_examples_per_property(profile, examples, load_profile, monkeypatch):
    """Every kind's check and the decoder check resolve their examples per property from the profile (the
    properties are recorded, not run)."""
    load_profile(profile)
    monkeypatch.delenv("REFUSION_CHECK_EXAMPLES", raising=False)
    seen: dict[str, list[int]] = {}

    def record(report, properties, max_examples, raise_on_failure):
        seen[report.kind] = [checks._settings(max_examples).max_examples for _ in properties]
        report.passed += [statement for statement, _, _ in properties]
        return report

    monkeypatch.setattr(checks.base, "_run", record)  # every check runs its properties through base._run
    registry = get_registry()
    for kind, check in checks.CHECKS.items():
        check(registry.names(kind)[0])
    checks.check_decoder("refusion")
    assert set(seen) == set(checks.CONTRACTS) and all(n == examples for counts in seen.values() for n in counts), seen


@pytest.mark.parametrize("profile,examples", PROFILES)
def test_a_property_under_the_profile_runs_that_many_examples(profile, examples, load_profile):
    load_profile(profile)
    calls = []
    report = checks._run(checks.CheckReport("scorer", "counting"),
                         [("counts its examples", lambda x: calls.append(x), dict(x=st.binary(min_size=16)))],
                         None, raise_on_failure=True)
    assert report.ok and len(calls) == examples
