"""The ``headroom`` command: ``demo``, ``profile``, ``estimate`` and ``plan``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import traceback
from pathlib import Path

from headroom import __version__

DESCRIPTION = """\
headroom: train and run PyTorch models that do not fit in accelerator memory, and see where
memory goes.
"""


def _write_reports(mem, prefix: Path, *, plot: bool, title: str) -> list[Path]:
    written = [prefix.with_suffix(".txt"), prefix.with_suffix(".json")]
    with open(written[0], "w") as f:
        mem.report(file=f)
    mem.to_json(written[1])
    if plot:
        written.append(prefix.with_suffix(".png"))
        mem.plot(written[2], title=title)
    return written


def _find_module(name: str) -> str | None:
    """Why ``python -m name`` would not start (one line), or ``None`` when it would."""
    if name.startswith("."):
        return f"no module named {name!r} (relative module names are not supported)"
    try:
        # A dotted name imports its parent packages: a missing one raises here.
        spec = importlib.util.find_spec(name)
    except Exception as e:  # noqa: BLE001 - a parent package's own import failed
        if isinstance(e, ModuleNotFoundError) and e.name is not None and (
                name == e.name or name.startswith(e.name + ".")):
            return f"no module named {name!r}"
        return f"error while finding module {name!r} ({type(e).__name__}: {e})"
    return None if spec is not None else f"no module named {name!r}"


def _profile(args: argparse.Namespace) -> int:
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    if args.module:
        # Like `python -m`, the current folder comes first on sys.path.
        sys.path.insert(0, os.getcwd())
        problem = _find_module(args.target)
        if problem is not None:
            sys.path[:] = saved_path
            print(f"headroom profile: {problem}", file=sys.stderr)
            return 2
        target, run = args.target, lambda: runpy.run_module(args.target, run_name="__main__")
        sys.argv = [args.target, *args.args]
    else:
        script = Path(args.target)
        if not script.is_file():
            print(f"headroom profile: no such script: {script}", file=sys.stderr)
            return 2
        target = str(script)
        sys.argv = [str(script), *args.args]
        # Like `python script.py`, the script's own folder comes first on sys.path.
        sys.path.insert(0, str(script.resolve().parent))
        run = lambda: runpy.run_path(str(script), run_name="__main__")  # noqa: E731
    try:
        return _run_profiled(args, target, run)
    finally:  # a caller of main() in-process gets its interpreter state back
        sys.argv[:], sys.path[:] = saved_argv, saved_path


def _run_profiled(args: argparse.Namespace, target: str, run) -> int:
    import headroom as hr

    prefix = Path(args.out)
    status, failure, script_globals = 0, None, None
    with hr.track_memory(max_samples=args.max_samples) as mem:
        try:
            # the script's globals keep its model alive for the report's advice
            script_globals = run()
        except SystemExit as e:  # the script's own exit code is kept
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # the report up to the failure, then the error
            failure = e
            status = 1
    mem.report(file=sys.stderr if args.quiet else None)
    written = _write_reports(
        mem, prefix, plot=not args.no_plot, title=f"headroom profile: {target}"
    )
    del script_globals
    print("headroom profile: wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    if failure is not None:
        print(
            f"headroom profile: {target} raised (report above covers the run up to it):",
            file=sys.stderr,
        )
        traceback.print_exception(failure)
    return status


def _demo(args: argparse.Namespace) -> int:
    from headroom._demo import run_demo

    return run_demo(steps=args.steps, out=Path(args.out), plot=not args.no_plot)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headroom", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"headroom {__version__}")
    sub = parser.add_subparsers(
        dest="command", metavar="{demo,profile,estimate,plan}", title="commands"
    )

    demo = sub.add_parser(
        "demo", help="headroom's features on small models, each measured against plain PyTorch"
    )
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument(
        "--out", default="headroom_demo", help="prefix of the report files (default headroom_demo)"
    )
    demo.add_argument("--no-plot", action="store_true", help="skip the PNG timeline")
    demo.set_defaults(func=_demo)

    prof = sub.add_parser(
        "profile",
        help="run a training script under the memory tracker (like python -m cProfile);"
        " write its report (.txt, .json, .png)",
        description="Run a Python training script under headroom.track_memory() and write "
        "PREFIX.txt, PREFIX.json and PREFIX.png. A script that raises still gets its report "
        "up to the failure, then the error. The script must not open its own tracker.",
    )
    prof.add_argument("-m", dest="module", action="store_true", help="run TARGET as a module")
    prof.add_argument(
        "--out",
        default="headroom_report",
        help="prefix of the report files (default headroom_report)",
    )
    prof.add_argument("--no-plot", action="store_true", help="skip the PNG timeline")
    prof.add_argument("--quiet", action="store_true", help="print the table to stderr")
    prof.add_argument(
        "--max-samples", type=int, default=50_000, help="bound on timeline samples (default 50000)"
    )
    prof.add_argument("target", help="the script (or module, with -m)")
    prof.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    prof.set_defaults(func=_profile)

    from headroom.fit._cli import add_parsers

    add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
