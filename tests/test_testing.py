import pytest

from agentroll.testing import FakeSandbox
from agentroll.types import ExecResult


async def test_fake_sandbox_records_and_snapshots() -> None:
    sb = FakeSandbox(lambda cmd: ExecResult(exit_code=0, stdout=f"ran {cmd}"))
    assert (await sb.exec("ls")).stdout == "ran ls" and sb.commands == ["ls"]
    await sb.write_file("a/b.txt", "hi")
    blob = await sb.snapshot()
    await sb.write_file("a/b.txt", "changed")
    await sb.restore(blob)
    assert await sb.read_file("a/b.txt") == b"hi"
    with pytest.raises(FileNotFoundError):
        await sb.read_file("missing")
    with pytest.raises(ValueError):
        await sb.write_file("../x", "no")
    await sb.close()
    assert sb.closed
