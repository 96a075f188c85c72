"""Upstream slime's flags that slime-rl does not implement: accepted by the parser only to be refused, saying why.

An upstream script that passes one stops at parse time with `slime-run: error: --FLAG (upstream slime): WHY`,
instead of argparse's bare "unrecognized arguments" or a run that silently ignores it. docs/upstream.md lists
these with the flags accepted under upstream's meaning.
"""

from __future__ import annotations

import argparse
from typing import Any

#: Flag -> why it is refused here and what to use instead.
NOT_IMPLEMENTED = {
    "--colocate": (
        "engines and training ranks sharing the same GPUs, each offloaded in turn, is not implemented; they get "
        "devices of their own, and --release-train frees the training ranks' memory while the engines generate"
    ),
}


class _Refuse(argparse.Action):
    """Refuse the option as soon as it is parsed, with its reason."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("metavar", "VALUE")
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        parser.error(f"{option} (upstream slime): {NOT_IMPLEMENTED[option]}")


def add_upstream_refusals(parser: argparse.ArgumentParser) -> None:
    """Register every `NOT_IMPLEMENTED` flag as one that is refused when given."""
    group = parser.add_argument_group("upstream slime flags not implemented here (refused, saying why)")
    for flag, why in NOT_IMPLEMENTED.items():
        group.add_argument(flag, action=_Refuse, help=f"refused: {why.split(';')[0]}")
