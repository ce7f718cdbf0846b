"""Chat templates (specrt/chat.py) render as transformers' apply_chat_template does: on the real SmolLM2's own template,
and on templates using what transformers gives them (tojson, raise_exception, loop controls, generation blocks,
special tokens, named templates); a tokenizer without one is refused, saying so."""

import json

import pytest

from specrt.chat import ChatTemplate, NoChatTemplate
from specrt.errors import InvalidRequestError

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a joke."}],
]
FEATURES = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
            "{% generation %}[{{ m['role'] | upper }}] {{ m['content'] | tojson }}{% endgeneration %}\n"
            "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token if not add_generation_prompt }}")


def _tokenizer_dir(tmp_path, template=None, config_template=None):
    """A tokenizer directory transformers loads: the demo tokenizer with special tokens and a template placed."""
    import shutil

    from specrt.checkpoints import DEMO_DIR

    d = tmp_path / "tok"
    shutil.copytree(DEMO_DIR / "tokenizer", d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.update(bos_token="<s>", eos_token={"__type": "AddedToken", "content": "</s>", "lstrip": False, "rstrip": False,
                                         "normalized": False, "single_word": False, "special": True})
    if config_template is not None:
        config["chat_template"] = config_template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (d / "chat_template.jinja").write_text(template)
    return d


def _transformers(directory, messages, add):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory).apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=add)


def test_the_real_smollm2_template_renders_as_transformers_does(smollm2):
    template = ChatTemplate.of(smollm2)
    assert template.origin.endswith("chat_template.jinja")
    for messages in CONVERSATIONS:
        for add in (True, False):
            assert template.render(messages, add) == _transformers(smollm2, messages, add)


@pytest.mark.parametrize("where", ["jinja", "config", "named"])
def test_what_transformers_gives_a_template_is_given_here_too(tmp_path, where):
    d = _tokenizer_dir(tmp_path, template=FEATURES if where == "jinja" else None,
                       config_template={"config": FEATURES, "named": [{"name": "default", "template": FEATURES},
                                                                      {"name": "tool_use", "template": "x"}]}.get(where))
    template = ChatTemplate.of(d)
    for messages in CONVERSATIONS:
        for add in (True, False):
            got = template.render(messages, add)
            assert got == _transformers(d, messages, add), where
    assert template.render(CONVERSATIONS[0]) == '<s>[USER] "What is the capital of France?"[ASSISTANT]'  # trim_blocks
    with pytest.raises(InvalidRequestError, match="bad role"):
        template.render([{"role": "tool", "content": "x"}])


def test_text_parts_are_joined_and_other_parts_refused(tmp_path):
    template = ChatTemplate.of(_tokenizer_dir(tmp_path, template=FEATURES))
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    assert template.render(parts) == template.render(CONVERSATIONS[0])
    for bad, match in (([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
                       ([{"role": "wizard", "content": "x"}], "role"), ([{"role": "user", "content": 3}], "string"),
                       ([], "non-empty")):
        with pytest.raises(InvalidRequestError, match=match):
            template.render(bad)


def test_a_tokenizer_without_a_template_is_refused_unless_one_is_given(tmp_path):
    d = _tokenizer_dir(tmp_path)
    with pytest.raises(NoChatTemplate, match="no chat template"):
        ChatTemplate.of(d)
    given = tmp_path / "mine.jinja"
    given.write_text(FEATURES)
    assert ChatTemplate.of(d, given).render(CONVERSATIONS[0]).startswith("<s>[USER]")
