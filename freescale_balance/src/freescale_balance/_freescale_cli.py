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

# Command -> (distribution, its folder in a FreeScale clone, what the command does). The
# components are installed from a clone (no package index has them), so the hint names the folder.
COMPONENTS = {
    "balance": (
        "freescale-balance",
        "freescale_balance",
        "sample load balancing by history length",
    ),
    "comm": ("freescale-comm", "freescale_comm", "the SM-free torch.distributed backend"),
    "embed": (
        "freescale-embed",
        "freescale_embed",
        "sharded sequence embeddings with prioritized updates",
    ),
    "kernels": ("freescale-kernels", "kernels", "Triton kernels for jagged data movement"),
    "train": (
        "freescale-embed",
        "freescale_embed",
        "train a sequence recommender end to end, baseline vs FreeScale",
    ),
}


def install_hint(name: str) -> str:
    """The command that installs ``name``'s component, run from the root of a FreeScale clone."""
    return f"pip install ./{COMPONENTS[name][1]}"


def _usage(installed: set[str]) -> str:
    lines = ["usage: freescale <command> [options]", "", "commands:"]
    for name, (_, _, what) in COMPONENTS.items():
        state = "" if name in installed else f"  (not installed: {install_hint(name)})"
        lines.append(f"  {name:<8} {what}{state}")
    lines.append("")
    lines.append("freescale <command> --help lists a command's options and their defaults.")
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
        try:
            return int(commands[name].load()(rest) or 0)
        except KeyboardInterrupt:  # Ctrl-C: the command has cleaned up; no traceback
            print(f"freescale {name}: interrupted", file=sys.stderr)
            return 130
    if name in COMPONENTS:
        print(
            f"freescale {name}: this command comes with the {COMPONENTS[name][0]} package, which "
            f"is not installed here. From the root of a FreeScale clone: {install_hint(name)}",
            file=sys.stderr,
        )
    else:
        print(f"freescale: unknown command {name!r}\n\n{_usage(set(commands))}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
