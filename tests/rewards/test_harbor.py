"""reward_file: the reward a Harbor-style verifier writes, read back on the host."""

from __future__ import annotations

import pytest

from rollbox import AsyncSandbox
from rollbox.errors import ConfigError
from rollbox.rewards import RewardFile, Sample
from tests.rewards.conftest import Score

WRITABLE = "/tmp/logs/verifier"


async def test_reward_json_gives_score_and_components(score: Score) -> None:
    reward = RewardFile(
        'sh "$TESTS_DIR/test.sh"',
        files={"test.sh": 'echo \'{"reward": 0.75, "style": 1}\' > "$REWARD_DIR/reward.json"\n'},
        directory=WRITABLE,
    )
    result = await score("", reward)
    assert result.score == 0.75
    assert result.components == {"reward_file": 0.75, "reward": 0.75, "style": 1.0}
    assert result.details["file"] == "reward.json"


async def test_reward_txt_when_there_is_no_json(score: Score) -> None:
    reward = RewardFile('echo " 0.5 " > "$REWARD_DIR/reward.txt"', directory=WRITABLE)
    result = await score("", reward)
    assert result.score == 0.5 and result.details["file"] == "reward.txt"


async def test_a_reward_file_planted_before_the_verifier_counts_for_nothing(
    provider: object,
) -> None:
    # the agent wrote 1.0 in advance; the verifier, which finds the task undone, writes nothing
    reward = RewardFile(
        "test -f /work/done && echo 1 > $REWARD_DIR/reward.txt; true", directory=WRITABLE
    )
    async with await AsyncSandbox.create(provider=provider) as sandbox:  # type: ignore[arg-type]
        await sandbox.files.write(f"{WRITABLE}/reward.txt", "1.0")
        await sandbox.files.write(f"{WRITABLE}/reward.json", '{"reward": 1.0}')
        result = await reward.score(Sample(sandbox=sandbox))
    assert result.score == 0.0
    assert result.error == f"the verifier wrote neither reward.json nor reward.txt in {WRITABLE}"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("NaN", "is not a number"),
        ("one", "is not a number"),
        ('{"reward": true}', "is not a finite number"),
        ('{"a": 1, "b": 2}', "none named 'reward'"),
        ("[1]", "not a JSON object"),
    ],
)
async def test_garbage_scores_zero_with_the_reason(
    score: Score, content: str, problem: str
) -> None:
    name = "reward.json" if content[0] in "[{" else "reward.txt"
    reward = RewardFile(f"printf '%s' '{content}' > $REWARD_DIR/{name}", directory=WRITABLE)
    result = await score("", reward)
    assert result.score == 0.0 and problem in result.error


async def test_the_read_only_root_is_a_config_error_naming_the_fix(score: Score) -> None:
    with pytest.raises(
        ConfigError, match=r'read-only root; use a writable directory, e\.g\. directory="/tmp'
    ):
        await score("", RewardFile("true"))


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="absolute path"):
        RewardFile("true", directory="logs")
    with pytest.raises(ConfigError, match="need a command"):
        RewardFile(files={"a": "b"})
