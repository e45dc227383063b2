"""Chat templates of the families users bring, rendered as quantdrift renders conversations: the real templates
from llama.cpp's models/ (fetched by `make chat-templates` from the llama-cpp-python source distribution).

A template that raises on a system message (Gemma 2) or renders none (Phi-3's original template) gets the system
prompt folded into the first user turn, so the model sees its instructions; the prepare facts record which, and
the report says so. A template that rewrites earlier turns (reasoning templates strip earlier thinking) stops a
multi-turn run with an error that says what to do; a tool-use template that cannot render a plain chat is refused
with the template's own error."""

from importlib import metadata

import pytest

from pipeline.config.schema import PROJECT_ROOT
from pipeline.infra.errors import ConfigError
from pipeline.suites.conversation import ChatRenderer, fold_system, system_role_support

MODELS = PROJECT_ROOT / ".cache" / f"llama-cpp-python-{metadata.version('llama-cpp-python')}" / "models"
SYSTEM = "You are the billing assistant of Fernhill Payments. Quote invoice numbers exactly."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise invoice INV-2231."}]

# (template, how it treats a system message, whether each turn's prompt extends the previous stream)
FAMILIES = [
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "native", True),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "native", True),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "native", True),
    ("Qwen-Qwen3-0.6B.jinja", "native", True),
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "native", True),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "native", True),
    ("microsoft-Phi-3.5-mini-instruct.jinja", "native", True),
    ("HuggingFaceTB-SmolLM3-3B.jinja", "native", True),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", "native", True),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "native", True),
    ("google-gemma-2-2b-it.jinja", "rejected", True),
    ("ggml-vocab-phi-3.gguf", "dropped", True),
    ("google-gemma-4-31B-it.jinja", "native", False),
    ("Qwen3.5-4B.jinja", "native", False),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "native", False),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "native", False),
]


def template(name: str) -> str:
    if name.endswith(".gguf"):
        import gguf

        path = MODELS / name
        if not path.is_file():
            pytest.skip(f"{path} is absent: run `make chat-templates` (make test does)")
        field = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"]
        return bytes(field.parts[field.data[0]]).decode()
    path = MODELS / "templates" / name
    if not path.is_file():
        pytest.skip(f"{path} is absent: run `make chat-templates` (make test does)")
    return path.read_text()


@pytest.fixture
def checkpoint_with(tmp_path, tiny_tokenizer_dir):
    """A tokenizer folder (the tiny test tokenizer) carrying the named chat template."""
    def make(name: str):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
        tok.chat_template = template(name)
        out = tmp_path / name.replace(".", "_")
        tok.save_pretrained(str(out))
        return out
    return make


@pytest.mark.parametrize("name,role,extends", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_every_family_sees_its_system_prompt_and_its_turns(checkpoint_with, name, role, extends):
    renderer = ChatRenderer(checkpoint_with(name))
    assert renderer.system_role == role
    text = renderer.render(CHAT)
    assert SYSTEM in text and "INV-2231" in text            # the instructions reach the model in every family
    if role != "native":
        assert text.index(SYSTEM) < text.index("INV-2231")     # folded ahead of the first user text
    ids = renderer.first_prompt(CHAT)
    reply = "Invoice INV-2231 totals GBP 1,240."
    reply_ids = renderer.encode(reply)
    if extends:
        nxt = renderer.next_prompt(CHAT, ids, reply_ids, reply, "And the due date?")
        assert nxt[: len(ids) + len(reply_ids)] == ids + reply_ids
        assert "due date" in renderer.decode(nxt[len(ids) + len(reply_ids):])
    else:
        with pytest.raises(ConfigError, match="rewrites earlier turns.*run.suites=\\[long_output\\]"):
            renderer.next_prompt(CHAT, ids, reply_ids, reply, "And the due date?")


def test_a_tool_use_template_is_refused_with_its_own_error(checkpoint_with):
    with pytest.raises(ConfigError, match="cannot render a plain conversation.*TypeError"):
        ChatRenderer(checkpoint_with("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"))


def test_fold_system_keeps_the_other_turns():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    assert fold_system(msgs) == [{"role": "user", "content": "S\n\nU1"}, {"role": "assistant", "content": "A1"},
                                 {"role": "user", "content": "U2"}]
    assert msgs[1]["content"] == "U1"                              # the caller's messages are not changed
    assert fold_system(msgs[1:]) == msgs[1:]


def test_the_prepare_facts_and_the_report_say_what_was_done(checkpoint_with):
    from transformers import AutoTokenizer

    from pipeline.report.sections import _model_section

    assert system_role_support(AutoTokenizer.from_pretrained(str(checkpoint_with("google-gemma-2-2b-it.jinja")))) \
        == "rejected"
    summary = {"model": {"source": "x", "architecture": "Gemma2ForCausalLM", "system_role": "rejected"},
               "reference": {"runtime": "hf", "top_k": 32}}
    items = _model_section(summary)[2][0]
    assert any("raises on a system message" in i and "folded into its first user turn" in i for i in items)
