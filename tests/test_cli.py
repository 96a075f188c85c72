"""slime-run: --help explains, `plugins` lists, errors are clear and exit non-zero."""

from __future__ import annotations

import subprocess
import sys

from slime.cli import main


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime.cli", *argv], capture_output=True, text=True, timeout=120)


def test_help_explains_plugins_and_transport():
    result = _run("--help")
    assert result.returncode == 0
    assert "--plugin NAME" in result.stdout and "--rollout-data-transport" in result.stdout
    assert "resumes from its last joint checkpoint" in " ".join(result.stdout.split())


def test_plugins_lists_builtins_with_what_they_provide(capsys):
    assert main(["plugins", "--disable-plugin-autoload"]) == 0
    out = capsys.readouterr().out
    assert "straw  [slime-rl" in out and "transports: straw" in out
    assert "hooks: slime_cli_defaults, slime_data_sources, slime_transports" in out


def test_unknown_plugin_is_a_clear_error(capsys):
    assert main(["plugins", "-p", "definitely_not_a_plugin"]) == 2
    assert "Unknown plugin 'definitely_not_a_plugin'" in capsys.readouterr().err
