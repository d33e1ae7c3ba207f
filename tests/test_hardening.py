"""Every bad input fails clearly: the right error type and a message that names the field or the fix."""

import pytest
from hardening_cases import CASES, message


@pytest.mark.parametrize("name, fn, kind, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(name, fn, kind, fragment):
    got_kind, msg = message(fn)
    assert got_kind == kind, msg
    assert fragment in msg
