"""The ``torchport`` command: one typer app; each layer registers its subcommands."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(help="torchport: run PyTorch on a new accelerator, and port models to it.",
                  no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)  # tracebacks as Python prints them

# Modules exposing ``register(app)``; a missing optional layer is skipped.
_SUBCOMMANDS = ["torchport.tools.info", "torchport.tools.migrate.cli", "torchport.tools.run",
                "torchport.tools.debug.cli_coverage", "torchport.tools.debug.cli_compare",
                "torchport.tools.conformance.cli"]


def _load() -> None:
    for name in _SUBCOMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                continue
            raise
        mod.register(app)


def main() -> None:
    _load()
    app()


if __name__ == "__main__":
    main()
