"""Tokenizers: build the project's own byte-level BPE, load any HF tokenizer directory.

`build_tokenizer` trains a small byte-level BPE (the `tokenizers` library)
and writes a normal Hugging Face directory: `tokenizer.json` plus a
`tokenizer_config.json` holding the chat template, so
`transformers.AutoTokenizer.from_pretrained(dir)` loads it offline. Digits are
split one per token before the byte-level step, so "12+7=" is always
1|2|+|7|= and arithmetic is learnable digit by digit. Being byte-level, every
string round-trips exactly through encode/decode.

The chat template is ChatML as in Qwen2.5/Qwen3 (Hermes-style tools), written
here, with two deliberate departures that keep histories monotonic and
countable: reasoning (`reasoning_content`) is rendered for every assistant turn
(Qwen3 drops it from earlier turns), and each `tool` message is its own user
turn (Qwen groups consecutive ones). So every message ends with exactly one
`<|im_end|>`, which the multi-turn server counts to find where new text begins.

`load_tokenizer` wraps any fast tokenizer directory (ours or, e.g., a real
Qwen3 one) in a small `Tokenizer` with the ids the engine and trainer need.
Chat token ids are the rendered text encoded without added special tokens,
which is what transformers' own `apply_chat_template` does. The wrapper also
answers the transformers calls user code makes most (`tok(text)`,
`batch_decode`, `apply_chat_template(..., tokenize=False)`); the full
transformers tokenizer is `tok.hf`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, turn start, end of turn (= eos)
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")  # ChatML, Llama 3, Gemma
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)  # every byte must be a token

CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('messages[' ~ loop.index0 ~ ']: a system message may only be the first message') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- message.content or '' }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": ' + (tool_call.name | tojson) + ', "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- else %}
        {{- raise_exception('unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".strip()


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat_template(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    template: str = CHAT_TEMPLATE,
) -> str:
    """Renders `template` the way transformers does (sandboxed Jinja, same filters), without a tokenizer."""
    return _compile(template).render(messages=list(messages), tools=tools, add_generation_prompt=add_generation_prompt)


# --------------------------------------------------------------------------- building


def build_tokenizer(out_dir: str | Path, texts: Iterable[str], vocab_size: int = 512) -> None:
    """Trains a byte-level BPE of at most `vocab_size` tokens (all added tokens included) and saves it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + special and tag tokens), got {vocab_size}"
        )
    markers = SPECIAL_TOKENS + ADDED_TOKENS

    def cleaned() -> Iterable[str]:  # markers become single tokens; BPE must not spend merges on them
        for text in texts:
            for m in markers:
                text = text.replace(m, "\n")
            yield text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(cleaned(), trainer)
    if tok.get_vocab_size() <= MIN_VOCAB_SIZE - len(ADDED_TOKENS):
        raise ValueError("build_tokenizer got no training text: pass a non-empty iterable of strings")
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def default_tokenizer_corpus(tasks: Sequence[Any], n: int, seed: int) -> list[str]:
    """Training texts: `n` problems per task rendered as chats (plain, with reasoning, with a tool call)."""
    if n < 1 or not tasks:
        raise ValueError(f"default_tokenizer_corpus needs at least one task and n >= 1, got {len(tasks)} and {n}")
    rng = random.Random(seed)
    tool = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
    texts = []
    for task in tasks:
        system = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
        for i in range(n):
            p = task.generate(rng)
            user = {"role": "user", "content": p.prompt}
            if i % 4 == 0:
                msgs, tools = [*system, user, {"role": "assistant", "content": p.answer}], None
            elif i % 4 == 1:
                msgs, tools = (
                    [
                        *system,
                        user,
                        {"role": "assistant", "content": p.answer, "reasoning_content": f"{p.prompt} {p.answer}"},
                    ],
                    None,
                )
            elif i % 4 == 2:
                call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": p.prompt}}}
                msgs = [
                    *system,
                    user,
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": p.answer},
                    {"role": "assistant", "content": p.answer},
                ]
                tools = [tool]
            else:
                texts.append(p.prompt + p.answer)
                continue
            texts.append(render_chat_template(msgs, tools, add_generation_prompt=False))
    return texts


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class Tokenizer:
    """A transformers fast tokenizer plus the token ids the engine and trainer need."""

    hf: Any  # transformers.PreTrainedTokenizerFast (or its v5 name, TokenizersBackend)
    path: Path  # directory it was loaded from
    eos_token_id: int  # the tokenizer's eos (ours: <|im_end|>)
    end_of_turn_id: int  # <|im_end|> (or another known end-of-turn token) if present, else eos
    pad_token_id: int  # pad token, or eos when the tokenizer defines none (padding is always masked)
    vocab_size: int  # len(hf): the base vocabulary plus added tokens; the model's embedding needs >= this

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end a generation: eos and end of turn."""
        return frozenset({self.eos_token_id, self.end_of_turn_id})

    @functools.cached_property
    def byte_level(self) -> bool:
        """Whether the decoder is byte-level BPE's alone (GPT-2, Qwen, ours): each piece's characters stand for
        bytes, and the text of ids a + b is a's text then b's wherever a's bytes end a character."""
        decoder = json.loads(self.hf.backend_tokenizer.to_str()).get("decoder") or {}
        return decoder.get("type") == "ByteLevel"

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of what decides the token ids a run sees: the tokenizer's model and rules, its chat template
        and special ids (a resumed run must tokenize as the run it continues; its path may move)."""
        what = [
            self.hf.backend_tokenizer.to_str(),
            self.hf.chat_template,
            self.eos_token_id,
            self.end_of_turn_id,
            self.pad_token_id,
        ]
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def check_fits(self, vocab_size: int, flag: str) -> None:
        """A ValueError unless every id of this tokenizer has a row in a model vocabulary of `vocab_size`
        (the model's may be larger: padded rows). `flag`: where the user named this tokenizer."""
        if self.vocab_size > vocab_size:
            raise ValueError(
                f"the tokenizer at {self.path} ({flag}) has {self.vocab_size} tokens but the model's "
                f"vocabulary has {vocab_size}: its ids up to {self.vocab_size - 1} have no embedding "
                f"(they are not the model's tokenizer); use the tokenizer the model was trained with"
            )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no bos/eos added (special-token strings in `text` map to their ids). A
        ValueError for text that is not valid Unicode (a lone surrogate, e.g. JSON's "\\ud800")."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"text is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start}"
            ) from None
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        """`decode` of each sequence, as transformers' `batch_decode`."""
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """`{"input_ids": [...]}` for one string, as transformers' `tokenizer(text)` (its BatchEncoding
        without the attention mask). Like transformers it adds the tokenizer's bos/eos by default
        (ours and Qwen's add none); `encode` never adds them."""
        if not isinstance(text, str):
            raise ValueError(
                f"tokenizer(text) takes one string, got {type(text).__name__}; for a batch use [tok(t) for t in texts]"
            )
        return {"input_ids": self.hf.encode(text, add_special_tokens=add_special_tokens)}

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for `messages` (and `tools`, when the template supports them);
        `template_kwargs` are more variables for the template (Qwen3's `enable_thinking`), as in transformers."""
        if not self.hf.chat_template:
            raise ValueError(
                f"tokenizer at {self.path} has no chat template (tokenizer_config.json 'chat_template' "
                f"or chat_template.jinja)"
            )
        from jinja2.exceptions import TemplateError

        try:
            return self.hf.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except TemplateError as e:  # raised by the template's own checks (roles, message order)
            raise ValueError(f"chat template of {self.path} rejected the messages: {e}") from None
        except TypeError as e:  # a value of a type the template cannot use (`'text' + 5`, a variable it calls)
            raise ValueError(
                f"chat template of {self.path} cannot render these messages, tools or template variables: {e}"
            ) from None

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Token ids of `render_chat(...)`; with `tokenize=False` the rendered text itself, as in
        transformers (whose `add_generation_prompt` defaults to False, ours to True)."""
        text = self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text) if tokenize else text


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads a Hugging Face tokenizer directory offline (AutoTokenizer, fast tokenizers only), or the tokenizer
    of a GGUF file (a path ending in .gguf: `exactrl.model.gguf_tokenizer`)."""
    from transformers import AutoTokenizer

    from exactrl.model.gguf import is_gguf_path

    if is_gguf_path(path):
        from exactrl.model.gguf_tokenizer import gguf_hf_tokenizer

        return wrap_tokenizer(gguf_hf_tokenizer(path), Path(path))
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"tokenizer directory {path} "
            + ("is a file: give the directory that holds the tokenizer files" if path.exists() else "does not exist")
        )
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(
            f"{path} holds no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}); a "
            f"training checkpoint has none: pass the tokenizer's directory separately (exactrl serve "
            f"--tokenizer DIR, or model.tokenizer in a run config), or build one with "
            f"exactrl.model.tokenizer.build_tokenizer"
        )
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # a damaged file fails anywhere inside transformers/tokenizers, with any type
        raise ValueError(f"cannot load the tokenizer in {path}: {type(e).__name__}: {e}") from e
    if not hf.is_fast:
        raise ValueError(f"tokenizer at {path} is not a fast (Rust) tokenizer; add a tokenizer.json")
    return wrap_tokenizer(hf, path)


def wrap_tokenizer(hf: Any, path: Path) -> Tokenizer:
    """The `Tokenizer` of a transformers fast tokenizer: eos (else a known end-of-turn token), end of turn, pad."""
    vocab = hf.get_vocab()
    eot = next((vocab[t] for t in END_OF_TURN_TOKENS if t in vocab), None)
    eos = hf.eos_token_id if hf.eos_token_id is not None else eot
    if eos is None:
        raise ValueError(
            f"tokenizer at {path} has neither an eos token nor an end-of-turn token "
            f"({', '.join(END_OF_TURN_TOKENS)}); set eos_token in tokenizer_config.json"
        )
    pad = hf.pad_token_id if hf.pad_token_id is not None else eos
    return Tokenizer(
        hf=hf,
        path=path,
        eos_token_id=eos,
        end_of_turn_id=eot if eot is not None else eos,
        pad_token_id=pad,
        vocab_size=len(hf),
    )
