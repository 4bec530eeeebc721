"""The suite's minutes-long live sessions go to one pytest-xdist worker, one after another.

Each runs a sidecar and a real torch job (the demo, three), and each judges gains and exits
against its own measurements: run side by side on two cores they starve each other. So they
form one unit of work, handed out first; the other worker takes the rest, one module at a
time (``--dist loadscope``: a module's fixtures run once), at a lower CPU priority
(``tests/conftest.py``: ``BACKGROUND_NICENESS``).
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

LIVE_SESSION_MODULES = frozenset({
    "tests/seedancectl/test_demo.py",
    "tests/seedancectl/test_tuning_session.py",
    "tests/seedancectl/test_readme_attach.py",
    "tests/seedancectl/test_serving_session.py",
})
UNIT = "live-sessions"


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class LiveSessionsInOneUnit(LoadScopeScheduling):
    """``loadscope``, except that every live-session module shares one scope."""

    def _split_scope(self, nodeid: str) -> str:
        module = module_of(nodeid)
        return UNIT if module in LIVE_SESSION_MODULES else module
