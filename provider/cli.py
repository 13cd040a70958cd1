"""The `intone` command: the engine's commands (make-checkpoint, models, say) and `serve`."""

from __future__ import annotations

import argparse

from intone.engine import cli as engine_cli
from intone.provider.server.serve import add_serve_command


def build_parser() -> argparse.ArgumentParser:
    return engine_cli.build_parser(add_serve_command)


def main(argv: list[str] | None = None) -> None:
    engine_cli.main(argv, build_parser())


if __name__ == "__main__":
    main()
