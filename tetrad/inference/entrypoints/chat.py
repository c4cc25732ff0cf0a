"""Chat messages -> one prompt string. An HF folder's own chat template (chat_template.jinja, or
`chat_template` in tokenizer_config.json) when it has one; otherwise a plain transcript
("User: ...\\nAssistant:") that a model trained on raw text, such as tetrad's demo, can continue,
with "\\nUser:" as a stop string so the model does not write the user's next turn."""

from __future__ import annotations

import json
from pathlib import Path

from tetrad.errors import ConfigError

ROLES = ("system", "user", "assistant")
PLAIN_STOP = ("\nUser:",)


def message_text(content) -> str:
    """OpenAI content: a string, or a list of parts of which the text ones count (each needs its
    text as a string, as OpenAI checks it)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        texts = [part.get("text") for part in content if part.get("type") == "text"]
        if all(isinstance(text, str) for text in texts):
            return "".join(texts)
        raise ConfigError(f"a {{type: text}} content part needs its text as a string, got "
                          f"{next(t for t in texts if not isinstance(t, str))!r:.80}")
    raise ConfigError("message content must be a string or a list of {type: text} parts")


def load_chat_template(folder: str | Path | None) -> str | None:
    """The model folder's chat template, or None; a template file that is not UTF-8 text, or a
    tokenizer_config.json that is not a JSON object, is one ConfigError naming the file."""
    if folder is None or not Path(folder).is_dir():
        return None
    folder = Path(folder)
    template_file, config_file = folder / "chat_template.jinja", folder / "tokenizer_config.json"
    try:
        if template_file.is_file():
            return template_file.read_text()
        if not config_file.is_file():
            return None
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ConfigError(f"{template_file if template_file.is_file() else config_file} is not "
                          f"a chat template source ({type(error).__name__}: {error})"[:300]) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file} must hold a JSON object, got {type(config).__name__}")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{config_file}: chat_template must be text, got {type(template).__name__}")
    return template


class ChatFormatter:
    def __init__(self, template: str | None = None, system: str | None = None):
        """`system`: the system message of conversations that bring none (a stored model's
        Modelfile SYSTEM)."""
        self.template = None
        self.source = template or None  # the template's text (/tokenizer_info shows it)
        self.system = system
        if template:
            from tetrad.inference.entrypoints.template_sandbox import BoundedSandbox

            self.template = BoundedSandbox(trim_blocks=True, lstrip_blocks=True).from_string(
                template)
        self.stop = () if template else PLAIN_STOP

    def render(self, messages: list[dict], max_chars: int | None = None) -> str:
        """The prompt; a template's output past max_chars characters raises RenderTooLong."""
        if not messages:
            raise ConfigError("messages is empty: send at least one {role, content} message")
        cleaned = []
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise ConfigError(f"each message needs a role ({', '.join(ROLES)}) and content, "
                                  f"got {message!r:.200}")
            cleaned.append({"role": message["role"],
                            "content": message_text(message.get("content", ""))})
        if self.system and all(message["role"] != "system" for message in cleaned):
            cleaned.insert(0, {"role": "system", "content": self.system})
        if self.template is not None:
            from tetrad.inference.entrypoints.template_sandbox import render_bounded

            return render_bounded(self.template, max_chars, messages=cleaned,
                                  add_generation_prompt=True, bos_token="", eos_token="")
        lines = [f"{m['role'].capitalize()}: {m['content']}\n" for m in cleaned]
        return "".join(lines) + "Assistant:"
