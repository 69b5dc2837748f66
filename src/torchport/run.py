"""``torchport run [--backend sim] script.py args...``: run a CUDA script unchanged on a device.

Registers the backend, enables :mod:`torchport.transfer`, then executes the script
with :mod:`runpy` as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` set as
``python script.py args...`` would, so ``if __name__ == "__main__"`` blocks,
argparse and relative imports behave the same. For multi-process jobs launch it
per rank: ``torchrun --nproc-per-node 2 --no-python torchport run ddp.py``.
Also runnable as ``python -m torchport.run [--backend B] script.py args...``.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from typing import Any

import typer


def load_backend(name: str) -> Any:
    """Import a backend by name: ``sim``, a ``torchport.backends.<name>`` package, or a module path."""
    candidates = ["torchport.sim"] if name == "sim" else (
        [name] if "." in name else [f"torchport.backends.{name}", name])
    last: Exception | None = None
    for mod in candidates:
        try:
            importlib.import_module(mod)
            break
        except ModuleNotFoundError as e:
            if e.name is not None and not mod.startswith(e.name) and e.name != mod:
                raise  # the backend exists but one of its own imports is missing
            last = e
    else:
        raise typer.BadParameter(f"unknown backend {name!r} (tried {', '.join(candidates)})") \
            from last
    from torchport import active_backend

    return active_backend()


def run_script(script: str, args: list[str], backend: str = "sim", module: bool = False,
               transfer: bool = True) -> None:
    """Set up ``backend`` (+ transfer), then run ``script`` (or module) as ``__main__``."""
    load_backend(backend)
    if transfer:
        from torchport import transfer as _transfer

        _transfer.enable()
    exec_main(script, args, module=module)


def exec_main(script: str, args: list[str], module: bool = False,
              restore: bool = False) -> None:
    """Run ``script`` as ``python script.py args...`` would (``-m`` style with ``module``).

    Shared by ``torchport run`` and ``torchport coverage``; ``restore`` puts
    ``sys.argv``/``sys.path`` back afterwards for callers that stay in-process.
    """
    if not module and not os.path.exists(script):
        raise typer.BadParameter(f"no such script: {script}")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    try:
        if module:
            sys.path.insert(0, os.getcwd())
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    finally:
        if restore:
            sys.argv = saved_argv
            sys.path[:] = saved_path


def register(app: typer.Typer) -> None:
    """Add the ``run`` command to the torchport CLI."""

    @app.command(
        "run",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                          "allow_interspersed_args": False},
        help="Run an unmodified CUDA script on a torchport device (script args follow it).")
    def run(ctx: typer.Context,
            script: str = typer.Argument(..., help="Python script (or module with -m)."),
            backend: str = typer.Option(
                os.environ.get("TORCHPORT_BACKEND", "sim"), "--backend", "-b",
                help="Backend: sim, a torchport.backends name, or a module path."),
            module: bool = typer.Option(False, "-m", "--module",
                                        help="Run SCRIPT as a module, like python -m.")) -> None:
        run_script(script, list(ctx.args), backend=backend, module=module)


def main() -> None:
    """``python -m torchport.run``: the same command without the full CLI."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)
    app(prog_name="torchport run")


if __name__ == "__main__":
    main()
