"""SGLang's own server arguments, offered as `--sglang-<name>` and validated by SGLang's parser.

Every option of `sglang.launch_server` (`ServerArgs.add_cli_args`) is mirrored on `slime-run` as
`--sglang-<name>` (`--tp-size` -> `--sglang-tp-size`), with SGLang's help text. The mirrored options only
collect what the user typed, in order, into `args.sglang_server_args` (`["--tp-size", "2", ...]`, SGLang's own
spelling); `check_server_args` then has SGLang's parser read exactly those tokens, so types, choices and
spellings are SGLang's decision and its message is the one the user sees. Engines are launched with the same
tokens (`slime.plugins.sglang_engine.launcher`).

Importing SGLang takes ~8 s and, on CPU machines, needs the stand-ins of `cpu_standins/`, so neither the
option table nor the check runs in the process that parses the command line: both run `python -m
slime.plugins.sglang_engine.server_args` in a subprocess of the same interpreter. The table is cached per
SGLang version under `~/.cache/slime-rl/` (written atomically), so only the first parse after installing
or upgrading SGLang pays for it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The SGLang release this plugin is written and tested against (its HTTP protocol and server arguments).
SGLANG_VERSION = "0.5.19"
#: Where `args` collects the `--sglang-*` tokens (in SGLang's spelling).
DEST = "sglang_server_args"
PREFIX = "--sglang-"
STANDINS_DIR = Path(__file__).resolve().parent / "cpu_standins"
INSTALL_HINT = (
    f"install SGLang {SGLANG_VERSION}: on a GPU machine `pip install 'slime-rl[sglang]'`; on a CPU-only machine "
    f"`pip install --no-deps sglang=={SGLANG_VERSION}` then `pip install -r requirements/sglang-cpu.txt "
    "-c requirements/sglang-cpu-constraints.txt` (files in the slime-rl repository; `nox -s sglang` does all of "
    "this in its own virtualenv)"
)
#: Options slime-run sets itself for every engine; given as --sglang-* they are refused with the reason.
RESERVED = {
    "--model-path": "the engines serve --hf-checkpoint (or the built-in tiny model)",
    "--model": "the engines serve --hf-checkpoint (or the built-in tiny model)",
    "--port": "each engine takes a free port (retried on another one when taken)",
    "--help": "use slime-run --help",
}


class SGLangUnavailableError(RuntimeError):
    """SGLang is not installed (or does not import) in this Python environment."""


def installed_version() -> str | None:
    """The installed SGLang's version, or None when it is not installed (cheap: reads package metadata)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def sglang_environment() -> dict[str, str]:
    """The environment of a process that imports SGLang: this one's, with `cpu_standins/` on `PYTHONPATH`
    when torchvision or vllm cannot be imported here (see cpu_standins/README.md)."""
    env = dict(os.environ)
    if importlib.util.find_spec("torchvision") is None or importlib.util.find_spec("vllm") is None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STANDINS_DIR), env.get("PYTHONPATH")]))
    return env


def _run_helper(*helper_args: str, timeout: float = 300.0) -> dict[str, Any]:
    """Run this module's `main` in a subprocess that imports SGLang; its JSON answer."""
    command = [sys.executable, "-m", "slime.plugins.sglang_engine.server_args", *helper_args]
    try:
        done = subprocess.run(
            command, env=sglang_environment(), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise SGLangUnavailableError(f"importing SGLang took more than {timeout:g} s ({' '.join(command)})") from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise SGLangUnavailableError(f"SGLang does not import in this environment ({INSTALL_HINT}):\n{tail}")
    return json.loads(lines[-1])


def _cache_path(version: str) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "slime-rl" / f"sglang-{version}-server-args.json"


def option_table() -> list[dict[str, Any]]:
    """SGLang's server options (`option_strings`, `nargs`, `help`, `metavar`), [] when SGLang is not installed.

    Read from the per-version cache, else from SGLang's parser in a subprocess (then cached). A SGLang that is
    installed but does not import gives [] here; launching or checking then reports why.
    """
    version = installed_version()
    if version is None:
        return []
    path = _cache_path(version)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        path.unlink(missing_ok=True)  # a damaged cache is rebuilt below
    try:
        table = _run_helper("--table")["options"]
    except SGLangUnavailableError:
        return []
    from slime.utils.atomic_files import write_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda file: file.write(json.dumps(table)), binary=False)
    return table


class _CollectServerArg(argparse.Action):
    """Appends the SGLang spelling of the option and its values to `args.sglang_server_args`."""

    def __init__(self, option_strings: list[str], dest: str, sglang_flag: str = "", **kwargs: Any) -> None:
        self.sglang_flag = sglang_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        tokens = list(getattr(namespace, self.dest, None) or [])
        tokens.append(self.sglang_flag)
        if isinstance(values, list):
            tokens.extend(str(value) for value in values)
        elif values is not None and self.nargs != 0:
            tokens.append(str(values))
        setattr(namespace, self.dest, tokens)


def add_server_options(group: Any) -> int:
    """Mirror every SGLang server option onto `group` as `--sglang-<name>`; returns how many were added."""
    added = 0
    for entry in option_table():
        long_flags = [flag for flag in entry["option_strings"] if flag.startswith("--") and flag not in RESERVED]
        if not long_flags:
            continue
        for sglang_flag in long_flags:
            help_text = entry["help"] if sglang_flag == long_flags[0] else f"alias of {PREFIX}{long_flags[0][2:]}"
            group.add_argument(
                PREFIX + sglang_flag[2:],
                action=_CollectServerArg,
                dest=DEST,
                sglang_flag=sglang_flag,
                nargs=entry["nargs"],
                metavar=entry["metavar"],
                default=None,
                help=(help_text or "").replace("%", "%%") or None,
            )
            added += 1
    return added


def check_server_args(tokens: list[str]) -> None:
    """Have SGLang's own parser read `tokens` (SGLang's spelling); ValueError with SGLang's message if it refuses.

    Raises `SGLangUnavailableError` when SGLang is not installed or does not import.
    """
    if installed_version() is None:
        raise SGLangUnavailableError(f"--rollout-engine sglang needs SGLang, which is not installed: {INSTALL_HINT}")
    answer = _run_helper("--check", json.dumps(list(tokens)))
    if not answer["ok"]:
        given = " ".join(PREFIX + token[2:] if token.startswith("--") else token for token in tokens)
        raise ValueError(f"SGLang's parser refused {given}: {answer['message']}")


def _sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", add_help=False, exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _table() -> dict[str, Any]:
    options = []
    for action in _sglang_parser()._actions:
        if not action.option_strings:
            continue
        metavar = action.metavar if isinstance(action.metavar, str) else None
        options.append(
            {
                "option_strings": list(action.option_strings),
                "nargs": action.nargs,
                "help": action.help,
                "metavar": metavar,
            }
        )
    return {"options": options}


def _check(tokens: list[str]) -> dict[str, Any]:
    parser = _sglang_parser()
    messages: list[str] = []
    parser.error = messages.append  # type: ignore[method-assign] - keep argparse's message, do not exit
    try:
        parser.parse_args(["--model-path", "unused-by-the-check", *tokens])
    except argparse.ArgumentError as exc:
        messages.append(str(exc))
    if messages:
        return {"ok": False, "message": messages[0]}
    return {"ok": True, "message": ""}


def main(argv: list[str] | None = None) -> None:
    """`--table`: print SGLang's option table as JSON; `--check JSON_TOKENS`: print whether SGLang accepts them."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--table"]:
        answer = _table()
    elif argv[:1] == ["--check"] and len(argv) == 2:
        answer = _check(json.loads(argv[1]))
    else:
        raise SystemExit("usage: python -m slime.plugins.sglang_engine.server_args --table | --check JSON_TOKENS")
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
