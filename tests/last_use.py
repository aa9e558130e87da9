"""Session fixtures that hold memory or processes (shared servers, SmolLM2 in float32) are
released in the teardown of the last collected test that uses them, not at the end of the
session: shared by a few files, they would otherwise sit idle through the rest of it.

A fixture registers its release with `release_after_last_use(name, release)`; conftest.py's
`pytest_runtest_teardown` calls `release_unused(item)` after each test. A failed release
(a server log with a traceback) is an error in that test's teardown.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

_releases: dict[str, Callable[[], None]] = {}


def release_after_last_use(fixture_name: str, release: Callable[[], None]) -> None:
    _releases[fixture_name] = release


def release_now(fixture_name: str) -> None:
    """Release it (once; the fixture's own teardown calls this too)."""
    release = _releases.pop(fixture_name, None)
    if release is not None:
        release()


def release_unused(item: pytest.Item) -> None:
    """Releases what no test after `item` uses."""
    if not _releases:
        return
    items = item.session.items
    position = next((index for index, each in enumerate(items) if each is item), None)
    if position is None:
        return
    later = items[position + 1:]
    for name in list(_releases):
        if not any(name in getattr(each, "fixturenames", ()) for each in later):
            release_now(name)
