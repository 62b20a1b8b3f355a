"""The README, the landing page, says what the project runs and tests (issue 25 item 4): its first program is the
script ``test_scripts.py`` runs, and its commands are the ones ``.ci/run`` and the ``ci/`` scripts run. The docs
site itself is built with warnings as errors by ``ci/docs.sh`` (from ``.ci/run``), not here. No cluster starts.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import test_scripts

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_readme_first_program_is_the_script_that_test_scripts_runs():
    """Comments aside, the README's first program is ``test_scripts.EXAMPLE`` on the embedded cluster without its
    last line (which prints the session id for the test), so the two tensors the README promises are checked."""
    (readme_program,) = code_blocks(section(README, "A first program"), "python")
    tested = ast.parse(test_scripts.EXAMPLE.format(cluster=""))
    last = tested.body[-1].body[-1]  # the with block's last statement
    assert ast.unparse(last) == "print('session', mesh.session_id)", ast.unparse(last)
    tested.body[-1].body.pop()
    assert ast.dump(ast.parse(readme_program)) == ast.dump(tested), (
        "README.md's first program and tests/test_scripts.py's EXAMPLE differ; change both")
    printed = re.findall(r"# .*?(tensor\(\[.*?\]\))", readme_program)
    assert printed == test_scripts.EXPECTED


def test_the_readme_commands_are_the_ones_ci_runs():
    """The two commands (main job, tests) with the three torch builds, and the docs build, as the README's code
    blocks give them: each script exists, and the CPU build ``.ci/run`` installs is one of the README's lines."""
    commands = [line.split("#")[0].strip() for block in code_blocks(README, "bash") for line in block.splitlines()]
    ci_run = (ROOT / ".ci" / "run").read_text()
    (ci_torch,) = re.findall(r'TORCH_SPEC="\$\{TORCH_SPEC:-(.+?)\}"', ci_run)
    assert "bash ci/test.sh" in ci_run and "bash ci/docs.sh" in ci_run
    for script in ("ci/example.sh", "ci/test.sh", "ci/docs.sh"):
        assert (ROOT / script).is_file(), script
    for script in ("ci/example.sh", "ci/test.sh"):
        for spec in (f"TORCH_SPEC={ci_torch} ", 'TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu" ',
                     ""):
            assert f"{spec}bash {script}" in commands, f"README.md lacks the command {spec}bash {script}"
    assert any(c.startswith("bash ci/docs.sh") for c in commands), "README.md lacks the docs build command"
    assert f"pip install {ci_torch}" in commands, "README.md's install lacks the CPU torch line .ci/run uses"
