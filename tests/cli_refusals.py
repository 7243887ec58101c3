"""The check every ``test_cli`` runs: a command refuses a bad value in one line, exit status 2."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest


def assert_refused(
    main: Callable[[Sequence[str]], int], argv: Sequence[str], message: str, capsys
) -> None:
    """``main(argv)`` exits with status 2 and one line on stderr that contains ``message``."""
    with pytest.raises(SystemExit) as refused:
        main(list(argv))
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
