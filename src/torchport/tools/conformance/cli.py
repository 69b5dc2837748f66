"""``torchport conformance``: the conformance runner (:mod:`torchport.tools.conformance.opinfo`)
as a subcommand, its options and ``--help`` as ``python -m torchport.tools.conformance``'s."""

from __future__ import annotations

import typer

PROG = "torchport conformance"


def register(app: typer.Typer) -> None:
    """Add the ``conformance`` command to the torchport CLI."""

    @app.command(
        "conformance", add_help_option=False,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        help="Check a backend against the CPU over PyTorch's OpInfos (-b/--backend; --full, "
             "--ops, --dtypes, --max-samples...), or over PyTorch's own device-generic test "
             "files (--upstream DIR: a PyTorch source checkout); writes reports/. "
             "`torchport conformance --help` lists every option.")
    def conformance_cmd(ctx: typer.Context) -> None:
        from torchport.tools.conformance.opinfo import main

        try:
            code = main(list(ctx.args), prog=PROG)
        except SystemExit as e:  # argparse's --help and usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
            if not isinstance(e.code, (int, type(None))):
                typer.echo(e.code, err=True)
        raise typer.Exit(code)
