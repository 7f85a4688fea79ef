"""A corpus of broken policies: each names its expected problems (`# expect: ...`) and gets them.

Every file must fail `policy check` with exit status 1, print each expected
problem with its location (and line, where the file says so), and never a
traceback. In an expectation, `...` stands for any text on the same line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.policy import run

from commitgate.server.serve.checking import check_policy_file

CORPUS = Path(__file__).parent / "policies_bad"
FILES = sorted(CORPUS.glob("*.toml"))
EXPECT = re.compile(r"^# expect: (.+)$", re.MULTILINE)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMMITGATE_TEST_SURELY_UNSET", raising=False)


def test_corpus_is_there() -> None:
    assert len(FILES) >= 20
    for path in FILES:
        assert EXPECT.findall(path.read_text()), f"{path.name} names no expected problem"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_each_broken_policy_is_told_where_and_why(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run(capsys, ["policy", "check", str(path)])
    assert result.code == 1
    assert "Traceback" not in result.text
    assert result.out.startswith(f"{path}: ")
    for expected in EXPECT.findall(path.read_text()):
        assert _found(expected, result.out), f"{path.name}: missing {expected!r} in\n{result.out}"
    # One line per problem, each with a location or a line number.
    problems = check_policy_file(path)
    assert result.out.count("\n  ") == len(problems)
    assert all(p.location or p.line for p in problems)


def _found(expected: str, output: str) -> bool:
    """`...` in an expectation stands for any text within the same line."""
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return any(re.search(pattern, line) for line in output.splitlines())


def test_check_json_lists_the_same_problems(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    path = CORPUS / "everything_at_once.toml"
    result = run(capsys, ["policy", "check", "--json", str(path)])
    assert result.code == 1
    report = json.loads(result.out)
    assert report["valid"] is False
    assert {p["location"] for p in report["problems"]} == {
        "tools.charge.timeout",
        "tools.charge.status_check",
        "tools.book.compensate.tool",
        "tools.email.python",
    }
    assert {p["line"] for p in report["problems"]} == {6, 8, 13, 18}


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "absent.toml", "no such file"),
        (lambda d: d, "this is a directory, not a policy file"),
        (lambda d: _write_bytes(d / "latin1.toml", b"name = '\xe9'\n"), "cannot read the policy file"),
    ],
    ids=["missing", "directory", "not-utf8"],
)
def test_unreadable_files_are_a_problem_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: object, expected: str
) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    result = run(capsys, ["policy", "check", str(path)])
    assert result.code == 1
    assert expected in result.out
    assert "Traceback" not in result.text


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_check_through_the_console_script() -> None:
    """The installed `commitgate` command, as a user runs it."""
    script = Path(sys.executable).parent / "commitgate"
    path = CORPUS / "bad_retry.toml"
    done = subprocess.run([str(script), "policy", "check", str(path)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "tools.refund.retry.attempts: must be >= 1 (got 0) (line 7)" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    good = subprocess.run(
        [str(script), "policy", "check", str(Path(__file__).parents[1] / "policies" / "default.toml")],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0, good.stdout + good.stderr
