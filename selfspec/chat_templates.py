"""Chat templates: the model's own, one given by the user, or one built in for its family.

`--chat-template` (CLI) and `chat_template=` (API) follow vLLM's convention: a path to a
Jinja file, or the name of a built-in template; a Jinja string is accepted too. Templates
are applied by transformers' own `apply_chat_template(..., chat_template=...)`.

When the tokenizer carries no template (base models such as the default Gemma 3 270M, whose
GGUF has none), the built-in template of the model's family is used, provided the
tokenizer has that format's turn markers as single tokens (so the model has at least seen
them); a Llama 2 or Mistral v0.1 base model, whose [INST] markers are plain text, gets none
automatically and must name one.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from selfspec.errors import SelfSpecError, did_you_mean

# Written afresh after each family's published format; the content of a message is a string.
_GEMMA = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\n' }}
{%- endif -%}"""

_LLAMA3 = r"""{{ bos_token }}
{%- for message in messages -%}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif -%}"""

_CHATML = r"""{%- for message in messages -%}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<|im_start|>assistant\n' }}
{%- endif -%}"""

_LLAMA2 = r"""{%- if messages[0]['role'] == 'system' -%}
{%- set system = '<<SYS>>\n' + messages[0]['content'] | trim + '\n<</SYS>>\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- if message['role'] == 'user' -%}
{{ bos_token + '[INST] ' + (system if loop.first else '') + message['content'] | trim + ' [/INST]' }}
{%- else -%}
{{ ' ' + message['content'] | trim + ' ' + eos_token }}
{%- endif -%}
{%- endfor -%}"""

_MISTRAL = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set system = messages[0]['content'] | trim + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- if message['role'] == 'user' -%}
{{ '[INST] ' + (system if loop.first else '') + message['content'] | trim + ' [/INST]' }}
{%- else -%}
{{ message['content'] | trim + eos_token }}
{%- endif -%}
{%- endfor -%}"""

BUILTIN: dict[str, str] = {"gemma": _GEMMA, "llama3": _LLAMA3, "chatml": _CHATML, "llama2": _LLAMA2, "mistral": _MISTRAL}
_NAMES = {"qwen": "chatml"}  # other names for a built-in template

# The tokens that must each be one token of the vocabulary for a template to be chosen
# automatically, and the token that ends the model's turn (an extra end-of-sequence token
# while that template is in use: a base model's generation_config does not list it).
MARKERS: dict[str, tuple[str, ...]] = {
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "mistral": ("[INST]", "[/INST]"),
}
TURN_END: dict[str, str] = {"gemma": "<end_of_turn>", "llama3": "<|eot_id|>", "chatml": "<|im_end|>"}

# model_type -> the built-in templates its models use, most likely first
FAMILY: dict[str, tuple[str, ...]] = {
    "gemma3_text": ("gemma",),
    "qwen2": ("chatml",),
    "qwen3": ("chatml",),
    "llama": ("llama3",),
    "mistral": ("mistral",),
}


def names() -> list[str]:
    return [*BUILTIN, *_NAMES]


def builtin_name(value: str) -> str | None:
    value = value.strip().lower()
    return value if value in BUILTIN else _NAMES.get(value)


def resolve(value: str) -> tuple[str, str | None, str]:
    """--chat-template FILE|NAME (or a Jinja string) -> (template, built-in name or None,
    a description for messages). Raises SelfSpecError (one line) for an unknown name, a
    missing or unreadable file, or text that is not a Jinja template."""
    if not isinstance(value, str) or not value.strip():
        raise SelfSpecError("the chat template is empty: give a Jinja file or a built-in name (" + ", ".join(names()) + ")")
    name = builtin_name(value)
    if name is not None:
        return BUILTIN[name], name, f"the built-in {name} template"
    if "{{" in value or "{%" in value:
        return check_jinja(value, "the chat template"), None, "the given chat template"
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SelfSpecError(f"cannot read the chat template {path}: {e}") from e
        if not text.strip():
            raise SelfSpecError(f"the chat template file {path} is empty")
        return check_jinja(text, f"the chat template {path}"), None, f"the chat template {path}"
    if path.exists():
        raise SelfSpecError(f"the chat template {path} is not a file")
    if "/" in value or "\\" in value or path.suffix:
        raise SelfSpecError(f"chat template file not found: {value}")
    raise SelfSpecError(f"unknown chat template {value!r}{did_you_mean(value, names())} "
                        f"(built in: {', '.join(names())}; or the path of a Jinja file)")


def check_jinja(text: str, what: str) -> str:
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise SelfSpecError(f"{what} is not a valid Jinja template (line {e.lineno}: {e.message})") from e
    return text


def token_id(tokenizer, token: str) -> int | None:
    """The id of `token` when it is one token of the tokenizer's vocabulary (looked up one by
    one: building the whole vocabulary is slow on Gemma's 262k entries)."""
    if tokenizer is None:
        return None
    try:
        tid = tokenizer.convert_tokens_to_ids(token)
        back = tokenizer.convert_ids_to_tokens(tid) if tid is not None else None
    except Exception:  # an id out of range, a tokenizer without these methods
        return None
    return int(tid) if back == token else None  # unknown tokens map to <unk>, whose text differs


def turn_end_id(name: str | None, tokenizer) -> int | None:
    """The id of the token that ends the model's turn in the built-in template `name`."""
    token = TURN_END.get(name) if name else None
    return token_id(tokenizer, token) if token else None


def for_family(model_type: str, tokenizer) -> str | None:
    """The built-in template for a model of this family whose tokenizer has none."""
    for name in FAMILY.get(model_type, ()):
        if all(token_id(tokenizer, m) is not None for m in MARKERS[name]):
            return name
    return None
