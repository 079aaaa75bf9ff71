"""What every browser test shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dashboard_harness import console_errors


@pytest.fixture(autouse=True)
def _own_console(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test reads only its own page's console: the browser is shared by the module, and a page
    left open when its test's server shut down logs refused requests into the next test's log."""
    browser = request.getfixturevalue("driver") if "driver" in request.fixturenames else None
    if browser is not None:
        console_errors(browser)
    yield
    if browser is not None:
        browser.get("about:blank")
        console_errors(browser)
