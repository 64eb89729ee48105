"""Option parsing shared by ``opefo-train``, ``opefo-eval`` and ``opefo-plot``: one behaviour for recipes, flags and
bad input.

Options are the fields of dataclasses, parsed by TRL's ``TrlParser`` (`--flag value` with the field's name, TRL's
snake_case; ``--config recipe.yaml`` sets them from a YAML mapping, the command line overrides it). On top of TRL:

- ``--config=PATH`` works like ``--config PATH``, and a missing recipe file is named before anything is parsed;
- a recipe may build on another (``base: base.yaml``, merged key by key: :mod:`opefo_trl.cli.recipe_files`);
- abbreviations are refused (argparse would read ``--num_generation`` as ``--num_generations``);
- an unknown recipe key or command-line flag is reported with the closest option names, and a value that no flag
  takes (``--learning_rate 1e-5 z``) as such, before TRL parses anything or any dataclass is built (so TRL never
  raises its own unknown-argument errors, and these come before, e.g., transformers' "Your setup doesn't support
  bf16/gpu" for a GPU recipe parsed on a CPU machine);
- a recipe value of the wrong type (``max_steps: 2.5``, ``num_generations: [2]``), which argparse does not convert
  and the dataclasses do not check, is reported with its key and a corrected example (:func:`check_recipe_values`);
- values given without a flag can belong to one list option (``positional``: ``opefo-plot RUN... --output x.png``).

transformers' parser also accepts each ``--snake_case`` flag spelt ``--kebab-case``; ``--help`` lists both.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Options:
    ...     learning_rate: float = 1e-6
    >>> parser = build_parser([Options], prog="demo")
    >>> parse_options(parser, ["--learning_rat", "2e-6"])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: Unknown option(s) on the command line: 'learning_rat' (did you mean 'learning_rate'?).
    `demo --help` lists every option; remove or fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import logging
import os
import sys
import types
import typing
from collections.abc import Iterable, Sequence

CONFIG_FLAG = "--config"
INPUT_ERRORS = (ValueError, FileNotFoundError, ImportError)
"""What bad input raises (options, files, columns, missing extras): reported by :func:`report_error`, no traceback."""


def build_parser(
    dataclass_types: Iterable[type],
    *,
    prog: str,
    description: str | None = None,
    epilog: str | None = None,
    groups: Sequence[tuple[str, Iterable[str]]] = (),
    other_options: str | None = None,
    usage: str | None = None,
    renamed: dict[str, str] | None = None,
):
    """A ``TrlParser`` over ``dataclass_types`` that refuses abbreviations and lists ``--config`` in ``--help``.

    ``groups``: (title, option names) listed first by ``--help``, in this order; the other options follow under
    ``other_options`` (argparse's "options" when None). Parsing is the same. ``usage``: the usage line (argparse's
    lists every option). ``renamed``: {old name: new name} of options no longer taken, named in the error.
    """
    from trl import TrlParser

    parser = TrlParser(
        list(dataclass_types),  # type: ignore[arg-type]  # TRL's DataClassType: a NewType no plain class matches
        prog=prog,
        description=description,
        epilog=epilog,
        usage=usage,
        allow_abbrev=False,
    )
    # Listed for --help only: TrlParser takes `--config PATH` out of the arguments before parsing them.
    parser.add_argument(
        CONFIG_FLAG,
        metavar="RECIPE_YAML",
        help="YAML mapping of option: value (plus an optional `env:` mapping of environment variables, and an "
        "optional `base:` recipe it adds to or replaces keys of, relative to its folder); command-line options "
        "override it.",
    )
    _group_help(parser, groups, other_options)
    parser.renamed_options = dict(renamed or {})  # type: ignore[attr-defined]  # read by _unknown_names_error
    return parser


def _group_help(parser, groups: Sequence[tuple[str, Iterable[str]]], other_options: str | None) -> None:
    """Move the actions of each group's options (every spelling: --name, --kebab-name, --no_name) into an argument
    group of their own, in the order the group names them, listed by ``--help`` before the rest."""
    rest = parser._optionals
    made = []
    for title, names in groups:
        order = {name: i for i, name in enumerate(names)}
        group = parser.add_argument_group(title)
        moved = [action for action in rest._group_actions if action.dest in order]
        rest._group_actions[:] = [action for action in rest._group_actions if action.dest not in order]
        group._group_actions.extend(sorted(moved, key=lambda action: order[action.dest]))  # in the group's order
        made.append(group)
    if made:
        parser._action_groups[:] = [parser._positionals, *made, rest]
    if other_options is not None:
        rest.title = other_options


def option_names(parser) -> list[str]:
    """The option names of the parser's dataclasses (recipe keys and flags without ``--``)."""
    return sorted({f.name for cls in parser.dataclass_types for f in dataclasses.fields(cls) if f.init})


def _normalise_config_flag(argv: list[str]) -> list[str]:
    """``--config=PATH`` as ``--config PATH`` (the only form TrlParser reads); checks there is one existing recipe."""
    normalised, config_path = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "="):
            if config_path is not None:
                raise ValueError("`--config` was given twice; pass one recipe file.")
            if arg == CONFIG_FLAG:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ValueError("`--config` needs the path of a recipe YAML file, e.g. `--config recipe.yaml`.")
                config_path, i = argv[i + 1], i + 2
            else:
                config_path, i = arg.split("=", 1)[1], i + 1
            normalised += [CONFIG_FLAG, config_path]
            continue
        normalised.append(arg)
        i += 1
    if config_path is not None and not os.path.isfile(config_path):
        raise FileNotFoundError(f"Recipe file {config_path!r} does not exist (working directory: {os.getcwd()}).")
    return normalised


def _recipe_path(argv: Sequence[str]) -> str | None:
    return argv[argv.index(CONFIG_FLAG) + 1] if CONFIG_FLAG in argv else None


def _did_you_mean(names: Sequence[str], known: Sequence[str], renamed: dict[str, str]) -> str:
    described = []
    for name in names:
        if name in renamed:
            described.append(f"{name!r} (renamed: use {renamed[name]!r})")
            continue
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        described.append(f"{name!r}{hint}")
    return "; ".join(described)


def _unknown_names_error(names: Sequence[str], known: Sequence[str], *, kind: str, where: str, parser) -> ValueError:
    renamed = getattr(parser, "renamed_options", {})
    return ValueError(
        f"Unknown {kind} {where}: {_did_you_mean(names, known, renamed)}. `{parser.prog} --help` lists every option; "
        f"remove or fix {'it' if len(names) == 1 else 'them'}."
    )


def _refuse_unknown_names(parser, argv: Sequence[str], recipe_values: dict | None, recipe: str | None) -> None:
    """Unknown recipe keys, then unknown command-line options, before any dataclass is built."""
    known = option_names(parser)
    if recipe_values:
        names = [key for key in recipe_values if key != "env" and key not in known]
        if names:
            raise _unknown_names_error(names, known, kind="key(s)", where=f"in recipe {recipe!r}", parser=parser)
    flags = parser._option_string_actions  # every spelling argparse accepts (--name, --kebab-name, --no_name)
    names = [arg.split("=", 1)[0][2:] for arg in argv if arg.startswith("--") and len(arg) > 2]
    names = [name for name in names if f"--{name}" not in flags]
    if names:
        raise _unknown_names_error(names, known, kind="option(s)", where="on the command line", parser=parser)


# The types of recipe values are checked here: argparse converts command-line strings (and string defaults), not YAML
# numbers and lists.
def _accepts(annotation, value, top_level: bool = True) -> bool:
    """Whether a YAML value fits a dataclass field's annotation. Text at the top level is left to argparse, which
    converts (and checks) text defaults; inside a list nothing converts it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is typing.Any or (top_level and isinstance(value, str)):
        return True
    if origin is typing.Union or origin is types.UnionType:
        return any(_accepts(a, value, top_level) for a in args)
    if annotation is type(None):
        return value is None
    if origin is list or annotation is list:
        item = args[0] if args else typing.Any
        return top_level and all(_accepts(item, v, False) for v in (value if isinstance(value, list) else [value]))
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    if isinstance(value, (list, dict)):
        return False
    if annotation is str:
        return top_level or isinstance(value, str)  # a YAML number or boolean for a text option reads as its text
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is typing.Literal:
        return value in args
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, annotation)
    return True  # a type argparse does not know either: the dataclass checks it


_NAMES = {type(None): ("null", "nulls"), bool: ("true or false", "booleans"), int: ("an integer", "integers")}
_NAMES.update({float: ("a number", "numbers"), str: ("text", "strings")})


def _describe(annotation, plural: bool = False) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(dict.fromkeys(_describe(a, plural) for a in args))
    if origin is list or annotation is list:
        return f"a list of {_describe(args[0], plural=True)}" if args else "a list"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if annotation in _NAMES:
        return _NAMES[annotation][plural]
    return ("mappings" if plural else "a mapping") if origin is dict or annotation is dict else str(annotation)


def _example(annotation, value):
    """A corrected value for the message: the item of a one-item list, a whole float as an integer."""
    if isinstance(value, list) and len(value) == 1 and _accepts(annotation, value[0]):
        return value[0]
    if isinstance(value, float) and value.is_integer() and _accepts(annotation, int(value)):
        return int(value)
    return None


def check_recipe_values(parser, recipe_values: dict, recipe: str | None) -> None:
    """Refuse recipe values whose type does not fit their option, naming every one with its expected type.

    A YAML number or list reaches the dataclass as it is (argparse converts only text), so ``max_steps: 2.5`` or
    ``num_generations: [2]`` would otherwise fail deep inside training.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Options:
        ...     max_steps: int = -1
        >>> check_recipe_values(build_parser([Options], prog="demo"), {"max_steps": 2.0}, "r.yaml")
        Traceback (most recent call last):
        ...
        ValueError: Recipe 'r.yaml': `max_steps: 2.0` is a float, but max_steps takes an integer (e.g. `max_steps: 2`).
    """
    annotations = {}
    for cls in parser.dataclass_types:
        hints = typing.get_type_hints(cls)  # the declared types (HfArgumentParser narrows the Field objects' .type)
        annotations.update({f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init})
    problems = []
    for key, value in recipe_values.items():
        if key not in annotations or _accepts(annotations[key], value):
            continue
        annotation = annotations[key]
        example = _example(annotation, value)
        hint = "" if example is None else f" (e.g. `{key}: {example}`)"
        kind = type(value).__name__
        problems.append(
            f"`{key}: {value}` is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, but {key} takes "
            f"{_describe(annotation)}{hint}"
        )
    if problems:
        raise ValueError(f"Recipe {recipe!r}: " + "; ".join(problems) + ".")


def _split_values(parser, argv: Sequence[str], positional: bool = False) -> tuple[list[str], list[str]]:
    """``argv`` as argparse reads it: ``(flags with the values each takes, the values no flag takes)``.

    A flag keeps its own values: a list option every value up to the next flag, an optional value (a boolean's
    true / false) the next value (with ``positional``, only one that converts: the others are positional values),
    any other option the value after it. A negative number is a value, as argparse reads it when no option looks
    like one; ``-x``, which no option is spelt as, is a value no flag takes.
    """

    def converts(action, value: str) -> bool:
        try:
            (action.type or str)(value)
        except Exception:  # what argparse would refuse as this option's value
            return False
        return True

    def is_flag(arg: str) -> bool:
        return arg.startswith("-") and arg != "-" and not parser._negative_number_matcher.match(arg)

    flags = parser._option_string_actions
    kept: list[str] = []
    stray: list[str] = []
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        action = flags.get(arg)  # None for `--flag=value` (its value is in it) and for unknown flags
        if not is_flag(arg) or (action is None and not arg.startswith("--")):
            stray.append(arg)
            continue
        kept.append(arg)
        if action is None:
            continue
        if action.nargs in ("+", "*"):
            while i < len(argv) and not is_flag(argv[i]):
                kept.append(argv[i])
                i += 1
        elif action.nargs == "?":
            if i < len(argv) and not is_flag(argv[i]) and (not positional or converts(action, argv[i])):
                kept.append(argv[i])
                i += 1
        elif action.nargs is None or isinstance(action.nargs, int):
            count = 1 if action.nargs is None else action.nargs
            while count and i < len(argv) and not is_flag(argv[i]):  # argparse reports a missing value itself
                kept.append(argv[i])
                i, count = i + 1, count - 1
    return kept, stray


def _positional_values_as_option(parser, argv: list[str], name: str) -> list[str]:
    """``argv`` with the values that follow no flag (:func:`_split_values`) moved behind ``--name`` (a list
    option)."""
    kept, positional = _split_values(parser, argv, positional=True)
    if not positional:
        return kept
    _refuse_stray_values([a for a in positional if a.startswith("-") and a != "-"])
    option = parser._option_string_actions[f"--{name}"]
    if any(arg.split("=", 1)[0] in option.option_strings for arg in kept):
        raise ValueError(f"{name} given both as arguments ({' '.join(positional)}) and with --{name}; give them once.")
    return [f"--{name}", *positional, *kept]


def _refuse_stray_values(stray: Sequence[str]) -> None:
    """Values that no flag takes (:func:`_split_values`), refused before TRL parses the command line."""
    if stray:
        raise ValueError(
            f"Unexpected value(s) on the command line: {stray}. Options take the form `--name value`; a list "
            "option takes its values after one flag (`--name a b`)."
        )


def parse_options(parser, argv: Sequence[str] | None = None, *, positional: str | None = None) -> tuple:
    """Parse a recipe plus command-line flags into one instance per dataclass of ``parser`` (:func:`build_parser`).

    The recipe is read with its bases (``base: other.yaml``, :mod:`opefo_trl.cli.recipe_files`) and every file's keys
    are checked, naming the file; TRL's parser then takes the merged mapping as defaults, which the command line
    overrides.
    ``positional`` names a list option that also takes the values given without a flag (``opefo-plot``'s runs).

    Raises:
        ValueError: an unknown or misspelt recipe key or flag (with the closest option names), a recipe key given
            twice, a value no flag takes, a recipe that is not a YAML mapping, a base that forms a cycle, or a value
            a dataclass refuses.
        FileNotFoundError: the recipe file or its base does not exist.
    """
    from opefo_trl.cli.recipe_files import ENV_KEY, merge_recipe_chain, read_recipe_chain

    argv = _normalise_config_flag(list(sys.argv[1:] if argv is None else argv))
    if positional is not None:
        argv = _positional_values_as_option(parser, argv, positional)
    recipe = _recipe_path(argv)
    chain = read_recipe_chain(recipe) if recipe is not None else []
    for path, values in chain:
        _refuse_unknown_names(parser, [], values, path)
    command_line = [arg for i, arg in enumerate(argv) if CONFIG_FLAG not in (arg, argv[i - 1] if i else None)]
    _refuse_unknown_names(parser, command_line, None, None)
    _refuse_stray_values(_split_values(parser, command_line)[1])
    for path, values in chain:
        check_recipe_values(parser, values, path)
    merged = merge_recipe_chain(chain)
    for key, value in merged.pop(ENV_KEY, {}).items():  # as TRL sets a recipe's `env:`
        os.environ[key] = str(value)
    parser.set_defaults_with_config(**merged)  # TRL's own step for a --config file's mapping
    parsed = parser.parse_args_and_config(command_line, fail_with_unknown_args=True)
    return tuple(parsed[: len(parser.dataclass_types)])  # drop the namespace holding the help-only `config`


def report_error(prog: str, err: Exception) -> int:
    """Print ``PROG: error: MESSAGE`` to stderr, as argparse reports bad input, and return exit status 2."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    return 2


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a message is logged: a CLI's ``main`` may run again after stderr was
    replaced (a notebook cell, a test capturing output), and a handler keeping the old stream would write to a closed
    one."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def show_package_logs(prog: str) -> None:
    """Print opefo_trl's INFO messages (data set size, dropped rows) as ``[time] [prog] message``, without touching
    other libraries' logging: INFO on the main process only, warnings from every rank."""
    package_logger = logging.getLogger("opefo_trl")
    if not package_logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(f"[%(asctime)s] [{prog}] %(message)s", "%H:%M:%S"))
        package_logger.addHandler(handler)
        main_process = os.environ.get("RANK", "0") == "0"
        package_logger.setLevel(logging.INFO if main_process else logging.WARNING)
