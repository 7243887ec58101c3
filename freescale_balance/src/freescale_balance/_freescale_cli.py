"""The ``freescale`` command: one entry point, one subcommand per installed component.

Every FreeScale distribution installs this same ``freescale`` script (this file is shared by
symbolic link, so each component installs alone) and registers its own subcommand in the
``freescale.commands`` entry-point group. A subcommand whose component is not installed is
named with the package that provides it instead of failing with an unknown-command error.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

COMPONENTS = {
    "balance": ("freescale-balance", "sample load balancing by history length"),
    "comm": ("freescale-comm", "the SM-free torch.distributed backend"),
    "embed": ("freescale-embed", "sharded sequence embeddings with prioritized updates"),
    "kernels": ("freescale-kernels", "Triton kernels for jagged data movement"),
    "train": ("freescale-embed", "train a sequence recommender end to end, baseline vs FreeScale"),
}


def _usage(installed: set[str]) -> str:
    lines = ["usage: freescale <command> [options]", "", "commands:"]
    for name, (package, what) in COMPONENTS.items():
        state = "" if name in installed else f"  (not installed: pip install {package})"
        lines.append(f"  {name:<8} {what}{state}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches ``freescale <command> ...`` to the component that provides ``<command>``."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {ep.name: ep for ep in entry_points(group="freescale.commands")}
    if not args or args[0] in ("-h", "--help"):
        print(_usage(set(commands)))
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name in commands:
        return int(commands[name].load()(rest) or 0)
    if name in COMPONENTS:
        package = COMPONENTS[name][0]
        print(
            f"freescale {name}: this command comes with the {package} package, which is not "
            f"installed here. Install it with: pip install {package}",
            file=sys.stderr,
        )
    else:
        print(f"freescale: unknown command {name!r}\n\n{_usage(set(commands))}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
