"""Every ``ray-velo`` command and flag that the README and docs show exists: a line naming
``ray-velo CMD`` may only name flags that CMD takes. No Ray."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ray_velo.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"ray-velo ([a-z]+)((?:[^`\n|]|`[^`\n]*`)*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _commands() -> dict[str, set[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: {flag for action in command._actions for flag in action.option_strings}
        for name, command in sub.choices.items()
    }


def test_every_command_and_flag_the_docs_name_exists() -> None:
    commands = _commands()
    wrong = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in COMMAND.finditer(line):
                name, rest = match.group(1), match.group(2)
                if name not in commands:
                    wrong.append(f"{page.name}:{number}: no command `ray-velo {name}`")
                    continue
                for flag in FLAG.findall(rest.split("ray-velo ")[0]):
                    if flag not in commands[name]:
                        wrong.append(f"{page.name}:{number}: `ray-velo {name}` has no {flag}")
    assert not wrong, "\n".join(wrong)
