"""Chat templates: the checkpoint's Jinja template rendered the way transformers renders it.

A template comes from the model directory (transformers 5's `chat_template.jinja`, else
tokenizer_config.json's `chat_template`), from a file the user names, or is the built-in `plain`
one for models trained without a chat format. Templates run in jinja2's immutable sandbox with
transformers' globals (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text),
so a template from the Hub renders here exactly as it does there and cannot run code.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from flashllm.errors import FlashLLMError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# For base models: role-prefixed turns; the model's next "User:" line ends its reply.
PLAIN = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
         "{% if add_generation_prompt %}Assistant:{% endif %}")
PLAIN_STOP = ("\nUser:", "\nSystem:")


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to and its own stop strings."""

    def __init__(self, source: str, special_tokens: dict | None = None, stop: tuple[str, ...] = (),
                 origin: str = "template", add_special_tokens: bool = False):
        """`add_special_tokens`: encode the rendered text with the tokenizer's BOS/post-processor (for
        templates that do not write those tokens themselves; checkpoint templates do, as in transformers)."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise FlashLLMError(f"{origin}: not a valid chat template ({exc})") from None
        self.source, self.origin, self.stop, self.add_special_tokens = source, origin, tuple(stop), add_special_tokens
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]), ending where the
        assistant's reply begins when `add_generation_prompt`."""
        import jinja2

        messages = check_messages(messages)
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **{**self.special_tokens, **extra})
        except jinja2.TemplateError as exc:  # raise_exception() in the template, or a sandbox violation
            raise FlashLLMError(f"chat template ({self.origin}) refused these messages: {exc}") from None

    @classmethod
    def from_model(cls, model_dir: str | Path) -> "ChatTemplate | None":
        """The template the checkpoint shipped (None if it has none)."""
        root = Path(model_dir)
        config = _read_json(root / "tokenizer_config.json")
        tokens = special_tokens(config, _read_json(root / "special_tokens_map.json"))
        path = root / TEMPLATE_FILE
        if path.is_file():
            return cls(_read_text(path), tokens, origin=str(path))
        source = config.get("chat_template")
        if isinstance(source, list):  # several named templates: transformers uses "default"
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
        if source is None:
            return None
        if not isinstance(source, str):
            raise FlashLLMError(f"{root / 'tokenizer_config.json'}: chat_template is not a string")
        return cls(source, tokens, origin=f"{root / 'tokenizer_config.json'} chat_template")

    @classmethod
    def resolve(cls, model_dir: str | Path, choice: str | None = None) -> "ChatTemplate":
        """`choice`: None for the model's own template, `plain`, or a path to a Jinja file."""
        root = Path(model_dir)
        if choice is None:
            found = cls.from_model(root)
            if found is None:
                raise FlashLLMError(f"{root}: this model has no chat template (neither {TEMPLATE_FILE} nor "
                                    f"tokenizer_config.json's chat_template); pass one with --chat-template FILE "
                                    f"(Python: model.chat_template = FILE), use --chat-template plain "
                                    f"(model.chat_template = 'plain') for a base model, or send plain text "
                                    f"without a template instead (flashllm generate, POST /v1/completions, "
                                    f"model.generate)")
            return found
        tokens = special_tokens(_read_json(root / "tokenizer_config.json"), _read_json(root / "special_tokens_map.json"))
        if choice == "plain":
            return cls(PLAIN, tokens, stop=PLAIN_STOP, origin="plain", add_special_tokens=True)
        return cls(_read_text(Path(choice)), tokens, origin=choice)


def _generation_tag():
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders the body."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


def check_messages(messages) -> list[dict]:
    """Messages as the template expects them: dicts with a string role and string content (a list of
    OpenAI text parts is joined); anything else is a clear error."""
    if not isinstance(messages, list) or not messages:
        raise FlashLLMError("messages: expected a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise FlashLLMError(f"messages[{i}]: expected an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise FlashLLMError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise FlashLLMError(f"messages[{i}].content: expected a string")
        out.append({**m, "content": content})
    return out


def special_tokens(config: dict, token_map: dict) -> dict:
    """bos_token, eos_token, ... as strings (tokenizer_config.json first, then special_tokens_map.json)."""
    out = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key, token_map.get(key))
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FlashLLMError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise FlashLLMError(f"{path}: expected a JSON object")
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FlashLLMError(f"chat template {path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
