"""A tokenizer's chat template, rendered as transformers renders it: what prepare_data.py --chat
masks, --task chat prompts with, and predict, chat and export stop at.

    chat = ChatFormat(BPETokenizer.from_file("Qwen2.5-0.5B-Instruct/"))   # its chat template
    ids, keep = chat.encode([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}])

A conversation is rendered with the tokenizer's chat template (chat_template.jinja, or
`chat_template` in tokenizer_config.json: jaxtrain/tokenizer.py reads both) as transformers'
`apply_chat_template(messages, tokenize=True)` renders and tokenizes it: the same jinja2 sandbox
settings and names, then the text tokenized with no special token added. `keep` is 1 on the
assistant turns, each with its end-of-turn token, and 0 elsewhere: a fine-tune learns the answers,
never the questions. An assistant turn is found by rendering the conversation up to it (with the
generation prompt) and through it; a template that rewrites earlier turns when later ones follow
cannot be masked this way and is refused.

The boundary between conversations is the tokenizer's BOS where the template renders it first
(Llama 3), else an end-of-text token appended after each (Qwen's <|endoftext|>: its eos_token, or
pad_token when the eos ends every turn).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import numpy as np

from jaxtrain.errors import UserError
from jaxtrain.tokenizer import BPETokenizer, Framing

# transformers passes the tokenizer's special tokens to every template under these names
_SPECIAL_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
)  # fmt: skip
_PROBE = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]


def _template(source: str) -> Any:
    """The template compiled as transformers compiles it (chat_template_utils): a sandbox with
    trim_blocks, lstrip_blocks, loop controls, its tojson, raise_exception and strftime_now."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserError("--chat needs jinja2: pip install -e '.[chat]'") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} (transformers' assistant-mask tag): its body as is.
        The mask here comes from rendering turn by turn, so templates without the tag mask too."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        # transformers' own: jinja's escapes HTML characters
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise UserError(
            f"the tokenizer's chat template does not compile ({e}); fix its chat_template.jinja (or "
            "the chat_template of its tokenizer_config.json)"
        ) from None


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class ChatFormat:
    """A tokenizer's chat template: conversations to (ids, keep), its boundary and end-of-turn tokens."""

    def __init__(self, tok: BPETokenizer, fix: str = "") -> None:
        """`fix`: what to pass instead (the caller's flag) when `tok` has no chat template."""
        if not tok.chat_template:
            named = ", ".join(sorted(tok.chat_templates))
            which = f"only named ones ({named}), no default one" if named else "none"
            raise UserError(
                f"the tokenizer's chat templates (chat_template.jinja, or chat_template in "
                f"tokenizer_config.json): {which}; {fix}"
            )
        self.tok = tok
        self._template = _template(tok.chat_template)
        self._special: dict[str, Any] = {}
        for name in _SPECIAL_NAMES:
            value = tok.config.get(name)
            if name == "additional_special_tokens" and isinstance(value, list):
                self._special[name] = [_token_text(v) for v in value]
            elif _token_text(value) is not None:
                self._special[name] = _token_text(value)
        probe = self.render(_PROBE)
        self.framing = self._boundary(probe)
        # The token right after the probe's answer: where an assistant turn ends (<|eot_id|>, <|im_end|>)
        answer = self.render(_PROBE[:1], add_generation_prompt=True)
        after, _ = tok.encode_offsets(probe[len(answer) + len(_PROBE[1]["content"]) :])
        self.end_of_turn: int | None = int(after[0]) if len(after) else None

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation's text, as transformers' apply_chat_template(tokenize=False) gives it."""
        return str(
            self._template.render(
                messages=list(messages), tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self._special,
            )
        )  # fmt: skip

    def prompt(self, user: str, system: str = "") -> str:
        """The text an answer follows: a user turn, after a system turn when one is given, and the
        generation prompt. A template that refuses or drops the system turn is a one-line error."""
        messages = [{"role": "system", "content": system}] if system else []
        try:
            text = self.render([*messages, {"role": "user", "content": user}], add_generation_prompt=True)
        except Exception as e:  # the template's raise_exception: it refuses these turns
            what, fix = ("a system turn", "leave out --system") if system else ("the prompt", "change it")
            raise UserError(f"the chat template refuses {what} ({str(e).splitlines()[0]}); {fix}") from None
        if system and system.strip() not in text:
            raise UserError("the chat template drops the system turn (--system) it is given; leave it out")
        return text

    def _boundary(self, probe: str) -> Framing:
        bos = self.tok.special("bos_token")
        if bos is not None and probe.startswith(self._special.get("bos_token", "\0")):
            return Framing(bos=bos)  # the template renders it: nothing to add
        for name in ("eos_token", "pad_token"):  # an end-of-text token no turn uses
            token, text = self.tok.special(name), self._special.get(name)
            if token is not None and text and text not in probe:
                return Framing(eos=token)
        return Framing()

    def encode(self, messages: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the rendered conversation (plus its end-of-text boundary) and its loss mask."""
        text = self.render(messages)
        ids, starts = self.tok.encode_offsets(text)
        keep = np.zeros(len(ids), np.uint8)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    "its chat template renders earlier turns differently once later ones follow, so the "
                    "assistant turns cannot be told apart"
                )
            # Through the end-of-turn token; whitespace after it (ChatML's newline) is the template's
            keep[(starts >= len(before)) & (starts < len(through.rstrip()))] = 1
        if self.framing.eos is not None:
            ids, keep = np.append(ids, self.framing.eos), np.append(keep, np.uint8(0))
        return ids, keep


def stop_tokens(tokenizer: Any) -> set[int]:
    """Where a sample ends: the tokenizer's end of text and its chat template's end of turn."""
    ends = {tokenizer.framing.eos}
    if getattr(tokenizer, "chat_template", ""):
        chat = ChatFormat(tokenizer)
        ends |= {chat.end_of_turn, chat.framing.eos}
    return {t for t in ends if t is not None}


def chat_framing(tok: BPETokenizer) -> Framing:
    """How --chat frames conversations with this tokenizer (Framing() when it has no template)."""
    return ChatFormat(tok).framing if tok.chat_template else Framing()
