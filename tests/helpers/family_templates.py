"""Chat templates that behave like real model families' (Qwen3, Qwen2.5, Llama 3.1), with small BPE tokenizers.

The Jinja below is written here. What it reproduces was read from the families' published templates
(Qwen/Qwen3-8B and Qwen/Qwen2.5-7B-Instruct tokenizer_config.json, meta-llama/Llama-3.1-8B-Instruct's):
  * Qwen3: ChatML; reasoning rendered as `<think>\\n...\\n</think>\\n\\n` only for assistant turns after the
    last user query (earlier ones lose it; the last assistant message after it gets an empty block when it
    has none); Hermes tool calls (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`); a run of
    tool results is one user turn of `<tool_response>` blocks; `enable_thinking=False` writes an empty think
    block into the generation prompt.
  * Qwen2.5: the same ChatML and Hermes tools, no reasoning, a default system prompt.
  * Llama 3.1: the template writes the bos token; headers `<|start_header_id|>role<|end_header_id|>\\n\\n`,
    turns end with `<|eot_id|>`; a dated system header; tools go into the first user message; a tool call is
    the bare JSON `{"name": ..., "parameters": ...}` (one per turn); tool results are role `ipython`, their
    text rendered through tojson (a string gets quotes, as the real template's `is iterable` test does).
    The date is `date_string` (Llama 3.2's writes strftime_now's: the day the request is rendered).
    `<|eom_id|>` ends a turn that waits for a tool (generation_config lists it as an eos).
  * "llama3-fn": the Llama 3.1 template writing a call as `<function=NAME>{args}</function>`, the other
    custom-tool format Meta's Llama 3.1 prompt-format page describes (a system-prompt instruction, not its
    template's): a template whose calls neither parser reads back.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

QWEN3_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nReturn each call as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- if loop.first and content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- set call = call.function if call.function else call %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""".strip()

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN25_TEMPLATE = (
    r"""
{%- set system = messages[0].content if messages[0].role == 'system' else '"""
    + QWEN25_SYSTEM
    + r"""' %}
{%- if tools %}
    {{- '<|im_start|>system\n' + system + '\n\n# Tools\n\nYou may call one or more functions.\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nReturn each call as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' and not message.tool_calls %}
        {{- '<|im_start|>assistant\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- set call = call.function if call.function else call %}
            {{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".strip()
)

LLAMA3_TEMPLATE = r"""
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}
    {{- 'Environment: ipython\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + (date_string or '26 Jul 2024') + '\n\n' + system }}
{{- '<|eot_id|>' }}
{%- if tools and messages and messages[0].role == 'user' %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with a JSON for a function call.\n\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\n\n' }}
    {%- for tool in tools %}
        {{- (tool | tojson(indent=4)) + '\n\n' }}
    {%- endfor %}
    {{- messages[0].content | trim + '<|eot_id|>' }}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception('This model only supports single tool-calls at once!') }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.name + '", "parameters": ' }}
        {{- (call.arguments | tojson) + '}<|eot_id|>' }}
    {%- elif message.role == 'tool' or message.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
""".strip()

LLAMA3_FN_TEMPLATE = LLAMA3_TEMPLATE.replace(
    r"""\n\n{"name": "' + call.name + '", "parameters": '""", r"""\n\n<function=' + call.name + '>'"""
).replace("""(call.arguments | tojson) + '}<|eot_id|>'""", """(call.arguments | tojson) + '</function><|eot_id|>'""")
assert LLAMA3_FN_TEMPLATE.count("<function=") == 1 and "</function>" in LLAMA3_FN_TEMPLATE

QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
LLAMA_SPECIAL = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)

# name -> (template, special tokens, non-special added tokens, tokenizer_config extras, bos added on encode)
FAMILIES = {
    "qwen3": (
        QWEN3_TEMPLATE,
        QWEN_SPECIAL,
        QWEN_ADDED,
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        False,
    ),
    "qwen2.5": (
        QWEN25_TEMPLATE,
        QWEN_SPECIAL,
        QWEN_ADDED,
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        False,
    ),
    # Llama 3.1 Instruct: eos is <|eot_id|>, and the tokenizer itself adds <|begin_of_text|> (the template
    # writes it too: chat ids are encoded without added special tokens, or the bos would be doubled)
    "llama3": (
        LLAMA3_TEMPLATE,
        LLAMA_SPECIAL,
        (),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": None},
        True,
    ),
    "llama3-fn": (
        LLAMA3_FN_TEMPLATE,
        LLAMA_SPECIAL,
        (),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": None},
        True,
    ),
}
# eos ids a checkpoint's generation_config.json lists beyond the tokenizer's eos (Qwen: <|endoftext|>;
# Llama 3.1: <|end_of_text|> and <|eom_id|>)
GENERATION_EOS = {
    "qwen3": ("<|im_end|>", "<|endoftext|>"),
    "qwen2.5": ("<|im_end|>", "<|endoftext|>"),
    "llama3": ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    "llama3-fn": ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
}


def corpus() -> list[str]:
    words = "the quick brown fox jumps over the lazy dog hello world compute answer calculator expression"
    return [
        f"{words} {i} {i * 7}+{i}={i * 8}. " * 3 + '{"name": "calculator", "arguments": {"expression": "1"}}'
        for i in range(60)
    ]


def build_family_tokenizer(out_dir: str | Path, family: str, vocab_size: int = 400) -> None:
    """A byte-level BPE with the family's special tokens and chat template, saved as a Hugging Face dir."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    template, special, added, config, adds_bos = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if adds_bos:
        bos = config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        **config,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


@functools.cache
def family_dir(family: str) -> str:
    d = tempfile.mkdtemp(prefix=f"exactrl-{family}-tok-")
    build_family_tokenizer(d, family)
    return d


@functools.cache
def family_tokenizer(family: str):
    from exactrl.model.tokenizer import load_tokenizer

    return load_tokenizer(family_dir(family))


# --------------------------------------------------------------------------- live servers


def _model_dir(family: str, force: str | None) -> Path:
    """The family's tokenizer + a tiny random model of its architecture, with the family's
    generation_config.json eos list. `force`: a token the model then always samples first (a large bias in
    the last layer's output projection fixes one direction of the final hidden state; one lm_head weight
    points that direction at the token)."""
    import torch
    from conftest import make_hf_model

    from exactrl.model.tokenizer import load_tokenizer

    d = Path(tempfile.mkdtemp(prefix=f"exactrl-{family}-model-"))
    build_family_tokenizer(d, family)
    tok = load_tokenizer(d)
    arch = "llama" if family.startswith("llama3") else "qwen3" if family == "qwen3" else "qwen2"
    model = make_hf_model(d, arch, seed=0, vocab_size=tok.vocab_size, eos_token_id=tok.end_of_turn_id)
    if force is not None:
        with torch.no_grad():
            o = model.model.layers[-1].self_attn.o_proj
            o.bias.zero_()
            o.bias[0] = 1e3
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[tok.hf.convert_tokens_to_ids(force), 0] = 50.0
        model.save_pretrained(d)
    eos = [tok.hf.convert_tokens_to_ids(t) for t in GENERATION_EOS[family]]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return d


@functools.cache
def family_server(family: str, force: str | None = None):
    """(ServerThread, ServerState) serving the family's tiny model on 127.0.0.1."""
    import atexit

    from exactrl.server.app import ServerThread, build_state, create_app

    state = build_state(str(_model_dir(family, force)), kv_budget_tokens=4096)
    thread = ServerThread(create_app(state)).start()
    atexit.register(thread.stop)
    return thread, state
