"""The ``kt-ops`` command (``python -m kt_ops`` is the same): one entry point for kt_ops' tools.

    kt-ops doctor          what runs here and why (kt_ops.doctor())
    kt-ops bench ARGS      the benchmark (python -m kt_ops.bench's options)
    kt-ops convert ARGS    the CPU-weight converter (python -m kt_ops.convert's options)
    kt-ops inspect PATH    what a weight file or directory holds (kt_ops.inspection)
    kt-ops generate MODEL --prompt TEXT   load a model (or a GGUF file) with kt_ops experts, stream text, print tokens/s

Exit status 0 on success, 2 for a bad argument or path (the last stderr line says what is
wrong; argparse's usage line may precede it), 1 when the work itself fails (e.g. a
conversion step), 130 on Ctrl-C, 143 on SIGTERM (both cleaned up after, one stderr line), 141 when the
output pipe closes early (``| head``).
User errors print no traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from kt_ops import __version__

PROG = "kt-ops"
COMMANDS = {
    "doctor": "what runs on this machine and why: CPU variant, every variant's status, AMX, NUMA, huge pages, "
              "threads, kernels per format, optional packages",
    "bench": "time the MoE kernels against the machine's limits (python -m kt_ops.bench; "
             "'kt-ops bench --help' lists its options)",
    "convert": "convert a Hugging Face checkpoint's routed experts to packed INT8/INT4/FP8/MXFP4 CPU weights "
               "(python -m kt_ops.convert; its --help lists the options)",
    "inspect": "what a packed file, converted directory, GGUF file/directory or Hugging Face checkpoint holds",
    "generate": "load a Hugging Face model with its experts packed by kt_ops (or a GGUF file), stream a continuation "
                "of --prompt and print prefill/decode tokens/s (python -m kt_ops.generate; 'kt-ops generate --help')",
}


def build_parser() -> argparse.ArgumentParser:
    """``kt-ops``' parser. ``bench``, ``convert`` and ``generate`` appear for their help lines only:
    :func:`main` hands their arguments to the tools' own parsers."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="kt_ops' tools: PyTorch MoE operators on the CPU.",
        epilog="'kt-ops COMMAND --help' shows a command's options. 'python -m kt_ops' is the same program.")
    parser.add_argument("--version", action="version", version=f"kt_ops {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor = commands.add_parser("doctor", help=COMMANDS["doctor"], description=COMMANDS["doctor"] + ".")
    doctor.set_defaults(run=_doctor)
    for name in ("bench", "convert", "generate"):
        commands.add_parser(name, help=COMMANDS[name], add_help=False)
    inspect = commands.add_parser(
        "inspect", help=COMMANDS["inspect"],
        description=COMMANDS["inspect"] + ": MoE layers, E/H/I, the format or ggml type of gate/up/down, bytes, "
        "and the kernel that would run them under the active CPU variant. Reads metadata only.")
    inspect.add_argument("path", metavar="PATH", help="a file or directory of weights")
    inspect.add_argument("--json", action="store_true", help="print the result as JSON")
    inspect.set_defaults(run=_inspect)
    return parser


def _doctor(args: argparse.Namespace) -> int:
    from kt_ops.diagnostics import doctor

    print(doctor())
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from kt_ops.inspection import format_inspection, inspect_weights

    try:
        result = inspect_weights(args.path)
    except (OSError, ValueError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"{PROG} inspect: error: {message}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else format_inspection(result))
    return 0


def _bench(argv: list[str]) -> int:
    from kt_ops.bench.__main__ import main as bench_main

    return bench_main(argv, prog=f"{PROG} bench")


def _convert(argv: list[str]) -> int:
    from kt_ops.convert import main as convert_main

    return convert_main(argv, prog=f"{PROG} convert")


def _generate(argv: list[str]) -> int:
    from kt_ops.generate import main as generate_main

    return generate_main(argv, prog=f"{PROG} generate")


# Commands whose arguments go unparsed to the tool's own main(argv) -> int.
FORWARDED: dict[str, Callable[[list[str]], int]] = {"bench": _bench, "convert": _convert, "generate": _generate}


def _exit_status(code: object) -> int:
    """``SystemExit.code`` as an int (argparse: 0 for --help, 2 for a bad argument)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``kt-ops`` on ``argv`` (default ``sys.argv[1:]``) and returns its exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    return run_program(lambda: _main(args_list))


def _main(args_list: list[str]) -> int:
    if args_list and args_list[0] in FORWARDED:
        return FORWARDED[args_list[0]](args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help(sys.stderr)
        print(f"{PROG}: error: a command is required: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return args.run(args)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C is, so the same clean-up runs (a
    conversion's temporaries, a failed first layer's output directory)."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def run_program(run: Callable[[], int], prog: str = PROG) -> int:
    """``run()``'s exit status as a program's: ``SystemExit``'s code, 130 with one line on
    stderr (no traceback) on Ctrl-C, 143 likewise on SIGTERM (where its handler is the
    default one: it ended the process at once, leaving temporaries behind), 141 when
    stdout's reader left. The tools' own ``python -m`` entry points go through it too
    (their ``main`` lets Ctrl-C propagate)."""
    import signal
    import threading

    handled = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if handled:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return run()
    except SystemExit as exit:
        return _exit_status(exit.code)
    except KeyboardInterrupt as error:
        terminated = isinstance(error, Terminated)
        print(f"\n{prog}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    except BrokenPipeError:  # `kt-ops doctor | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        if handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
