"""Writes megatron_core/training/megatron_lm_flags.json: every flag of Megatron-LM's pretraining parser
(``megatron.training.arguments.add_megatron_arguments``) with its argparse kind and default, read from a
Megatron-LM checkout, so that ``pretrain_gpt.py`` can recognize each one and tests can compare defaults.

    git clone https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM
    python scripts/extract_megatron_flags.py /tmp/Megatron-LM
    python scripts/extract_megatron_flags.py --docs    # only rewrite the flag table in docs/megatron_lm.md

Megatron-LM's parser builds many flags from its config dataclasses, so the table is read off the parser
itself rather than the source text. (Python 3.11: ``typing.override`` is 3.12's; a no-op stands in.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import typing


def _plain(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def read_flags(checkout: str) -> dict:
    if not hasattr(typing, "override"):
        typing.override = lambda function: function
    sys.path.insert(0, checkout)
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    flags = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        nargs = action.nargs if isinstance(action.nargs, (int, type(None))) else str(action.nargs)
        for option in action.option_strings:
            flags[option] = {"dest": action.dest, "action": type(action).__name__, "default": _plain(action.default),
                             "nargs": nargs,
                             "choices": [str(c) for c in action.choices] if action.choices else None,
                             "type": getattr(action.type, "__name__", None) if action.type else None}
    return flags


DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "megatron_lm.md")
START, END = "<!-- megatron-flag-table:start -->\n", "<!-- megatron-flag-table:end -->"


def docs_table() -> str:
    """The block of docs/megatron_lm.md between the markers, from the table and pretrain_gpt.py's parser."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_core.training.arguments import build_parser
    from megatron_core.training.megatron_table import markdown

    ours = {o for a in build_parser()._actions for o in a.option_strings if not a.dest.startswith("megatron_no_op_")}
    return START + markdown(ours) + END


def write_docs() -> None:
    with open(DOCS, encoding="utf-8") as handle:
        text = handle.read()
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    with open(DOCS, "w", encoding="utf-8") as handle:
        handle.write(before + docs_table() + after)
    print(f"wrote the flag table of {DOCS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", nargs="?", help="a Megatron-LM checkout")
    parser.add_argument("--docs", action="store_true", help="only rewrite the table in docs/megatron_lm.md")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                         "megatron_core", "training", "megatron_lm_flags.json"))
    args = parser.parse_args()
    if args.docs:
        write_docs()
        return
    if args.checkout is None:
        parser.error("give a Megatron-LM checkout (or --docs)")
    commit = subprocess.run(["git", "-C", args.checkout, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    flags = read_flags(args.checkout)
    lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(flags.items())]
    with open(args.output, "w") as handle:
        handle.write('{"megatron_lm_commit": ' + json.dumps(commit) + ', "flags": {\n' + ",\n".join(lines) + "\n}}\n")
    print(f"wrote {args.output}: {len(flags)} flags of Megatron-LM {commit}")
    write_docs()


if __name__ == "__main__":
    main()
