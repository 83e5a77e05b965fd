"""Chat templates: carried by the converter, rendered and tokenized exactly as transformers does."""

from __future__ import annotations

import json
import shutil

import pytest

import flashllm
from flashllm.text.chat_template import ChatTemplate
from flashllm.errors import FlashLLMError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
          "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
          "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
          "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""
# tojson of non-ASCII text, namespace, loop controls and a {% generation %} block
FEATURES = """{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}
{% set ns.n = ns.n + 1 %}{{ m | tojson }}
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}{% endif %}
{% endfor %}{{ ns.n }}{% if add_generation_prompt %}<s>{% endif %}"""
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "zephyr": ZEPHYR, "features": FEATURES}
MESSAGES = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "the quick brown fox"},
            {"role": "assistant", "content": "jumps — über"},
            {"role": "user", "content": "over the lazy dog"}]


@pytest.fixture(scope="module")
def templated(tiny_models, tmp_path_factory):
    """The tiny opt model converted from a checkpoint whose tokenizer_config.json carries a template."""
    from flashllm.converters import convert

    src = tmp_path_factory.mktemp("templated") / "hf"
    shutil.copytree(tiny_models("opt").ckpt, src)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": ZEPHYR}))
    return src, convert(src, src.parent / "flash", dtype="float32", progress=False)


def hf_tokenizer(ckpt, template: str):
    from transformers import PreTrainedTokenizerFast  # what tokenizer.json says (AutoTokenizer rebuilds OPT's)

    tok = PreTrainedTokenizerFast.from_pretrained(ckpt)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_render_and_ids_match_transformers(templated, name):
    ckpt, model_dir = templated
    tok = hf_tokenizer(ckpt, TEMPLATES[name])
    model = flashllm.load(model_dir)
    messages = MESSAGES[1:] if name == "features" else MESSAGES
    for generation_prompt in (True, False):
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        model.chat_template = ChatTemplate(TEMPLATES[name], model.chat_template.special_tokens)
        assert model.chat_template.render(messages, add_generation_prompt=generation_prompt) == want
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert model.chat_ids(messages) == list(ids)


def test_converter_carries_both_template_sources(templated, tmp_path):
    from flashllm.converters import convert

    ckpt, model_dir = templated
    assert flashllm.load(model_dir).chat_template.source == ZEPHYR  # from tokenizer_config.json
    src = tmp_path / "hf"
    shutil.copytree(ckpt, src)
    (src / "chat_template.jinja").write_text(CHATML)  # transformers 5 saves it beside the config; it wins
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    assert (out / "chat_template.jinja").read_text() == CHATML
    assert "chat_template.jinja" in json.loads((out / "flashllm.json").read_text())["files"]
    model = flashllm.load(out)
    assert model.chat_template.render([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_without_template_says_what_to_do(tiny_models, tmp_path):
    model = flashllm.load(tiny_models("opt").model_dir)
    with pytest.raises(FlashLLMError, match="no chat template.*--chat-template") as err:
        model.chat([{"role": "user", "content": "hi"}])
    assert "model.chat_template = FILE" in str(err.value)  # what Python takes (it named a chat_template= argument)
    # the template-free way, named for the CLI, the server and Python (was "the completion endpoint" only,
    # which means nothing in `flashllm chat`)
    assert "(flashllm generate, POST /v1/completions, model.generate)" in str(err.value)
    model.chat_template = "plain"
    assert model.chat_template.render([{"role": "user", "content": "hi"}]) == "User: hi\n\nAssistant:"
    path = tmp_path / "t.jinja"
    path.write_text(CHATML)
    model.chat_template = str(path)
    assert model.chat_template.source == CHATML
    with pytest.raises(FlashLLMError, match="missing.jinja: cannot read"):
        model.chat_template = str(tmp_path / "missing.jinja")


def test_template_errors_are_clear(templated):
    model = flashllm.load(templated[1])
    model.chat_template = ChatTemplate(LLAMA2, model.chat_template.special_tokens)
    with pytest.raises(FlashLLMError, match="refused these messages: Conversation roles must alternate"):
        model.chat_ids([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(FlashLLMError, match=r"messages\[0\].content: expected a string"):
        model.chat_ids([{"role": "user", "content": 3}])
    with pytest.raises(FlashLLMError, match="not a valid chat template"):
        ChatTemplate("{% for %}")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")  # the sandbox refuses attribute escapes
    with pytest.raises(FlashLLMError, match="refused"):
        sandboxed.render([{"role": "user", "content": "x"}])


def test_chat_replies_like_generate_on_the_rendered_prompt(templated):
    model = flashllm.load(templated[1])
    messages = [{"role": "user", "content": "the quick brown fox"}]
    reply = model.chat(messages, max_new_tokens=6)
    assert reply == "".join(model.stream_chat(messages, max_new_tokens=6))
    ids = model.chat_ids(messages)
    new = list(model.generate_ids(ids, max_new_tokens=6))
    assert reply == model.tokenizer.decode(new)
