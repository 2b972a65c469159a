"""Chat prompts: a conversation rendered with the target model's chat template, as transformers does it.

DFlash drafts are trained on chat-formatted text, so a chat request must give the target the
very prompt that transformers' `apply_chat_template` gives. The template comes from the target
folder: `chat_template.jinja` (newer checkpoints; it wins, as in transformers), else
tokenizer_config.json's `chat_template` (a string, or a list of named templates of which
"default" is used). It is rendered the way transformers renders it: a sandboxed jinja2
environment with trim_blocks and lstrip_blocks, transformers' globals (`raise_exception`,
`strftime_now`, `dict`, `namespace`) and `tojson` filter, the special tokens of
tokenizer_config.json (bos_token, eos_token, ...) as variables and the request's template
kwargs over them. Transformers itself is not needed.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.config import CheckpointError
from common.rpc import pb

log = logging.getLogger("drafter_svc")

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# transformers' named special tokens; any other top-level "*_token" string is passed as well.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Variables the renderer sets itself: a template kwarg may not override them.
RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
MAX_MESSAGES = 4096
MAX_CHAT_BYTES = 8 << 20  # roles, contents and template kwargs together, UTF-8
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class ChatPrompt:
    """A validated conversation: what the template sees besides the special tokens."""
    messages: list[dict[str, str]]
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, str | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("chat has no messages")
        if len(self.messages) > MAX_MESSAGES:
            raise ValueError(f"chat has {len(self.messages)} messages, the limit is {MAX_MESSAGES}")
        size = 0
        for i, m in enumerate(self.messages):
            if set(m) != {"role", "content"} or not all(isinstance(v, str) for v in m.values()):
                raise ValueError(f"chat message {i} must have a string role and a string content")
            if not m["role"]:
                raise ValueError(f"chat message {i} has an empty role")
            size += len(m["role"].encode()) + len(m["content"].encode())
        for key, value in self.template_kwargs.items():
            if not isinstance(key, str) or not key or not isinstance(value, (str, bool)):
                raise ValueError(f"template kwarg {key!r} must have a non-empty name and a string or boolean value")
            if key in RESERVED_KWARGS:
                raise ValueError(f"template kwarg {key!r} is reserved (one of {sorted(RESERVED_KWARGS)})")
            size += len(key.encode()) + (len(value.encode()) if isinstance(value, str) else 0)
        if size > MAX_CHAT_BYTES:
            raise ValueError(f"chat of {size} bytes exceeds the limit of {MAX_CHAT_BYTES}")

    @classmethod
    def from_proto(cls, chat: pb.Chat) -> ChatPrompt:
        """A `Chat` message: add_generation_prompt defaults to true, "true"/"false" kwargs become booleans."""
        kwargs = {k: {"true": True, "false": False}.get(v, v) for k, v in chat.template_kwargs.items()}
        return cls(messages=[{"role": m.role, "content": m.content} for m in chat.messages],
                   add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
                   template_kwargs=kwargs)


class ChatTemplate:
    """A target's chat template, compiled once, and the special tokens it is rendered with.

    `source` None: the model has no template. A template that does not compile is kept as an
    error for chat requests, so that text and token-id requests are still served."""

    def __init__(self, source: str | None, special_tokens: Mapping[str, str]):
        self.source, self.special_tokens = source, dict(special_tokens)
        self._template: jinja2.Template | None = None
        if source is None:
            self.error = (f"the target model has no chat template (neither {TEMPLATE_FILE} nor a chat_template "
                          f"in {CONFIG_FILE}): send the prompt as text or token_ids")
            return
        try:
            self._template = _ENVIRONMENT.from_string(source)
            self.error = ""
        except jinja2.TemplateSyntaxError as exc:
            self.error = f"the target model's chat template is malformed: line {exc.lineno}: {_one_line(exc.message)}"

    def render(self, chat: ChatPrompt) -> str:
        """The prompt text; ValueError with a one-line message when there is no usable template or it fails."""
        if self._template is None:
            raise ValueError(self.error)
        variables = {**self.special_tokens, **chat.template_kwargs}
        try:  # the immutable sandbox keeps the template from changing the messages
            return self._template.render(messages=chat.messages, tools=None, documents=None,
                                         add_generation_prompt=chat.add_generation_prompt, **variables)
        except _TemplateRaised as exc:
            raise ValueError(f"the chat template refused the conversation: {_one_line(exc)}") from None
        except Exception as exc:  # a template is a program: whatever it hits is about this conversation
            raise ValueError(f"the chat template failed on this conversation: {type(exc).__name__}: "
                             f"{_one_line(exc)}") from None


def load_chat_template(folder: str | Path) -> ChatTemplate:
    """The chat template of a checkpoint folder (ChatTemplate(None, ...) when it has none).

    Raises CheckpointError when tokenizer_config.json or chat_template.jinja cannot be read."""
    folder = Path(folder)
    config = _read_config(folder / CONFIG_FILE)
    special = _special_tokens(config)
    jinja_file = folder / TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            source = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{jinja_file} could not be read: {exc}") from None
    else:
        source = _config_template(config, folder / CONFIG_FILE)
    template = ChatTemplate(source, special)
    if template.error and source is not None:
        log.warning("%s; chat requests will be refused", template.error)
    return template


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} could not be read: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return config


def _config_template(config: dict, path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or [{"name", "template"}, ...] of which "default"."""
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise CheckpointError(f"{path} has named chat templates {sorted(map(str, named))} but none is \"default\"")
        value = named["default"]
    if value is not None and not isinstance(value, str):
        raise CheckpointError(f"{path}: chat_template must be a string or a list of named templates")
    return value


def _special_tokens(config: dict) -> dict[str, str]:
    """The special-token variables transformers passes to templates: the named ones (a string or a
    serialized AddedToken), every other top-level "*_token" string, and a dict of extra_special_tokens."""
    tokens: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    tokens |= {k: v for k, v in config.items() if k.endswith("_token") and k not in tokens and isinstance(v, str)}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        tokens |= {k: v for k, v in extra.items() if isinstance(v, str)}
    return tokens


def _one_line(exc: object) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


# ---------------------------------------------------------------------------------------
# The jinja2 environment, as transformers builds it (utils/chat_template_utils.py).
# ---------------------------------------------------------------------------------------

class _TemplateRaised(jinja2.TemplateError):
    """The template's own `raise_exception(message)`: it refuses the conversation."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: json.dumps without jinja's HTML escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without the type's attributes."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed attributes (a way into CPython internals)."""

    def __init__(*args, **kwargs):  # jinja's signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks: it renders its body."""
    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENVIRONMENT = _environment()
