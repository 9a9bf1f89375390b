"""Small Hugging Face tokenizer dirs for the tests: byte-level BPEs with the special tokens and the
real chat templates of Llama 3 Instruct and Qwen2 Instruct (ChatML)."""

import json
from pathlib import Path

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
KINDS = {
    "llama3": {
        "specials": [
            "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
        ],
        "config": {
            "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE,
        },
        "prepend_bos": True,
    },
    "qwen2": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "config": {
            "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "chat_template": CHATML_TEMPLATE,
        },
        "prepend_bos": False,
    },
}  # fmt: skip
CORPUS = [
    "What is 12 plus 7? The answer is 19. You are a helpful assistant. Hello there, how are you?",
    "system user assistant: numbers 0 1 2 3 4 5 6 7 8 9 plus minus times equals",
] * 20
CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7"}],
    [
        {"role": "system", "content": "You answer sums."},
        {"role": "user", "content": "12 plus 7?"},
        {"role": "assistant", "content": " 19 "},
        {"role": "user", "content": "and 1 plus 1?"},
        {"role": "assistant", "content": "2, héllo"},
    ],
]


def make_tokenizer_dir(path: Path, kind: str) -> Path:
    """A Hugging Face tokenizer dir: tokenizer.json (a small byte-level BPE with the model's special
    tokens; Llama 3's post-processor puts BOS first) and tokenizer_config.json with the template."""
    import tokenizers as tk

    spec = KINDS[kind]
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=400, special_tokens=spec["specials"], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if spec["prepend_bos"]:
        bos = spec["config"]["bos_token"]
        tok.post_processor = tk.processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config | spec["config"]))
    return path


# How transformers saves a tokenizer's chat template: transformers 5's save_pretrained writes
# chat_template.jinja; older versions (and save_jinja_files=False) keep it in tokenizer_config.json.
FORMS = ("jinja", "config")


def saved_by_transformers(source: Path, path: Path, form: str) -> Path:
    """The tokenizer dir `source` loaded and saved again by transformers' own save_pretrained, its
    chat template in the given form."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(source))
    tok.save_pretrained(str(path), save_jinja_files=form == "jinja")
    assert (path / "chat_template.jinja").is_file() == (form == "jinja")
    return path
