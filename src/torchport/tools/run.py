"""``torchport run [--backend sim] script.py args...``: run a CUDA script unchanged on a device.

Registers the backend, enables :mod:`torchport.transfer`, then executes the script
with :mod:`runpy` as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` set as
``python script.py args...`` would, so ``if __name__ == "__main__"`` blocks,
argparse and relative imports behave the same. Processes the script starts
(``torch.multiprocessing.spawn``, ``multiprocessing``, ``subprocess`` running
Python) inherit ``TORCHPORT_AUTOLOAD``/``TORCHPORT_TRANSFER`` and set up the same on
``import torch``. Jobs can also be launched per rank:
``torchrun --nproc-per-node 2 --no-python torchport run ddp.py``.
Also runnable as ``python -m torchport.tools.run [--backend B] script.py args...``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import os
import runpy
import sys
from collections.abc import Iterator
from typing import Any

import typer

from torchport.core import settings


def load_backend(name: str) -> Any:
    """Import a backend by name: ``sim``, a ``torchport.backends.<name>`` package, or a module path."""
    if name.endswith(".py") or os.sep in name:  # a file: its module path is what imports
        module = name.removesuffix(".py").strip(os.sep).replace(os.sep, ".")
        raise typer.BadParameter(f"backend {name!r} is a file; give its module path, "
                                 f"e.g. -b {module} (importable from the current directory)")
    candidates = ["torchport.sim"] if name == "sim" else (
        [name] if "." in name else [f"torchport.backends.{name}", name])
    last: Exception | None = None
    for mod in candidates:
        try:
            _import_here(mod)
            break
        except ModuleNotFoundError as e:
            if e.name is not None and not mod.startswith(e.name) and e.name != mod:
                raise  # the backend exists but one of its own imports is missing
            last = e
    else:
        raise typer.BadParameter(
            f"unknown backend {name!r}: no module {' or '.join(candidates)} can be imported "
            f"from {os.getcwd()} or PYTHONPATH; give sim, a torchport.backends name (opencl) or "
            f"a module path whose import registers the backend") from last
    from torchport import active_backend

    return active_backend()


def _import_here(module: str) -> None:
    """Import ``module``, also from the current directory, as ``python -m`` would: the
    ``torchport`` console script's ``sys.path`` starts with its own folder, not the
    working directory. A backend found there stays importable (``sys.path``), and
    processes the script starts find it too (``PYTHONPATH``, see :func:`child_environment`)."""
    try:
        importlib.import_module(module)
        return
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        top = module.split(".")[0]
        if e.name not in (module, top) or _on_path(cwd) \
                or importlib.machinery.PathFinder.find_spec(top, [cwd]) is None:
            raise
    sys.path.append(cwd)
    _FROM_CWD.append(cwd)
    importlib.import_module(module)


def _on_path(folder: str) -> bool:
    return any(os.path.abspath(p or os.curdir) == folder for p in sys.path)


_FROM_CWD: list[str] = []  # folders added to sys.path to import a backend from there


def run_script(script: str, args: list[str], backend: str = "sim", module: bool = False,
               transfer: bool = True) -> None:
    """Set up ``backend`` (+ transfer), then run ``script`` (or module) as ``__main__``.

    While the script runs, ``TORCHPORT_AUTOLOAD`` (and ``TORCHPORT_TRANSFER``) are
    exported, so Python processes it starts set up the same on ``import torch``.
    """
    load_backend(backend)
    if transfer:
        from torchport import transfer as _transfer

        _transfer.enable()
    with child_environment(backend, transfer):
        exec_main(script, args, module=module)


@contextlib.contextmanager
def child_environment(backend: str, transfer: bool = True,
                      extra: dict[str, str] | None = None) -> Iterator[None]:
    """Export the variables that make child processes load ``backend`` (see
    :mod:`_torchport_autoload`), and ``extra``; the previous environment comes back
    afterwards."""
    wanted = {"TORCHPORT_AUTOLOAD": backend, **(extra or {})}
    if _FROM_CWD:  # the backend was found in the working directory: so do the children
        wanted["PYTHONPATH"] = os.pathsep.join(
            [*_FROM_CWD, *filter(None, [os.environ.get("PYTHONPATH")])])
    if transfer:
        wanted["TORCHPORT_TRANSFER"] = "1"
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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


def print_script_error(e: BaseException) -> None:
    """Print ``e`` as ``python script.py`` would: the traceback from the script's first
    frame on (no torchport, runpy or command-line frames above it), through ``sys.excepthook``."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _LAUNCH_FILES:
        tb = tb.tb_next
    if tb is not None:
        e.__traceback__ = tb  # the default hook prints the exception's own traceback
    sys.excepthook(type(e), e, e.__traceback__)


_LAUNCH_FILES = (__file__, runpy.__file__, "<frozen runpy>")

#: The command line's own errors (a bad backend or script name), which the CLI prints as
#: usage errors: typer's names, since recent typer releases carry their own click and
#: ``click`` itself need not be installed.
_CLI_ERRORS = (typer.BadParameter, typer.Exit, typer.Abort)


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
                settings.get("TORCHPORT_BACKEND"), "--backend", "-b",
                help="Backend: sim, a torchport.backends name, or a module path."),
            module: bool = typer.Option(False, "-m", "--module",
                                        help="Run SCRIPT as a module, like python -m.")) -> None:
        try:
            run_script(script, list(ctx.args), backend=backend, module=module)
        except (SystemExit, *_CLI_ERRORS):
            raise
        except BaseException as e:  # the script's own error: print it as python would
            print_script_error(e)
            raise typer.Exit(130 if isinstance(e, KeyboardInterrupt) else 1) from None


def main() -> None:
    """``python -m torchport.tools.run``: the same command without the full CLI."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)
    app(prog_name="torchport run")


if __name__ == "__main__":
    main()
