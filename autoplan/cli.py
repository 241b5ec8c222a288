"""The ``autoplan`` command line.

Every command that produces a result takes ``--json``; bad usage exits with
code 2 and a message naming the closest valid choices; tracebacks only with
``--debug``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from typing import Any, Callable, Sequence

from .errors import AutoplanError

__all__ = ["main"]

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that suggests the closest subcommand / flag and exits with code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = ""
        if "invalid choice" in message and "'" in message:
            bad = message.split("'")[1]
            choices = [a for act in self._actions if isinstance(act, argparse._SubParsersAction)
                       for a in act.choices]
            near = difflib.get_close_matches(bad, choices, n=3)
            if near:
                hint = f" (did you mean: {', '.join(near)}?)"
        elif "unrecognized arguments" in message:
            flags = [o for act in self._actions for o in act.option_strings]
            for act in self._actions:   # the subcommands' flags too
                if isinstance(act, argparse._SubParsersAction):
                    flags += [o for p in act.choices.values() for a in p._actions for o in a.option_strings]
            bad = message.split(":", 1)[1].split()
            near = sorted({n for b in bad for n in difflib.get_close_matches(b.split("=")[0], flags, n=2)})
            if near:
                hint = f" (did you mean: {', '.join(near)}?)"
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}{hint}\n")


def _add_model_args(p: argparse.ArgumentParser, *, seq: bool = True) -> None:
    p.add_argument("model", help="zoo:<name>, hf:<model_type>, gpt, or path/to/file.py:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field of the model (repeatable)")
    if seq:
        p.add_argument("--seq-len", type=int, default=None,
                       help="tokens per sequence (default: the zoo entry's)")


def _load_model(args: argparse.Namespace):
    from .zoo import build_model, parse_model_args
    model, default_seq = build_model(args.model, parse_model_args(args.model_arg))
    seq = getattr(args, "seq_len", None) or default_seq
    return model, seq


def _emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(payload, indent=1) + "\n")
    else:
        sys.stdout.write(text.rstrip("\n") + "\n")


# ------------------------------------------------------------------ commands
def _cmd_trace(args: argparse.Namespace) -> int:
    from .capture import trace
    from .records import atomic_write_text
    model, seq = _load_model(args)
    if seq is None:
        raise AutoplanError(f"{args.model} needs --seq-len")
    graph = trace(model, seq_len=seq, micro_batch=args.micro_batch)
    if args.out:
        atomic_write_text(args.out, graph.to_json())
    table = graph.layer_table()
    text = (f"{graph.model}: {graph.num_params / 1e9:.2f}B parameters, {len(graph.blocks)} blocks, "
            f"captured with {graph.capture}, objective {graph.objective}\n"
            f"per micro-batch of {graph.micro_batch} x {graph.seq_len} tokens: "
            f"forward {graph.fwd_flops / 1e12:.2f} TFLOP, backward {graph.bwd_flops / 1e12:.2f} TFLOP, "
            f"saved activations {graph.saved_bytes / 2**30:.2f} GiB\n\n"
            + table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    _emit(args, graph.to_dict(), text)
    return 0


def _cmd_profile(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from .hardware import profiler
    return int(profiler.main(list(rest)))


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {}


def _register(name: str, help_: str, build: Callable[[argparse.ArgumentParser], None],
              run: Callable) -> None:
    COMMANDS[name] = (help_, build, run)


def _build_trace(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--out", help="write the graph JSON to this file")
    p.add_argument("--json", action="store_true", help="print the graph as JSON")


_register("trace", "capture a model as a costed layer graph", _build_trace, _cmd_trace)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autoplan", description="Automatic parallelism planner for PyTorch training")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("profile", help="measure this machine and write a hardware profile "
                                   "(see autoplan profile --help)", add_help=False)
    for name, (help_, build, _) in COMMANDS.items():
        build(sub.add_parser(name, help=help_))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    parser = build_parser()
    if argv and argv[0] == "profile":
        runner: Callable[[], int] = lambda: _cmd_profile(args, argv[1:])  # noqa: E731
        args = argparse.Namespace(command="profile")
    else:
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        runner = lambda: COMMANDS[args.command][2](args)  # noqa: E731
    try:
        return runner()
    except AutoplanError as exc:
        if debug:
            raise
        sys.stderr.write(f"autoplan {args.command}: error: {exc}\n")
        return EXIT_USAGE if isinstance(exc, (ValueError, KeyError)) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
