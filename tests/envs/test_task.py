"""Loading tasks from Python, from task directories and from JSONL, with good and bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollbox.envs import Task, TaskFile, TestsVerifier, load_tasks
from rollbox.errors import ConfigError
from rollbox.sandbox.models import Limits


def _write_task_dir(root: Path, toml: str, instruction: str | None = "Do it.") -> Path:
    root.mkdir(parents=True)
    (root / "task.toml").write_text(toml)
    if instruction is not None:
        (root / "instruction.md").write_text(instruction)
    return root


def test_from_python_with_defaults_and_coercions() -> None:
    task = Task(
        id="t1",
        instruction="Say hi.",
        files={"a.txt": "hello", "bin/run.sh": {"content": "#!/bin/sh\necho hi\n", "mode": 0o755}},
        setup="mkdir -p out",
        verifier={"command": "true", "files": {"test.py": b"x = 1\n"}},
        limits={"memory_mb": 256},
        metadata={"difficulty": "easy"},
    )
    assert task.files["a.txt"] == TaskFile(content="hello", mode=0o644)
    assert task.files["bin/run.sh"].mode == 0o755
    assert task.setup == ("mkdir -p out",)
    assert isinstance(task.verifier, TestsVerifier)
    assert task.verifier.files["test.py"].content == b"x = 1\n"
    assert task.limits == Limits(memory_mb=256)
    assert task.template == "python"
    assert task.max_turns >= 1 and task.episode_timeout_seconds is not None
    assert task.sandbox_ttl_seconds is not None
    assert task.sandbox_ttl_seconds > task.episode_timeout_seconds


def test_verifier_may_be_a_callable() -> None:
    async def score(sandbox: object, task: Task) -> float:
        return 1.0

    assert Task(id="t", instruction="x", verifier=score).verifier is score


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"instruction": "x"}, "id: Field required"),
        ({"id": "t", "instruction": "x", "max_turns": 0}, "max_turns"),
        (
            {"id": "t", "instruction": "x", "verifier": {"files": {}}},
            "verifier: invalid TestsVerifier: command",
        ),
        ({"id": "t", "instruction": "x", "verifier": 3}, "verifier: give a test command"),
        (
            {"id": "t", "instruction": "x", "verifier": {"command": "x", "files": {"../up": "x"}}},
            "must be relative",
        ),
        ({"id": "t", "instruction": "x", "setup": [""]}, "setup"),
        (
            {"id": "t", "instruction": "x", "step_timeout": 3},
            "step_timeout: Extra inputs are not permitted",
        ),
        ({"id": "t", "instruction": "x", "limits": {"memory_mb": -1}}, "limits.memory_mb"),
        ({"id": "t", "instruction": "x", "done_command": " "}, "done_command"),
    ],
)
def test_bad_python_input_names_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match="invalid Task") as caught:
        Task(**fields)
    assert message in str(caught.value)


def test_from_dir(tmp_path: Path) -> None:
    root = _write_task_dir(
        tmp_path / "count-lines",
        """
template = "python"
max_turns = 7
setup = ["mkdir -p /work/out"]
[limits]
memory_mb = 256
[verifier]
command = "python3 $TESTS_DIR/test_count.py"
timeout_seconds = 30
[metadata]
difficulty = "easy"
""",
        instruction="Count the lines of data.txt.\n",
    )
    (root / "files" / "sub").mkdir(parents=True)
    (root / "files" / "data.txt").write_text("a\nb\n")
    (root / "files" / "sub" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(root / "files" / "sub" / "run.sh", 0o755)
    (root / "files" / "blob.bin").write_bytes(b"\xff\x00\xfe")
    (root / "tests").mkdir()
    (root / "tests" / "test_count.py").write_text("assert True\n")

    task = Task.from_dir(root)
    assert task.id == "count-lines"
    assert task.instruction == "Count the lines of data.txt.\n"
    assert task.max_turns == 7 and task.limits.memory_mb == 256
    assert task.setup == ("mkdir -p /work/out",)
    assert task.files["data.txt"].content == "a\nb\n"
    assert task.files["sub/run.sh"].mode == 0o755
    assert task.files["blob.bin"].content == b"\xff\x00\xfe"
    assert isinstance(task.verifier, TestsVerifier)
    assert task.verifier.timeout_seconds == 30
    assert set(task.verifier.files) == {"test_count.py"}
    assert task.metadata == {"difficulty": "easy"}
    assert load_tasks(root) == [task]
    assert load_tasks(tmp_path) == [task]


@pytest.mark.parametrize(
    ("toml", "instruction", "message"),
    [
        ("max_turns = \n", "x", r"task\.toml: .*line 1"),
        ('max_turns = "many"\n', "x", r"task\.toml: max_turns: Input should be a valid integer"),
        ("bogus = 1\n", "x", r"task\.toml: bogus: Extra inputs are not permitted"),
        (
            "[verifier]\ntimeout_seconds = 3\n",
            "x",
            r"task\.toml: verifier: invalid TestsVerifier: command",
        ),
        ("max_turns = 3\n", None, r"no instruction\.md"),
        ('instruction = "twice"\n', "x", r"instruction is given twice"),
    ],
)
def test_from_dir_bad_input_names_file_and_field(
    tmp_path: Path, toml: str, instruction: str | None, message: str
) -> None:
    root = _write_task_dir(tmp_path / "bad", toml, instruction)
    with pytest.raises(ConfigError, match=message) as caught:
        Task.from_dir(root)
    if "task.toml" in message:
        assert str(root / "task.toml") in str(caught.value)


def test_from_dir_needs_a_verifier_command_for_tests(tmp_path: Path) -> None:
    root = _write_task_dir(tmp_path / "t", "max_turns = 3\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("")
    with pytest.raises(
        ConfigError, match=r"tests/ holds hidden tests but there is no \[verifier\]"
    ):
        Task.from_dir(root)


def test_from_dir_refuses_symlinks(tmp_path: Path) -> None:
    root = _write_task_dir(tmp_path / "t", "max_turns = 3\n")
    (root / "files").mkdir()
    (root / "files" / "link").symlink_to("/etc/passwd")
    with pytest.raises(ConfigError, match="symlinks are not supported"):
        Task.from_dir(root)


def test_from_dir_without_task_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no task\.toml"):
        Task.from_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"no task\.toml here nor in any subdirectory"):
        load_tasks(tmp_path)
    with pytest.raises(ConfigError, match="no such file or directory"):
        load_tasks(tmp_path / "missing")


def test_from_jsonl(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "instruction": "A", "verifier": {"command": "true"}},
        {"id": "b", "instruction": "B", "max_turns": 3, "files": {"x.py": "print(1)"}},
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    tasks = Task.from_jsonl(path)
    assert [t.id for t in tasks] == ["a", "b"]
    assert tasks[1].max_turns == 3 and tasks[1].files["x.py"].content == "print(1)"
    assert load_tasks(path) == tasks


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"id": "a", "instruction": "A"}', "{not json"], r"tasks\.jsonl line 2: invalid JSON"),
        (['["a"]'], r"tasks\.jsonl line 1: a row must be a JSON object, not list"),
        (['{"id": "a", "instruction": "A", "max_turns": -1}'], r"tasks\.jsonl line 1: max_turns"),
        (['{"instruction": "A"}'], r"tasks\.jsonl line 1: id: Field required"),
        (
            ['{"id": "a", "instruction": "A"}', "", '{"id": "a", "instruction": "B"}'],
            r"tasks\.jsonl line 3: task id 'a' is already used on line 1",
        ),
    ],
)
def test_from_jsonl_bad_rows_name_line_and_field(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message):
        Task.from_jsonl(path)
