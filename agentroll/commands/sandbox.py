"""``agentroll sandbox ls | reap | audit``: docker sandbox housekeeping and the escape audit.

``audit`` exits 1 if any probe escaped or was unbounded.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from agentroll.errors import ConfigError

_DOCKER_HOST_HELP = "daemon URL (default: $DOCKER_HOST)"


@dataclass(frozen=True, slots=True)
class AuditConfig:
    """The options of ``agentroll sandbox audit``: ``probes`` (None: all) must be known ones."""

    backend: str
    docker_host: str | None
    probes: list[str] | None

    def __post_init__(self) -> None:
        from agentroll.sandbox.audit import PROBES

        unknown = set(self.probes or ()) - set(PROBES)
        if unknown:
            raise ConfigError(f"unknown probes {sorted(unknown)}; choose from {sorted(PROBES)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sandbox_command", required=True)
    for name, text in (
        ("ls", "list agentroll's containers at the daemon"),
        ("reap", "remove containers past their TTL or whose owner process is gone"),
    ):
        sub.add_parser(name, help=text).add_argument(
            "--docker-host", default=None, help=_DOCKER_HOST_HELP
        )
    audit = sub.add_parser(
        "audit", help="escape and limit probes inside a sandbox (one status line per probe)"
    )
    audit.add_argument("--backend", default="local", choices=["local", "docker"])
    audit.add_argument("--docker-host", default=None, help=_DOCKER_HOST_HELP)
    audit.add_argument("--probe", action="append", default=None, help="run only this probe")


def main(args: argparse.Namespace) -> int:
    if args.sandbox_command == "audit":
        from agentroll.sandbox.audit import main_audit

        config = AuditConfig(args.backend, args.docker_host, args.probe)
        return main_audit(config.backend, docker_host=config.docker_host, probes=config.probes)
    from agentroll.sandbox.docker_daemon import describe_containers, reap

    if args.sandbox_command == "reap":
        print(f"reaped={reap(args.docker_host)}")
    else:
        for line in describe_containers(args.docker_host):
            print(line)
    return 0
