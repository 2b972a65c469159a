"""Chat prompts: rendering and token ids equal transformers' apply_chat_template for a Qwen3-style
and a Llama-3-style template, and chat requests through the services give the same tokens as the
rendered prompt sent as token ids; a missing, malformed or refusing template is INVALID_ARGUMENT."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import jinja2
import pytest
import torch
from tokenizers import Tokenizer, processors

from common.config import CheckpointError, load_draft_config
from common.make_tiny import TinySizes, make_tiny
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from drafter_svc.chat import MAX_MESSAGES, ChatPrompt, ChatTemplate, load_chat_template
from drafter_svc.client import build_request, parse_args
from drafter_svc.server import DrafterConfig, DrafterEngine
from drafter_svc.server import serve as serve_drafter
from tests.servers import ServerThread
from verifier_svc.server import VerifierConfig
from verifier_svc.server import serve as serve_verifier

transformers = pytest.importorskip("transformers")

# Qwen3's template, as its tokenizer_config.json has it.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Llama-3-Instruct's template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# transformers' globals, filter and tag: namespace, dict, tojson (no HTML escaping), loop controls,
# {% generation %}, a model-specific *_token variable.
FEATURES_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
  {%- if loop.index0 >= 3 %}{% break %}{% endif -%}
  {%- set ns.n = ns.n + 1 -%}
  {{ m | tojson }}{{ dict(role=m.role, i=loop.index0) | tojson(sort_keys=true) }}
  {% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endif %}
{% endfor -%}
{{ ns.n }} {{ image_token }} {{ strftime_now('%Y') }}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

REFUSING_TEMPLATE = ("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a "
                     "user message.') }}{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
BROKEN_TEMPLATE = "{% for m in messages %}{{ m.content }"

QWEN3_TOKENS = ["<|im_start|>", "<|im_end|>"]
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
THINK_TOKENS = ["<think>", "</think>"]  # added, not special, as in Qwen3's tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "def f(x): return x<1 & 'é' ✓"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Sum 2 and 3.\n"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Sum 2 and 3."},
     {"role": "assistant", "content": "5"}, {"role": "user", "content": "Times 4? héllo ✓"}],
    [{"role": "user", "content": "Sum 2 and 3."},
     {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n5"}, {"role": "user", "content": "And now?"}],
    [{"role": "user", "content": "Sum 2 and 3."}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\nIt is 5."}],
]


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_tokenizer) -> Tokenizer:
    """The tiny tokenizer plus the control tokens of both templates."""
    tok = Tokenizer.from_str(tiny_tokenizer.to_str())
    tok.add_special_tokens(QWEN3_TOKENS + LLAMA3_TOKENS)
    tok.add_tokens(THINK_TOKENS)
    return tok


def write_folder(folder: Path, tok: Tokenizer, config: dict, jinja: str | None = None, bos: bool = False) -> Path:
    """A tokenizer folder as a checkpoint has it; `bos`: the tokenizer adds BOS, as Llama 3's does."""
    folder.mkdir(parents=True, exist_ok=True)
    if bos:
        tok = Tokenizer.from_str(tok.to_str())
        bos_id = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos_id)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, chat_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    added_bos = {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False, "normalized": False,
                 "rstrip": False, "single_word": False, "special": True}
    return {
        # chat_template.jinja wins over tokenizer_config.json's template, in transformers too.
        "qwen3": write_folder(root / "qwen3", chat_tokenizer,
                              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                               "chat_template": "not this one"}, jinja=QWEN3_TEMPLATE),
        "llama3": write_folder(root / "llama3", chat_tokenizer,
                               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                "chat_template": LLAMA3_TEMPLATE}, bos=True),
        "named": write_folder(root / "named", chat_tokenizer,
                              {"bos_token": added_bos, "eos_token": "<|eot_id|>",
                               "chat_template": [{"name": "tool_use", "template": "not this one"},
                                                 {"name": "default", "template": LLAMA3_TEMPLATE}]}, bos=True),
        "features": write_folder(root / "features", chat_tokenizer,
                                 {"eos_token": "<|im_end|>", "image_token": "<|mask|>"}, jinja=FEATURES_TEMPLATE),
    }


@pytest.fixture(scope="module")
def hf_tokenizers(folders):
    return {name: transformers.AutoTokenizer.from_pretrained(str(folder)) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def ours(folders):
    return {name: (load_chat_template(folder), Tokenizer.from_file(str(folder / "tokenizer.json")))
            for name, folder in folders.items()}


CASES = [("qwen3", {}), ("qwen3", {"enable_thinking": True}), ("qwen3", {"enable_thinking": False}),
         ("llama3", {}), ("named", {}), ("features", {})]


@pytest.mark.parametrize("style, kwargs", CASES, ids=[f"{s}-{k}" for s, k in CASES])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_rendering_equals_transformers(ours, hf_tokenizers, style, kwargs, add_generation_prompt, conversation):
    messages = CONVERSATIONS[conversation]
    template, tok = ours[style]
    hf = hf_tokenizers[style]
    text = template.render(ChatPrompt(messages, add_generation_prompt, kwargs))
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                          **kwargs)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


def test_rendering_has_the_control_tokens_once(ours):
    """The cases above compare something: thinking is switched off, the control tokens are single
    ids and BOS is there once although the Llama tokenizer adds one to plain text."""
    messages = CONVERSATIONS[1]
    qwen, qwen_tok = ours["qwen3"]
    off = qwen.render(ChatPrompt(messages, True, {"enable_thinking": False}))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen.render(ChatPrompt(messages, True)).endswith("<|im_start|>assistant\n")
    assert not qwen.render(ChatPrompt(messages, False)).endswith("assistant\n")
    ids = qwen_tok.encode(off, add_special_tokens=False).ids
    assert ids.count(qwen_tok.token_to_id("<|im_start|>")) == 3 and ids.count(qwen_tok.token_to_id("<think>")) == 1
    llama, llama_tok = ours["llama3"]
    text = llama.render(ChatPrompt(messages, True))
    bos = llama_tok.token_to_id("<|begin_of_text|>")
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert llama_tok.encode(text).ids[:2] == [bos, bos]  # what encoding with special tokens would do
    ids = llama_tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == bos and ids.count(bos) == 1


def test_template_errors_are_one_line_value_errors(tmp_path, chat_tokenizer, hf_tokenizers):
    refusing = ChatTemplate(REFUSING_TEMPLATE, {})
    with pytest.raises(ValueError, match="refused the conversation: Conversation must start with a user message"):
        refusing.render(ChatPrompt([{"role": "assistant", "content": "hi"}]))
    assert refusing.render(ChatPrompt([{"role": "user", "content": "hi"}])) == "user: hi\n"
    for source, needle in [
        (BROKEN_TEMPLATE, "malformed: line 1"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ messages[0].content.__class__.__mro__ }}", "failed on this conversation"),  # the sandbox
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
        ("{{ messages[0].content }}{{ missing.attr }}", "UndefinedError"),
    ]:
        template = ChatTemplate(source, {})
        with pytest.raises(ValueError, match=needle) as err:
            template.render(ChatPrompt([{"role": "user", "content": "line one\nline two"}]))
        assert "\n" not in str(err.value)
    # transformers fails on the same templates
    with pytest.raises(jinja2.TemplateError, match="must start with a user message"):
        hf_tokenizers["qwen3"].apply_chat_template([{"role": "assistant", "content": "hi"}],
                                                   chat_template=REFUSING_TEMPLATE, tokenize=False)
    missing = load_chat_template(write_folder(tmp_path / "plain", chat_tokenizer, {"eos_token": "<|endoftext|>"}))
    with pytest.raises(ValueError, match="no chat template"):
        missing.render(ChatPrompt([{"role": "user", "content": "hi"}]))
    assert load_chat_template(tmp_path / "absent").source is None  # no tokenizer_config.json at all


def test_bad_template_files_are_checkpoint_errors(tmp_path, chat_tokenizer):
    for name, config in [("nodefault", {"chat_template": [{"name": "tool_use", "template": "x"}]}),
                         ("number", {"chat_template": 3})]:
        with pytest.raises(CheckpointError, match="chat_template|default"):
            load_chat_template(write_folder(tmp_path / name, chat_tokenizer, config))
    folder = tmp_path / "badjson"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="could not be read"):
        load_chat_template(folder)


def test_chat_prompt_validation():
    user = {"role": "user", "content": "hi"}
    for kwargs, needle in [
        ({"messages": []}, "no messages"),
        ({"messages": [user] * (MAX_MESSAGES + 1)}, "limit"),
        ({"messages": [{"role": "", "content": "hi"}]}, "empty role"),
        ({"messages": [{"role": "user", "content": 3}]}, "string"),
        ({"messages": [{"role": "user", "content": "x" * (9 << 20)}]}, "bytes"),
        ({"messages": [user], "template_kwargs": {"messages": "x"}}, "reserved"),
        ({"messages": [user], "template_kwargs": {"add_generation_prompt": True}}, "reserved"),
        ({"messages": [user], "template_kwargs": {"": "x"}}, "non-empty"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ChatPrompt(**kwargs)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")],
                   template_kwargs={"enable_thinking": "false", "a": "true", "b": "True", "c": "high"})
    prompt = ChatPrompt.from_proto(chat)
    assert prompt.add_generation_prompt is True and prompt.messages == [user]
    assert prompt.template_kwargs == {"enable_thinking": False, "a": True, "b": "True", "c": "high"}
    chat.add_generation_prompt = False
    assert ChatPrompt.from_proto(chat).add_generation_prompt is False


def test_client_builds_chat_requests():
    req = build_request(parse_args(["--chat", "--system", "Be brief.", "--template-kwarg", "enable_thinking=false",
                                    "hi"]))
    assert req.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "Be brief."), ("user", "hi")]
    assert dict(req.chat.template_kwargs) == {"enable_thinking": "false"}
    assert not req.chat.HasField("add_generation_prompt")
    assert build_request(parse_args(["hi"])).WhichOneof("prompt") == "text"
    for argv in (["--template-kwarg", "x=1", "hi"], ["--chat", "--template-kwarg", "novalue", "hi"],
                 ["--chat", "--prompt-ids", "1,2"]):
        with pytest.raises(SystemExit):
            build_request(parse_args(argv))


# ---------------------------------------------------------------------------------------
# Through the services.
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory, chat_tokenizer) -> dict[str, Path]:
    """A tiny pair, and target folders sharing its weights: with the Llama-3 template (and a
    tokenizer that adds BOS to plain text), the Qwen3 one, none, a refusing one and a malformed one."""
    root = tmp_path_factory.mktemp("chat-pair")
    weights, draft = make_tiny(root, seed=3, sizes=TinySizes(), tokenizer=chat_tokenizer)
    llama = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}
    dirs = {"draft": draft,
            "llama3": write_folder(root / "llama3", chat_tokenizer, llama, bos=True),
            "qwen3": write_folder(root / "qwen3", chat_tokenizer, {"eos_token": "<|im_end|>"}, jinja=QWEN3_TEMPLATE),
            "plain": write_folder(root / "plain", chat_tokenizer, {"eos_token": "<|endoftext|>"}),
            "refusing": write_folder(root / "refusing", chat_tokenizer, {}, jinja=REFUSING_TEMPLATE),
            "broken": write_folder(root / "broken", chat_tokenizer, {}, jinja=BROKEN_TEMPLATE)}
    for name in ("llama3", "qwen3", "plain", "refusing", "broken"):
        for file in ("config.json", "model.safetensors"):
            shutil.copy(weights / file, dirs[name] / file)
    return dirs


@pytest.fixture(scope="module")
def verifier(chat_pair):
    cfg = VerifierConfig(target_dir=str(chat_pair["llama3"]), projection_dir=str(chat_pair["draft"]),
                         feature_layer_ids=load_draft_config(chat_pair["draft"]).target_layer_ids,
                         host="127.0.0.1", port=0, max_sessions=4, max_seq_len=256, max_tree_nodes=17)
    with ServerThread(lambda: serve_verifier(cfg)) as running:
        yield running


def start_drafter(chat_pair, verifier, target: str) -> ServerThread:
    cfg = DrafterConfig(draft_dir=str(chat_pair["draft"]), target_dir=str(chat_pair[target]), host="127.0.0.1",
                        port=0, verifier=f"127.0.0.1:{verifier.port}", tree_budget=8, max_new_tokens=12,
                        max_concurrent=2, verifier_wait_s=30)
    engine = DrafterEngine.start(cfg, torch.float32)
    return ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0))


@pytest.fixture(scope="module")
def drafters(chat_pair, verifier):
    """Drafter ports by template, both on the one verifier."""
    with start_drafter(chat_pair, verifier, "llama3") as llama, start_drafter(chat_pair, verifier, "qwen3") as qwen:
        yield {"llama3": llama.port, "qwen3": qwen.port}


def generate(port: int, req: pb.GenerateRequest):
    """Tokens and final message of one streamed Generate call."""
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
        tokens, final = [], None
        for reply in pb_grpc.GenerationStub(channel).Generate(req, timeout=60):
            if reply.HasField("final"):
                final = reply.final
            else:
                tokens.extend(reply.delta.token_ids)
        return tokens, final


def chat_request(messages, **chat_fields) -> pb.GenerateRequest:
    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in messages], **chat_fields)
    return pb.GenerateRequest(chat=chat, max_new_tokens=12)


@pytest.mark.parametrize("style, conversation, thinking", [
    ("llama3", 1, None), ("llama3", 2, None), ("qwen3", 1, "false"), ("qwen3", 2, "true"), ("qwen3", 3, None)])
def test_chat_request_equals_its_rendered_token_ids(chat_pair, drafters, style, conversation, thinking):
    messages = CONVERSATIONS[conversation]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_pair[style]))
    hf_kwargs = {} if thinking is None else {"enable_thinking": thinking == "true"}
    expected_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True,
                                          **hf_kwargs)
    port = drafters[style]
    tokens, final = generate(port, chat_request(messages, template_kwargs=kwargs))
    assert final.usage.prompt_tokens == len(expected_ids)  # one BOS, the template's
    same, same_final = generate(port, pb.GenerateRequest(token_ids=pb.TokenIds(ids=expected_ids), max_new_tokens=12))
    assert tokens == same and len(tokens) == final.usage.completion_tokens > 0
    assert same_final.usage.prompt_tokens == len(expected_ids)
    # add_generation_prompt false is honoured: no assistant header
    short_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **hf_kwargs)
    _, short = generate(port, chat_request(messages, template_kwargs=kwargs, add_generation_prompt=False))
    assert short.usage.prompt_tokens == len(short_ids) < len(expected_ids)


@pytest.mark.parametrize("req, needle", [
    (chat_request([]), "no messages"),
    (chat_request([{"role": "user", "content": "hi"}], template_kwargs={"messages": "x"}), "reserved"),
    (chat_request([{"role": "", "content": "hi"}]), "empty role"),
])
def test_bad_chat_requests_are_invalid_argument(drafters, req, needle):
    with pytest.raises(grpc.RpcError) as err:
        generate(drafters["qwen3"], req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details() and "\n" not in err.value.details()
    assert generate(drafters["qwen3"], chat_request(CONVERSATIONS[0]))[1].finish_reason == "length"  # still serving


@pytest.mark.parametrize("target, needle", [("plain", "no chat template"), ("broken", "malformed"),
                                            ("refusing", "refused the conversation")])
def test_unusable_templates_are_invalid_argument(chat_pair, verifier, target, needle):
    with start_drafter(chat_pair, verifier, target) as running:
        with pytest.raises(grpc.RpcError) as err:
            generate(running.port, chat_request([{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "hi"}]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details() and "\n" not in err.value.details()
        # text prompts are still served
        _, final = generate(running.port, pb.GenerateRequest(text="def f(x):", max_new_tokens=4))
        assert final.finish_reason == "length" and final.usage.completion_tokens == 4
