"""Ollama's Modelfile, as `tetrad create NAME -f Modelfile` reads it (torch-free).

    # comment
    FROM ./runs/ckpt            a model folder (relative to the Modelfile's folder) or a stored name
    SYSTEM You are a pirate.    the chat's system message when a conversation brings none
    TEMPLATE \"\"\"...\"\"\"          the chat template (Jinja, as HF's chat_template; see below)
    PARAMETER temperature 0.7   sampling and context defaults (PARAMETERS below)
    MESSAGE user Ahoy?          a conversation `tetrad run` starts with
    LICENSE \"\"\"...\"\"\"           kept with the model, shown by `tetrad show`

Instructions are case-insensitive; an argument is the rest of the line, a "quoted" string, or a
\"\"\"triple-quoted\"\"\" one that may span lines. Ollama's TEMPLATE is a Go template over .System /
.Prompt; tetrad renders chat templates in Jinja over `messages` (the language of HF's
tokenizer_config.json), so a Go template is refused with that fix rather than rendered wrong.
Every error is one line naming the line at fault: `Modelfile:4: ...`.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tetrad.errors import ConfigError

INSTRUCTIONS = ("FROM", "PARAMETER", "SYSTEM", "TEMPLATE", "MESSAGE", "LICENSE", "ADAPTER")
# Ollama's PARAMETER name -> (tetrad's setting, its type). max_model_len is the engine's context
# length; the rest are SamplingParams fields.
PARAMETERS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "repeat_penalty": ("repetition_penalty", float),
    "seed": ("seed", int),
    "stop": ("stop", str),
    "num_predict": ("max_tokens", int),
    "num_ctx": ("max_model_len", int),
}
ROLES = ("system", "user", "assistant")
SETTING_NAMES = {setting: name for name, (setting, _) in PARAMETERS.items()}  # tetrad's -> Ollama's
# A Modelfile is settings and text (a template, a license): a larger file is a mistake, such as a
# weights file passed with -f, and reading it whole would stall `tetrad create`.
MAX_MODELFILE_BYTES = 2**20
INT64_MAX = 2**63 - 1  # integer settings reach the engine as int64 (seeds, top_k, lengths)
GO_TEMPLATE = re.compile(r"\{\{-?\s*(\.|if\s+\.|range\s+\.)")


class ModelfileError(ConfigError):
    """A Modelfile tetrad cannot use; the message starts with `file:line:`."""


@dataclass
class Modelfile:
    source: str  # FROM: a folder or a stored model's name
    system: str | None = None
    template: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)  # tetrad names (PARAMETERS)
    messages: list[dict[str, str]] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    folder: Path = Path(".")  # a relative FROM is relative to the Modelfile's folder
    path: str = "Modelfile"  # what errors call it
    text: str = ""  # the Modelfile as written, kept with the stored model
    lines: dict[str, int] = field(default_factory=dict)  # setting -> its PARAMETER line (1-based)

    def where(self, *settings: str) -> str:
        """`path:line` of the PARAMETER that set the first of `settings` this Modelfile sets (the
        path alone when it sets none)."""
        lines = [self.lines[setting] for setting in settings if setting in self.lines]
        return f"{self.path}:{lines[0]}" if lines else self.path


def _argument(lines: list[str], index: int, text: str, where: str) -> tuple[str, int]:
    """The argument starting at `text` on line `index`: (value, index of its last line)."""
    if text.startswith('"""'):
        rest = text[3:]
        collected = []
        for end in range(index, len(lines)):
            chunk = rest if end == index else lines[end]
            if '"""' in chunk:
                value, _, after = chunk.partition('"""')
                if after.strip():
                    raise ModelfileError(f"{where}:{end + 1}: text after the closing \"\"\"")
                collected.append(value)
                return "\n".join(collected).strip("\n"), end
            collected.append(chunk)
        raise ModelfileError(f"{where}:{index + 1}: the \"\"\" opened here is never closed")
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1], index
    return text, index


def _parameter(argument: str, where: str) -> tuple[str, Any]:
    name, _, value = argument.partition(" ")
    name, value = name.lower(), value.strip()
    if name not in PARAMETERS:
        close = difflib.get_close_matches(name, PARAMETERS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ModelfileError(f"{where}: PARAMETER {name or '(none)'} is not one tetrad uses: "
                             f"{hint}use {', '.join(PARAMETERS)}")
    setting, kind = PARAMETERS[name]
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    try:
        parsed = kind(value)
    except ValueError:
        noun = {int: "an integer", float: "a number"}.get(kind, "a value")
        raise ModelfileError(f"{where}: PARAMETER {name} needs {noun}, got {value!r}") from None
    if name == "num_predict" and parsed < 0:
        return setting, None  # Ollama's -1: no limit but the context
    _check(setting, parsed, name, where)
    return setting, parsed


def _check(setting: str, value: Any, name: str, where: str) -> None:
    from tetrad.inference.core.params import SamplingParams

    try:
        if isinstance(value, int) and abs(value) > INT64_MAX:
            raise ConfigError(f"must fit in 64 bits (at most {INT64_MAX} in size), got "
                              f"{str(value)[:24]}...")
        if setting == "max_model_len":
            if value < 1:
                raise ConfigError(f"must be 1 or more, got {value}")
        elif setting == "stop":
            SamplingParams(stop=(value,))
        else:
            SamplingParams(**{setting: value})
    except ConfigError as error:
        raise ModelfileError(f"{where}: PARAMETER {name}: {error}") from None


def check_template(template: str, where: str) -> None:
    if GO_TEMPLATE.search(template):
        raise ModelfileError(
            f"{where}: TEMPLATE is an Ollama Go template ({{{{ .Prompt }}}}); tetrad renders "
            f"Jinja chat templates over `messages`, e.g. {{% for m in messages %}}"
            f"{{{{ m.role }}}}: {{{{ m.content }}}}{{% endfor %}}")
    try:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # the base install: the serving extra checks it when it renders
        return
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as error:
        raise ModelfileError(f"{where}: TEMPLATE is not valid Jinja: {error.message}") from None


def parse_modelfile(text: str, name: str = "Modelfile") -> Modelfile:
    lines = text.splitlines()
    found: dict[str, Any] = {"parameters": {}, "messages": [], "license": [], "lines": {},
                             "path": name, "text": text}
    stops: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index].strip()
        where = f"{name}:{index + 1}"
        if not line or line.startswith("#"):
            index += 1
            continue
        word, _, rest = line.partition(" ")
        instruction = word.upper()
        if instruction not in INSTRUCTIONS:
            close = difflib.get_close_matches(instruction, INSTRUCTIONS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ModelfileError(f"{where}: unknown instruction {word!r}: {hint}use "
                                 f"{', '.join(INSTRUCTIONS[:-1])}")
        argument, last = _argument(lines, index, rest.strip(), name)
        if not argument.strip() and instruction not in ("SYSTEM", "TEMPLATE"):
            raise ModelfileError(f"{where}: {instruction} needs an argument")
        if instruction == "FROM":
            if "source" in found:
                raise ModelfileError(f"{where}: a second FROM (one model per Modelfile)")
            found["source"] = argument.strip()
        elif instruction == "ADAPTER":
            raise ModelfileError(f"{where}: ADAPTER (LoRA) is not supported: merge the adapter "
                                 f"into the weights and use FROM on the result")
        elif instruction == "PARAMETER":
            setting, value = _parameter(argument, where)
            if setting == "stop":
                stops.append(value)
                check_stop_count(len(stops), where)
            else:
                found["parameters"][setting] = value
            found["lines"][setting] = index + 1
        elif instruction == "SYSTEM":
            found["system"] = argument
        elif instruction == "TEMPLATE":
            check_template(argument, where)
            found["template"] = argument
        elif instruction == "MESSAGE":
            role, _, content = argument.partition(" ")
            if role.lower() not in ROLES:
                raise ModelfileError(f"{where}: MESSAGE role {role!r} is not one of "
                                     f"{', '.join(ROLES)}")
            found["messages"].append({"role": role.lower(), "content": content.strip()})
        else:
            found["license"].append(argument)
        index = last + 1
    if "source" not in found:
        raise ModelfileError(f"{name}: no FROM line: add FROM <model folder or stored name>")
    if stops:
        found["parameters"]["stop"] = stops
    return Modelfile(**found)


def check_stop_count(count: int, where: str) -> None:
    """A model's stop strings are a request's when it sends none, so they obey the server's
    default limit per request (a server started with a lower `--max-stop-strings` checks again
    when it loads the model)."""
    from tetrad.inference.core.params import DEFAULT_MAX_STOP_STRINGS as limit
    if count > limit:
        raise ModelfileError(f"{where}: PARAMETER stop: {count} stop strings, at most {limit} (the "
                             f"server's limit per request)")


def check_parameters(parameters: Any, where: str) -> dict[str, Any]:
    """Stored settings (tetrad's names, as a Modelfile's `parameters`) held to the rules that
    PARAMETER lines are: a model written by an older tetrad, or edited by hand, fails here once
    with this message instead of failing every request."""
    if not isinstance(parameters, dict):
        raise ModelfileError(f"{where}: parameters must be an object, got "
                             f"{type(parameters).__name__}")
    for setting, value in parameters.items():
        if setting not in SETTING_NAMES:
            raise ModelfileError(f"{where}: parameter {str(setting)[:64]!r} is not one tetrad "
                                 f"uses: use {', '.join(SETTING_NAMES)}")
        name = SETTING_NAMES[setting]
        kind = PARAMETERS[name][1]
        if setting == "stop" and not isinstance(value, list):
            raise ModelfileError(f"{where}: PARAMETER stop must be a list of strings")
        for one in value if setting == "stop" else [value]:
            if one is None and setting == "max_tokens":
                continue
            allowed = {str: (str,), int: (int,), float: (int, float)}[kind]
            if isinstance(one, bool) or not isinstance(one, allowed):
                raise ModelfileError(f"{where}: PARAMETER {name} must be "
                                     f"{kind.__name__}, got {str(one)[:64]!r}")
            _check(setting, one, name, where)
    check_stop_count(len(parameters.get("stop", [])), where)
    return parameters


def read_modelfile(path: str | Path) -> Modelfile:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Modelfile {path} does not exist or is not a file")
    try:
        with open(path, "rb") as file:  # bounded: a file's size may not say (/proc) or may grow
            data = file.read(MAX_MODELFILE_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"Modelfile {path} cannot be read ({error.strerror})") from None
    if len(data) > MAX_MODELFILE_BYTES:
        raise ModelfileError(f"{path}: more than a Modelfile's {MAX_MODELFILE_BYTES // 2**20} MiB: "
                             f"is -f the right file?")
    try:
        text = data.decode()
    except UnicodeDecodeError as error:
        raise ModelfileError(f"{path}: not UTF-8 text (byte {error.start}): is -f the right "
                             f"file?") from None
    if "\0" in text:
        raise ModelfileError(f"{path}: holds NUL bytes, so it is not a text file: is -f the right "
                             f"file?")
    modelfile = parse_modelfile(text, str(path))
    modelfile.folder = path.resolve().parent
    return modelfile


def render_modelfile(source: str, system: str | None, template: str | None,
                     parameters: dict[str, Any], messages: list[dict[str, str]],
                     license: list[str]) -> str:
    """A Modelfile that recreates a stored model (`tetrad show --modelfile`)."""
    lines = [f"FROM {source}"]
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    if system is not None:
        lines.append(f'SYSTEM """{system}"""')
    for setting, value in parameters.items():
        for one in value if setting == "stop" else [value]:
            shown = -1 if one is None else one
            lines.append(f'PARAMETER {SETTING_NAMES[setting]} "{one}"' if setting == "stop"
                         else f"PARAMETER {SETTING_NAMES[setting]} {shown}")
    lines += [f"MESSAGE {m['role']} {m['content']}" for m in messages]
    lines += [f'LICENSE """{text}"""' for text in license]
    return "\n".join(lines) + "\n"
