"""pytest-xdist's ``loadgroup`` for the tests that share started groups (``local_groups``).

Every test that uses ``local_groups`` gets an ``xdist_group`` mark, one per backend, unless it
has one: freescale under tests/comm, Gloo elsewhere. With ``--dist loadgroup`` the tests of a
group run in one test process, so each shared group starts once in a run and is not stopped
for the other backend's; the other tests go to whichever process has room.

pytest-xdist 3.8 tells its scheduler a test's group by appending ``@group`` to the test id in
the worker, which pytest 9.2 no longer lets a plugin do. So the workers write the groups they
collected to a file the controller named, and the scheduler here reads it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

_COMM_TESTS = Path(__file__).parent / "comm"
_FILE_KEY = "shared_groups_file"

GLOO_GROUPS = pytest.mark.xdist_group("gloo_groups")
FREESCALE_GROUPS = pytest.mark.xdist_group("freescale_groups")


def _group_of(item: pytest.Item) -> str | None:
    marks = item.iter_markers("xdist_group")
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
    return "_".join(names) or None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {}
    for item in items:
        shares = "local_groups" in getattr(item, "fixturenames", ())
        if shares and not item.get_closest_marker("xdist_group"):
            item.add_marker(FREESCALE_GROUPS if _COMM_TESTS in item.path.parents else GLOO_GROUPS)
        group = _group_of(item)
        if group is not None:
            groups[item.nodeid] = group
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None and _FILE_KEY in workerinput:
        path = Path(f"{workerinput[_FILE_KEY]}.{workerinput['workerid']}")
        path.write_text(json.dumps(groups))


def _groups_file(config: pytest.Config) -> Path:
    if not hasattr(config, "_shared_groups_dir"):
        config._shared_groups_dir = tempfile.TemporaryDirectory(prefix="freescale-xdist-")
        config.add_cleanup(config._shared_groups_dir.cleanup)
    return Path(config._shared_groups_dir.name) / "groups"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput[_FILE_KEY] = str(_groups_file(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SharedGroupScheduling(LoadGroupScheduling):
        """``loadgroup`` whose groups come from the workers' file (module docstring)."""

        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self._groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # first called once every worker has collected
                written = sorted(_groups_file(config).parent.glob("groups.*"))
                self._groups = json.loads(written[0].read_text()) if written else {}
            return self._groups.get(nodeid) or super()._split_scope(nodeid)

    return SharedGroupScheduling(config, log)
