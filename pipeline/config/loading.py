"""Reading the experiment config: a preset shipped in ``pipeline/config/presets/`` or a user's YAML
file, overridden with dotted keys (``--set optim.lr=1e-3``), validated against ``pipeline.config.schema``
into one ``ExperimentConfig``; every error names the key, the value and what is allowed.
"""
from __future__ import annotations

import copy
import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipeline import uris
from pipeline.config import papers
from pipeline.config.fields import SECRET_VALUE_ERROR
from pipeline.config.schema import EFFECTIVE_LR_PARAM, GLOBAL_BATCH_PARAM, LR_REFERENCE_BATCH, ExperimentConfig
from pipeline.errors import ConfigError
from pipeline.uris import location_problem

PRESET_DIR = Path(__file__).parent / "presets"


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _read_yaml(source: str) -> dict[str, Any]:
    """A preset name (``smoke``), a paper's row (``paper:003:xcit_small_12_p16``) or a path to a YAML file."""
    if papers.is_paper_spec(source):
        return paper_tree(source)
    path = Path(source)
    if path.suffix not in (".yaml", ".yml"):
        if source not in available_presets():
            raise ConfigError(
                f"config {source!r} is neither a preset ({', '.join(available_presets())}), a paper's recipe "
            "(paper:NNN[:ROW]) nor a .yaml file"
            )
        path = PRESET_DIR / f"{source}.yaml"
    problem = location_problem(path, kind="file")
    if problem:
        raise ConfigError(f"config file: {problem}")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        tree = load_yaml(read_utf8(path, "config file"))
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if not tree:
        # The schema's defaults are no preset's (300 epochs of another model): never run them by accident.
        raise ConfigError(
            f"config file {str(path)!r} is empty: it sets nothing. Start from a preset, e.g. "
            "`vitsweep config show --config default > my.yaml`, then edit it"
        )
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(tree).__name__}")
    return tree


def read_utf8(path: Path, what: str) -> str:
    """The text of ``path``; a ConfigError naming the first undecodable byte if it is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{what} {str(path)!r} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start} "
            f"(line {line}); save it as UTF-8"
        ) from None


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of a YAML document gives one key twice (PyYAML would keep the last value silently)."""


def load_yaml(text: str) -> Any:
    """``text`` read as ``yaml.safe_load`` reads it, but a key given twice in one mapping is a
    DuplicateKeyError naming the key (dotted from the top) and both lines: YAML requires unique keys."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, path: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias to a node already checked (or an anchor inside itself)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}.{index}" if path else str(index), seen)
    if not isinstance(node, yaml.MappingNode):
        return
    first_lines: dict[tuple[str, Any], int] = {}
    for key_node, value_node in node.value:
        key = (key_node.tag, key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node))
        dotted = f"{path}.{key_node.value}" if path else str(key_node.value)
        line = key_node.start_mark.line + 1
        if key_node.tag != "tag:yaml.org,2002:merge" and key in first_lines:  # `<<:` merges may be overridden
            lines = f"line {line}" if first_lines[key] == line else f"lines {first_lines[key]} and {line}"
            raise DuplicateKeyError(f"{dotted} is given twice ({lines}); keep one (YAML would silently use the last)")
        first_lines[key] = line
        _refuse_duplicate_keys(value_node, dotted, seen)


# YAML 1.1 reads 1e-3 (no dot) as a string; a learning rate should be a number.
_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def yaml_number(value: Any) -> Any:
    """``value`` with scientific-notation strings read as floats, in lists and mappings too."""
    if isinstance(value, str) and _SCIENTIFIC.match(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [yaml_number(v) for v in value]
    if isinstance(value, dict):
        return {k: yaml_number(v) for k, v in value.items()}
    return value


def parse_override(assignment: str) -> tuple[str, Any]:
    """``optim.lr=1e-3`` -> ("optim.lr", 0.001). Values are read as YAML scalars/lists."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    if any(not part for part in key.split(".")):
        raise ConfigError(f"override key {key!r} has an empty part")
    try:
        value = load_yaml(raw)
    except DuplicateKeyError as err:
        raise ConfigError(f"override {assignment!r}: {err}") from None
    except yaml.YAMLError:
        value = raw
    return key, yaml_number(value)


def get_dotted(tree: dict[str, Any], key: str, default: Any = None) -> Any:
    """The value at dotted ``key`` of a config tree (``key.N``: list element N), else ``default``."""
    node: Any = tree
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return default
    return node


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` in a config tree in place, creating sections on the way; ``key.N`` sets
    element N of a list-valued key (``model.args.mha_ratio_range.0``)."""
    head, _, tail = key.rpartition(".")
    if head and tail.isdigit() and not isinstance(get_dotted(tree, head), dict):
        current = get_dotted(tree, head)
        elements = list(current) if isinstance(current, (list, tuple)) else []
        elements += [None] * (int(tail) + 1 - len(elements))
        elements[int(tail)] = value
        key, value = head, elements
    parts = key.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {'.'.join(parts[:depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def with_dotted(tree: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``tree`` with each dotted key of ``values`` set."""
    tree = copy.deepcopy(tree)
    for key, value in values.items():
        set_dotted(tree, key, value)
    return tree


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for assignment in overrides:
        key, value = parse_override(assignment)
        try:
            set_dotted(tree, key, value)
        except ConfigError as err:
            raise ConfigError(f"override {assignment!r}: {str(err).partition(': ')[2]}") from None
    return tree


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds: its model, also where it may be null (``data.progressive``); else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def schema_problem(key: str) -> str | None:
    """Why dotted ``key`` names no value of the experiment config (valid keys listed), else None.

    ``model.args.<name>`` names a model constructor argument (checked by building the model); a
    trailing ``.N`` names element N of a tuple-valued key.
    """
    parts = key.split(".")
    if any(not part for part in parts):
        return f"{key!r} has an empty part; keys look like optim.lr or model.args.code_size"
    section: type[BaseModel] = ExperimentConfig
    for depth, part in enumerate(parts):
        fields = section.model_fields
        if part not in fields:
            prefix = ".".join(parts[:depth])
            close = difflib.get_close_matches(part, list(fields), n=1)
            hint = f" (did you mean {'.'.join([*parts[:depth], close[0]])!r}?)" if close else ""
            return f"{key!r} is not a config key{hint}; valid keys under {prefix or 'the config'}: {', '.join(fields)}"
        annotation = fields[part].annotation
        if (inner := _section(annotation)) is not None:
            section = inner
            continue
        rest, here = parts[depth + 1:], ".".join(parts[:depth + 1])
        if typing.get_origin(annotation) is dict:  # model.args: the model's constructor arguments
            if not rest or not rest[0].isidentifier() or not all(p.isdigit() for p in rest[1:]):
                return (f"{key!r} must name one argument under {here}, e.g. {here}.code_size "
                        "(a trailing .N sets list element N)")
            return None
        if rest and not (len(rest) == 1 and rest[0].isdigit() and typing.get_origin(annotation) in (tuple, list)):
            return f"{key!r}: {here} is a value, not a section"
        return None
    return f"{key!r} is a whole section; name one of its keys: {', '.join(f'{key}.{name}' for name in section.model_fields)}"


def _section_keys(loc: tuple[Any, ...]) -> list[str]:
    """The valid keys of the section holding ``loc`` (for 'unknown key' errors)."""
    section: type[BaseModel] = ExperimentConfig
    for part in loc[:-1]:
        field = section.model_fields.get(str(part))
        inner = _section(field.annotation) if field is not None else None
        if inner is None:
            return []
        section = inner
    return list(section.model_fields)


def describe_error(error: dict[str, Any], key: str, valid_keys: list[str]) -> str:
    """One pydantic error as a line naming the key, the value and what is allowed (configs, search spaces)."""
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(key.rpartition(".")[2], valid_keys, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{key}: unknown key{hint}; valid keys here: {', '.join(valid_keys)}"
    if error["type"] == "missing":
        return f"{key}: missing; it is required"
    if error["type"] == SECRET_VALUE_ERROR:
        return f"{key}: {message}"
    return f"{key} = {uris.redact(repr(error['input']))}: {message}"


def _describe(error: dict[str, Any]) -> str:
    key = ".".join(str(part) for part in error["loc"]) or "<config>"
    if error["type"] != "extra_forbidden" and _section_keys((*error["loc"], None)):
        return f"{key}: {error['msg'].removeprefix('Value error, ')}"  # a check across a section: its message names the keys
    return describe_error(error, key, _section_keys(error["loc"]))


def validate(tree: dict[str, Any]) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(tree)
    except ValidationError as err:
        lines = [_describe(e) for e in err.errors(include_url=False)]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def paper_tree(spec: str) -> dict[str, Any]:
    """The config tree training ``paper:NNN[:ROW]`` (default: the paper's first row): its setup with the
    row's cited values. The paper's rate is given per 512 images, scaled linearly: the paper's own global
    batch trains at its rate exactly, and another split of it over GPUs needs no edit."""
    recipe, row_name = papers.resolve(spec)
    row = recipe.row(row_name) if row_name else next(iter(recipe.rows.values()))
    values = {key: cited.value for key, cited in recipe.values(row).items()}
    batch, rate = values.pop(GLOBAL_BATCH_PARAM), values.pop(EFFECTIVE_LR_PARAM)
    per_512 = {"optim.lr": None, "optim.lr_per_512": rate * LR_REFERENCE_BATCH / batch, "optim.lr_scaling": "linear"}
    return with_dotted({}, {**recipe.setup, **row.setup, **values, **per_512})


def load_config(source: str | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load a preset or YAML file (default preset: ``default``), apply ``--set`` overrides, validate."""
    tree = _read_yaml(source or "default")
    return validate(apply_overrides(tree, list(overrides or [])))
