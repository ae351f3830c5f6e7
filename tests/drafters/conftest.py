"""Fixtures the drafter tests share."""

import pytest


@pytest.fixture(scope="session")
def one_line_error():
    """check(exc_type, fn, *needles): `fn()` raises exc_type with a one-line message holding
    every needle; returns the message."""
    def check(exc_type, fn, *needles):
        with pytest.raises(exc_type) as e:
            fn()
        msg = str(e.value)
        assert "\n" not in msg, msg
        for n in needles:
            assert str(n) in msg, (n, msg)
        return msg

    return check
