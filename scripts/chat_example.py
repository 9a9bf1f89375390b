"""The worked example of docs/documents_and_chat.md: pretrain a tiny Llama-style model on `make
train`'s text, fine-tune it on synthetic arithmetic conversations, print its answer accuracy
before and after, export it, and check that transformers' `generate` with the chat template gives
the same answer tokens.

    python scripts/chat_example.py --out_dir runs/chat_example          # ~10 min on a 2-core CPU

Every step is this repo's own command line (prepare_data.py, train.py --task train|test|chat,
export_hf.py), run as a user runs it; the example adds only what it needs and nothing ships:
a tokenizer folder (a byte-level BPE trained on the same text, with Llama 3's special tokens and
chat template) and the conversations ("What is 17 plus 25?" -> "42").
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.data.default import _stdlib_sources
from jaxtrain.parser import Parser

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)  # Meta-Llama-3-8B-Instruct's
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
MODEL = ["--config", "configs/llama_tiny.yaml", "--sample_tokens", "0", "--progress_bar", "false"]


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(args[:2])} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def _tokenizer(out: Path, texts: list[Path]) -> Path:
    import tokenizers as tk

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIALS, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train([str(p) for p in texts], trainer=trainer)
    tok.post_processor = tk.processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE,
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


def _conversations(path: Path, n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        pairs.append((f"What is {a} plus {b}?", str(a + b)))
    messages = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in pairs]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in messages))
    return pairs


def _answers(run_dir: Path, checkpoint: str, questions: Path, step: int) -> list[str]:
    _run("scripts/train.py", "--task", "chat", "--resume_from", checkpoint, "--prompt_file", str(questions),
         "--temperature", "0", "--max_new_tokens", "8", "--run_dir", str(run_dir))  # fmt: skip
    lines = (run_dir / f"chat_step{step}.jsonl").read_text().splitlines()
    return [json.loads(line)["completion"] for line in lines]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="runs/chat_example", help="where everything is written")
    p.add_argument("--pretrain_steps", type=int, default=300)
    p.add_argument("--finetune_steps", type=int, default=300)
    return p.parse_args(argv)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = (ROOT / args.out_dir).resolve()
    texts = _stdlib_sources(4 * 2**20)  # make train's text: the standard library's own sources
    tok_dir = _tokenizer(out / "tokenizer", texts)
    _run("scripts/prepare_data.py", *map(str, texts), "--tokenizer", str(tok_dir), "--out_dir",
         str(out / "text"), "--overwrite")  # fmt: skip
    pairs = _conversations(out / "chats.jsonl", 4000, seed=0)
    _run("scripts/prepare_data.py", str(out / "chats.jsonl"), "--chat", "--tokenizer", str(tok_dir),
         "--seq_len", "128", "--out_dir", str(out / "chats"), "--val_fraction", "0.05",
         "--overwrite")  # fmt: skip
    held_out = pairs[-100:]  # from the validation split: never trained on
    questions = out / "questions.txt"
    questions.write_text("".join(q + "\n" for q, _ in held_out))
    vocab = ["--model.vocab_size", "512"]
    pre, fine = out / "pretrain", out / "finetune"
    _run("scripts/train.py", *MODEL, *vocab, "--train_data_path", str(out / "text/manifest.json"),
         "--total_steps", str(args.pretrain_steps), "--run_dir", str(pre), "--overwrite")  # fmt: skip
    before = _answers(pre, str(pre / "checkpoints"), questions, args.pretrain_steps)
    _run("scripts/train.py", *MODEL, *vocab, "--init_from", str(pre / "checkpoints"),
         "--train_data_path", str(out / "chats/manifest.json"), "--total_steps", str(args.finetune_steps),
         "--optim.lr", "1e-3", "--run_dir", str(fine), "--overwrite")  # fmt: skip
    after = _answers(fine, str(fine / "checkpoints"), questions, args.finetune_steps)
    _run(
        "scripts/train.py",
        "--task",
        "test",
        "--resume_from",
        str(fine / "checkpoints"),
        "--run_dir",
        str(fine),
    )
    val_loss = json.loads((fine / f"test_step{args.finetune_steps}.json").read_text())["loss"]
    _run("scripts/export_hf.py", str(fine), "--out", str(out / "hf"))
    agree = _transformers_agree(out / "hf", [q for q, _ in held_out], after)
    result = {
        "accuracy_before": sum(a.strip() == t for a, (_, t) in zip(before, held_out, strict=True))
        / len(held_out),
        "accuracy_after": sum(a.strip() == t for a, (_, t) in zip(after, held_out, strict=True))
        / len(held_out),
        "val_loss_assistant_tokens": val_loss,
        "transformers_agree": agree,
        "questions": len(held_out),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def _transformers_agree(hf_dir: Path, questions: list[str], ours: list[str]) -> float:
    """Share of questions where transformers' greedy generate, prompted with the chat template,
    gives the answer tokens --task chat gave (it stops at the same end of turn)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    same = 0
    for question, answer in zip(questions, ours, strict=True):
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        prompt = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])
        with torch.no_grad():
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8
            )
        same += tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True) == answer
    return same / len(questions)


if __name__ == "__main__":
    main()
