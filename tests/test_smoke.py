from rollbox import AsyncSandbox


async def test_echo(sandbox: AsyncSandbox) -> None:
    result = await sandbox.commands.run("echo hi")
    assert result.exit_code == 0
    assert result.stdout == "hi\n"
