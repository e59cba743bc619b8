"""Every code block of the README and of the guide's pages (docs/guide/) runs as written, on the shipped model,
and prints what its ``# ->`` comments say.

Each page is a session of its own: its Python blocks run in order in one namespace (as a reader pastes them into
one session); shell blocks run
in bash, in a scratch directory that holds ``models/`` and nothing else. The server a shell block starts in
the background serves the Python blocks after it, on a free port in place of 8000, and is stopped at the
end. ``make`` lines run as ``make -n`` (a dry run): ``make test`` cannot run inside the test suite. The
commands the README only names in text are parsed by the real command line, so a renamed flag fails here.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs" / "guide").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
#: pages with no code block to run (text and tables only); any other page without one fails: its blocks were lost
WITHOUT_CODE = {"models.md", "studies.md"}
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def blocks(page: Path = README) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


def all_text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def expected(code: str) -> list[str]:
    """The outputs a block promises: what follows ``# ->`` on each line."""
    return [m.group(1).strip() for m in re.finditer(r"#\s*->\s*(.+)$", code, re.M)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_shell(code: str, cwd: Path, log: Path) -> tuple[int, str, int]:
    """Runs a shell block; output goes to a file (a background server keeps a pipe open for ever)."""
    script = "\n".join(f"make -n -C {ROOT} {line.split(None, 1)[1].split('#')[0]}" if line.startswith("make ")
                       else line for line in code.splitlines())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        code_ = proc.wait(timeout=600)
    return code_, log.read_text(), proc.pid


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_readme_runs_as_written(tmp_path, page):
    port = str(free_port())
    work = tmp_path / "work"
    work.mkdir()
    (work / "models").symlink_to(ROOT / "models")
    namespace: dict = {}
    groups = []
    previous = Path.cwd()
    ran = 0
    os.chdir(work)  # the Python blocks name models/acache-tiny as a reader in the repository does
    try:
        for i, (lang, code) in enumerate(blocks(page)):
            code = code.replace("8000", port)
            if lang == "python":
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    exec(compile(code, f"{page.name} block {i}", "exec"), namespace)
                output = buf.getvalue()
            elif lang == "bash":
                status, output, group = run_shell(code, work, tmp_path / f"block{i}.log")
                groups.append(group)
                assert status == 0, f"{page.name} block {i} failed:\n{code}\n{output}"
            elif lang == "sh":  # shown, not run (a Ray cluster, a remote model): its commands must parse
                commands = [line.split("#")[0] for line in code.splitlines() if line.startswith("acache ")]
                assert commands, f"{page.name} block {i} names no acache command to check"
                for command in commands:
                    parses(shlex.split(command.replace('"$KEY"', "KEY"))[1:])
                ran += 1
                continue
            else:
                continue
            ran += 1
            missing = [want for want in expected(code) if want not in output]
            assert not missing, f"{page.name} block {i} did not print {missing}:\n{output}"
        assert ran or page.name in WITHOUT_CODE, f"{page.name} has no code block that runs or is checked"
    finally:
        os.chdir(previous)
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)


def parses(argv: list[str]) -> None:
    """``acache ARGV`` as the real command line reads it: a renamed or removed flag fails."""
    from acache.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"acache {shlex.join(argv)} does not parse ({exc})")


def test_every_command_the_readme_names_parses():
    from acache.cli import build_parser

    parser = build_parser()
    text = all_text()
    commands = re.findall(r"`(acache [^`]+)`", text)
    assert len(commands) >= 10
    for command in commands:
        argv = shlex.split(command)[1:]
        if argv[-1:] == ["..."]:
            continue
        if len(argv) == 1 or "--help" in argv or "--version" in argv:  # a command named in passing
            argv = [*argv[:1], "--help"] if argv[0] != "--version" else argv
            with pytest.raises(SystemExit) as exit_, contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(argv)
            assert exit_.value.code == 0, f"the README's `{command}` is not a command"
            continue
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"the README's `{command}` does not parse")


def test_every_make_target_the_readme_names_exists():
    targets = set(re.findall(r"`make ([\w-]+)`", all_text()))
    assert {"run", "test", "study", "eval-lm"} <= targets
    rules = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    assert targets <= rules, sorted(targets - rules)


def test_the_guide_pages_and_their_links_exist():
    """The README links every guide page, and every relative link of the README and the guide resolves."""
    text = README.read_text()
    assert len(PAGES) >= 8 and all(f"docs/guide/{p.name}" in text for p in PAGES[1:])
    broken = [(page.name, target) for page in PAGES for target in LINK.findall(page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert broken == []
