"""Conversations: rendered as transformers renders them, masked to the assistant turns, packed whole,
and a loss over the kept targets of the whole global batch on any mesh.

The tokenizers are built here: small byte-level BPEs with the special tokens and the real chat
templates of Llama 3 Instruct and Qwen2 Instruct (ChatML), saved as a Hugging Face tokenizer dir.

    pytest tests/test_chat.py
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from chat_tokenizers import CONVERSATIONS, FORMS, KINDS, make_tokenizer_dir, saved_by_transformers

from jaxtrain.config import load_config
from jaxtrain.data import sources
from jaxtrain.data.framing import with_framing
from jaxtrain.model.transformer import GPT
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.prepare.chat import prepare_chat
from jaxtrain.run.build import build
from jaxtrain.run.job import Job
from jaxtrain.text.chat_template import ChatFormat, stop_tokens
from jaxtrain.text.format import NO_LOSS, TOKEN_BITS
from jaxtrain.tokenizer import BPETokenizer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory):
    """Each tokenizer as transformers' save_pretrained writes it, in each form: {(kind, form): dir}."""
    root = tmp_path_factory.mktemp("tokenizers")
    made = {kind: make_tokenizer_dir(root / kind, kind) for kind in KINDS}
    return {(k, f): saved_by_transformers(made[k], root / f"{k}-{f}", f) for k in KINDS for f in FORMS}


@pytest.fixture(scope="module")
def tokenizer_dirs(saved_dirs):
    """Each tokenizer in the form transformers 5 saves it (chat_template.jinja)."""
    return {kind: saved_dirs[kind, "jinja"] for kind in KINDS}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_rendering_equals_transformers_apply_chat_template(saved_dirs, kind, form):
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(str(saved_dirs[kind, form]))
    chat = ChatFormat(BPETokenizer.from_file(saved_dirs[kind, form]))
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert chat.render(messages) == reference.apply_chat_template(messages, tokenize=False)
        ids, keep = chat.encode(messages)
        boundary = [] if chat.framing.eos is None else [chat.framing.eos]
        assert ids.tolist() == expected + boundary
        # The kept tokens are the assistant turns' (as the template writes them), each with its end of turn
        eot = reference.convert_tokens_to_ids({"llama3": "<|eot_id|>", "qwen2": "<|im_end|>"}[kind])
        assert chat.end_of_turn == eot
        kept = [ids[keep == 1]]
        answers = [
            m["content"].strip() if kind == "llama3" else m["content"]
            for m in messages
            if m["role"] == "assistant"
        ]
        assert reference.decode(np.concatenate(kept).tolist()) == "".join(
            a + reference.decode([eot]) for a in answers
        )
        assert keep[ids == eot].sum() == len(answers)  # the users' and system's end of turn take no loss


def test_a_template_with_generation_tags_renders_as_transformers_renders_it(saved_dirs, tmp_path):
    """transformers' {% generation %} tag (templates that mark assistant text for its own masks)."""
    import shutil

    import transformers  # a dev dependency: a skip would hide a broken install

    directory = tmp_path / "tagged"
    shutil.copytree(saved_dirs["qwen2", "config"], directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    tagged = (
        "{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + "
        "'<|im_end|>' }}{% endif %}{{ '\n' }}"
    )
    assert turn in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(turn, tagged)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    chat = ChatFormat(BPETokenizer.from_file(directory))
    for messages in CONVERSATIONS:
        assert chat.render(messages) == reference.apply_chat_template(messages, tokenize=False)
        theirs = reference.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
        ids, keep = chat.encode(messages)
        assert ids[:-1].tolist() == list(theirs["input_ids"])  # (ours ends with <|endoftext|>)
        assert keep[:-1].tolist() == list(theirs["assistant_masks"])  # the same mask as transformers'


def test_boundaries_between_conversations(tokenizer_dirs):
    llama = ChatFormat(BPETokenizer.from_file(tokenizer_dirs["llama3"]))
    qwen = ChatFormat(BPETokenizer.from_file(tokenizer_dirs["qwen2"]))
    tok_llama = BPETokenizer.from_file(tokenizer_dirs["llama3"])
    assert (llama.framing.bos, llama.framing.eos) == (tok_llama.token_id("<|begin_of_text|>"), None)
    # Qwen's eos_token <|im_end|> ends every turn: the conversation boundary is <|endoftext|>.
    tok_qwen = BPETokenizer.from_file(tokenizer_dirs["qwen2"])
    assert (qwen.framing.bos, qwen.framing.eos) == (None, tok_qwen.token_id("<|endoftext|>"))
    # Plain documents are framed as the tokenizer frames a text: Llama's BOS first, its EOS last.
    assert (tok_llama.framing.bos, tok_llama.framing.eos) == (
        tok_llama.token_id("<|begin_of_text|>"),
        tok_llama.token_id("<|eot_id|>"),
    )


def _write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat_data(tokenizer_dirs, tmp_path_factory):
    """Llama-style conversations (one longer than a window), prepared with --chat."""
    root = tmp_path_factory.mktemp("chat")
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(60):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"{a} plus {b}?"},
                    {"role": "assistant", "content": f"{a + b}"},
                ]
            }
        )
    rows.insert(5, {"messages": CONVERSATIONS[1] * 6})  # longer than a window of 32
    src = _write_rows(root / "chats.jsonl", rows)
    return prepare_chat([src], root / "out", str(tokenizer_dirs["llama3"]), seq_len=32, val_fraction=0.1)


def test_conversations_are_packed_whole_with_their_masks(chat_data, tokenizer_dirs):
    manifest = json.loads(chat_data.manifest_path.read_text())
    tok = BPETokenizer.from_file(chat_data.manifest_path.parent)  # the copy beside the data
    bos = tok.token_id("<|begin_of_text|>")
    assert manifest["framing"] == {"bos": bos, "eos": None} and manifest["chat"]["seq_len"] == 32
    assert chat_data.cut == 1 and chat_data.conversations == {"train": 55, "val": 6}
    shards = sources.open_shards(str(chat_data.manifest_path), "train", tok.vocab_size, "auto", 32)
    rows = shards.read(np.arange(shards.n_windows))
    ids, no_loss = rows & TOKEN_BITS, (rows & NO_LOSS) != 0
    # Each window's inputs start a conversation, but those the one longer than a window goes on in.
    long, _ = ChatFormat(tok).encode(CONVERSATIONS[1] * 6)
    starts = ids[:, 0] == bos
    assert (~starts).sum() == (len(long) - 1) // 32
    # Every conversation that starts in a window ends in it: its <|eot_id|> before the next BOS.
    eot = tok.token_id("<|eot_id|>")
    whole = starts & np.append(starts[1:], True)  # not the window the long one starts in
    for row in ids[whole, :-1]:
        docs = np.split(row, np.flatnonzero(row == bos)[1:])
        assert all(d[-1] in (eot, bos) for d in docs if len(d) > 1)
    # Kept tokens are answer digits and end-of-turn tokens only.
    kept_ids = ids[:, :-1][~no_loss[:, :-1]]  # (a window's last token is the next one's first)
    assert set(tok.decode(kept_ids.tolist())) <= set("0123456789 ,héllo"), tok.decode(kept_ids.tolist())
    assert (
        kept_ids == eot
    ).sum() >= 60  # an end of turn per answer (54 + 12; the tail past the last window is dropped)
    cfg = with_framing(
        load_config(["--config", "configs/tiny.yaml", "--model.seq_len", "32"]),
        [sources.Source("chats", 1.0, shards)],
    )
    assert cfg.loss_mask and (cfg.model.doc_bos, cfg.model.doc_eos) == (bos, -1)


@pytest.mark.parametrize("form", FORMS)
def test_a_model_folder_saved_by_transformers_in_either_form_prepares_and_frames_a_run(
    saved_dirs, chat_data, tmp_path, form
):
    """A folder as transformers' save_pretrained writes it, the chat template in chat_template.jinja
    (transformers 5) or in tokenizer_config.json (before): --chat --tokenizer DIR prepares the same
    bytes from either; the set keeps the template as transformers 5 saves it, and transformers reads
    it back; --init_from hf:DIR takes the data its template framed (the model's own tokenizer)."""
    import transformers

    from jaxtrain.config import Config, ModelConfig
    from jaxtrain.data.framing import model_tokenizer

    directory = saved_dirs["llama3", form]
    source = json.loads(chat_data.manifest_path.read_text())["sources"][0]["path"]
    again = prepare_chat([source], tmp_path / "out", str(directory), seq_len=32, val_fraction=0.1)
    for name in ("train.bin", "train.mask", "val.bin", "val.mask"):
        assert (tmp_path / "out" / name).read_bytes() == (chat_data.manifest_path.parent / name).read_bytes()
    assert "chat_template" not in json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == KINDS["llama3"]["config"][
        "chat_template"
    ]
    reread = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert reread.chat_template == KINDS["llama3"]["config"]["chat_template"]
    tok = BPETokenizer.from_file(directory)
    shards = sources.open_shards(str(again.manifest_path), "train", tok.vocab_size, "auto", 32)
    cfg = Config(init_from=f"hf:{directory}", model=ModelConfig(seq_len=32))
    framed = with_framing(cfg, [sources.Source("chats", 1.0, shards)], model_tokenizer(cfg))
    assert framed.model.doc_bos == tok.token_id("<|begin_of_text|>") and framed.loss_mask


def test_named_chat_templates_are_read_and_written_as_transformers_does(saved_dirs, tmp_path):
    """additional_chat_templates/NAME.jinja beside chat_template.jinja: the default one is used,
    and saving writes both back where transformers reads them."""
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(str(saved_dirs["qwen2", "jinja"]))
    reference.chat_template = {"default": reference.chat_template, "tool_use": "{{ messages[0]['content'] }}"}
    reference.save_pretrained(tmp_path / "named")
    assert (tmp_path / "named" / "additional_chat_templates" / "tool_use.jinja").is_file()
    tok = BPETokenizer.from_file(tmp_path / "named")
    assert tok.chat_template == KINDS["qwen2"]["config"]["chat_template"]
    (tmp_path / "again").mkdir()
    tok.save(tmp_path / "again")
    assert (
        transformers.AutoTokenizer.from_pretrained(str(tmp_path / "again")).chat_template
        == reference.chat_template
    )


_STEPS: dict = {}  # (devices, accumulation) -> compiled steps and a fresh state: each compiles once


def _step_losses(cfg, batch, devices, accum=1):
    """(train loss, eval loss, grad norm) of one step from the same initial params."""
    import dataclasses

    key = (len(devices), accum)
    if key not in _STEPS:
        run = build(Job.of_devices(dataclasses.replace(cfg, gradient_accumulation_steps=accum), devices))
        _STEPS[key] = (run.mesh, run.init_state(), run.train_step, run.eval_step)
    mesh, state, train_step, eval_step = _STEPS[key]
    global_batch = mesh_lib.global_batch(batch, mesh, batch.shape[0])
    val = eval_step(state.params, global_batch)["loss"]  # its metrics carry the kept count too
    _, metrics = train_step(jax.tree.map(lambda x: x.copy(), state), global_batch)  # it donates its state
    return float(metrics["loss"]), float(val), float(metrics["grad_norm"])


@pytest.fixture(scope="module")
def masked_setup(chat_data):
    tok = BPETokenizer.from_file(chat_data.manifest_path.parent)
    shards = sources.open_shards(str(chat_data.manifest_path), "train", tok.vocab_size, "auto", 32)
    argv = [
        "--config", "configs/tiny.yaml", "--model.seq_len", "32", "--model.vocab_size", str(tok.vocab_size),
        "--model.n_layer", "1", "--optim.warmup_steps", "0", "--batch_size", "16",
    ]  # fmt: skip
    cfg = with_framing(load_config(argv), [sources.Source("chats", 1.0, shards)])
    return cfg, shards.read(np.arange(16)), tok


def test_masked_loss_is_the_same_on_one_device_and_on_eight_with_accumulation(masked_setup):
    cfg, batch, _ = masked_setup
    one = _step_losses(cfg, batch, jax.devices()[:1])
    eight_by_two = _step_losses(cfg, batch, jax.devices(), accum=2)  # 8 devices, 2 microbatches each
    np.testing.assert_allclose(eight_by_two, one, rtol=2e-5)
    # The loss is the mean over kept targets of the whole batch, not a mean of row means:
    # by hand from the model's own logits.
    model = GPT(cfg.model)
    params = _STEPS[(1, 1)][1].params  # the same seed's params, already made
    ids = batch & TOKEN_BITS
    logits = np.asarray(model.apply({"params": jax.device_get(params)}, ids[:, :-1]), np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    nll = -np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    kept = (batch[:, 1:] & NO_LOSS) == 0
    assert kept.sum() and not kept.all()
    np.testing.assert_allclose(one[1], nll[kept].mean(), rtol=1e-5)
    # Evaluation over several batches: the mean over every kept target, each batch weighed by its
    # count (here the second batch keeps only its first two rows' targets).
    from types import SimpleNamespace

    from jaxtrain.run.evaluate import mean_loss

    mesh, state, _, eval_step = _STEPS[(1, 1)]
    second = batch.copy()
    second[2:] |= NO_LOSS
    run = SimpleNamespace(eval_step=eval_step, mesh=mesh, cfg=cfg)
    both = mean_loss(run, state.params, [batch, second])
    kept2 = (second[:, 1:] & NO_LOSS) == 0
    np.testing.assert_allclose(both, np.concatenate([nll[kept], nll[kept2]]).mean(), rtol=1e-5)


def test_nothing_kept_is_a_zero_loss_not_nan(masked_setup):
    cfg, batch, _ = masked_setup
    loss, val, norm = _step_losses(cfg, batch | NO_LOSS, jax.devices(), accum=2)
    assert (loss, val, norm) == (0.0, 0.0, 0.0)


def test_the_users_tokens_before_a_conversation_do_not_change_its_loss(masked_setup):
    """A user turn packed before a conversation: its tokens take no loss and the next conversation
    never attends to them (document masking), so rewriting them leaves the loss as it was."""
    cfg, batch, tok = masked_setup
    rows = batch.copy()
    bos = tok.token_id("<|begin_of_text|>")
    changed = rows.copy()
    for r in range(len(rows)):
        ids = rows[r] & TOKEN_BITS
        second = np.flatnonzero(ids == bos)
        second = second[second > 0]
        if not len(second):
            continue
        head = slice(1, second[0])  # the first conversation, after its BOS (all of it: turns and answers)
        changed[r, head] = NO_LOSS | 7  # other tokens, no loss
        rows[r, head] |= NO_LOSS  # the same conversation, taking no loss either
    assert (changed != rows).any()
    a, b = _step_losses(cfg, rows, jax.devices()[:1]), _step_losses(cfg, changed, jax.devices()[:1])
    np.testing.assert_allclose(a[:2], b[:2], rtol=1e-6)


def test_a_bad_row_is_one_line_naming_file_and_row_exit_2_nothing_written(tokenizer_dirs, tmp_path):
    src = _write_rows(tmp_path / "bad.jsonl", [
        {"messages": CONVERSATIONS[0]},
        {"messages": [{"role": "wizard", "content": "hi"}]},
    ])  # fmt: skip
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "scripts/prepare_data.py", str(src), "--chat",
         "--tokenizer", str(tokenizer_dirs["qwen2"]), "--seq_len", "32", "--out_dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{src} row 2" in lines[0] and "'wizard'" in lines[0], lines
    assert not out.exists()  # not even the empty folder it made


def test_sampling_stops_at_a_stop_token_and_predict_stops_at_the_ends_of_text_and_turn(tokenizer_dirs):
    from jaxtrain.config import ModelConfig
    from jaxtrain.model.generate import generate

    cfg = ModelConfig(vocab_size=64, seq_len=32, n_layer=1, n_head=2, d_model=32, attention_impl="xla")
    params = GPT(cfg).init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
    prompt = np.arange(3, 9, dtype=np.int32)
    free = generate(params, cfg, prompt, 12, jax.random.key(1), temperature=0)
    k = len(free) // 2
    first = int(np.flatnonzero(free == free[k])[0])  # its first appearance
    stopped = generate(params, cfg, prompt, 12, jax.random.key(1), temperature=0, stop={int(free[k])})
    np.testing.assert_array_equal(stopped, free[:first])
    llama, qwen = (BPETokenizer.from_file(tokenizer_dirs[k]) for k in ("llama3", "qwen2"))
    assert stop_tokens(llama) == {llama.token_id("<|eot_id|>")}
    assert stop_tokens(qwen) == {qwen.token_id("<|im_end|>"), qwen.token_id("<|endoftext|>")}


def test_task_chat_answers_as_transformers_generate_in_the_window_given(tokenizer_dirs, tmp_path):
    """--task chat on a Hugging Face Llama dir as transformers 5 saves it (chat_template.jinja)
    renders the --system turn and the prompt with its template and greedy decodes what
    transformers' generate decodes; --model.seq_len 48 (the dir says 64) is taken. It prints
    `prompt -> answer` and logs the task and the answer's own length."""
    import shutil

    import torch
    import transformers

    from jaxtrain.run.resolve import window

    directory = tmp_path / "llama"
    shutil.copytree(tokenizer_dirs["llama3"], directory)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(reference), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # off the init's near-flat logits, where greedy choices come down to rounding
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    question, system = "What is 3 plus 4?", "You answer sums."
    done = subprocess.run(
        [sys.executable, "scripts/train.py", "--task", "chat", "--resume_from", f"hf:{directory}",
         "--temperature", "0", "--max_new_tokens", "8", "--model.seq_len", "48", "--run_dir", str(tmp_path),
         "--system", system],  # (the prompt is 36 tokens: with its answer, within the window)
        input=question + "\n", cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "chat_step0.jsonl").read_text().splitlines()]
    assert record["prompt"] == question and record["system"] == system
    assert f"{question} -> {record['completion'].strip()}\n" in done.stdout, done.stdout
    logged = f"chat: 1 answer of {record['tokens']} tokens (--max_new_tokens 8) written to "
    assert logged in done.stdout + done.stderr
    turns = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    ids = reference.apply_chat_template(turns, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        model.generation_config.eos_token_id = reference.convert_tokens_to_ids("<|eot_id|>")
        prompt = torch.tensor([ids])  # (a mask given: its BOS has id 0, which generate takes for padding)
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8
        )
    assert record["completion"] == reference.decode(out[0, len(ids) :], skip_special_tokens=True)
    from jaxtrain.config import ModelConfig

    saved = ModelConfig(seq_len=64)
    assert window(saved, 32).seq_len == 32 and window(saved, 0) == saved  # 0: none given
    with pytest.raises(Exception, match="pass at most 64"):
        window(saved, 128)


def test_a_run_on_chat_data_takes_its_mask_and_boundaries_test_reads_them_and_export_its_template(
    chat_data, tmp_path
):
    """The whole loop, in this process: the manifest sets loss_mask and model.doc_bos, the run
    trains and evaluates, and --task test on its checkpoint takes the same mask. Its export holds
    the chat template as transformers 5 saves it (chat_template.jinja), and transformers reads it."""
    import math

    import transformers
    import yaml

    from jaxtrain.cluster.detect import detect
    from jaxtrain.config import DistConfig
    from jaxtrain.hf.export import export
    from jaxtrain.run.loop import train
    from jaxtrain.run.tasks import evaluate_checkpoint

    tok = BPETokenizer.from_file(chat_data.manifest_path.parent)
    run_dir = tmp_path / "run"
    cfg = load_config([
        "--config", "configs/tiny.yaml", "--train_data_path", str(chat_data.manifest_path),
        "--model.seq_len", "32", "--model.vocab_size", str(tok.vocab_size), "--model.n_layer", "1",
        "--batch_size", "8", "--total_steps", "2", "--eval_interval", "2", "--eval_batches", "1",
        "--checkpoint_interval", "2", "--run_dir", str(run_dir), "--model.mlp", "swiglu",  # exportable
    ])  # fmt: skip
    single = detect(DistConfig(), {})
    result = train(cfg, single)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["loss_mask"] and saved["model"]["doc_bos"] == tok.token_id("<|begin_of_text|>")
    assert math.isfinite(result.last_loss) and math.isfinite(result.val_loss)
    tested = evaluate_checkpoint(
        load_config(["--task", "test", "--resume_from", str(run_dir / "checkpoints")]), single
    )
    assert math.isfinite(tested["loss"]) and 0 < tested["loss"] < 2 * math.log(tok.vocab_size)
    export(str(run_dir), tmp_path / "hf")
    assert "chat_template" not in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    reread = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert reread.chat_template == (tmp_path / "hf" / "chat_template.jinja").read_text() == tok.chat_template
    eot = json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"]
    assert eot == [tok.token_id("<|eot_id|>")]


def test_parquet_rows_give_what_the_same_jsonl_rows_give(tokenizer_dirs, tmp_path):
    import pyarrow as pa  # the parquet extra, in dev: a skip would hide a broken install
    import pyarrow.parquet as pq

    rows = [{"messages": m} for m in CONVERSATIONS * 3]
    pq.write_table(pa.table({"messages": [r["messages"] for r in rows]}), tmp_path / "chats.parquet")
    out = {}
    for name, src in (
        ("jsonl", _write_rows(tmp_path / "chats.jsonl", rows)),
        ("parquet", tmp_path / "chats.parquet"),
    ):
        prepare_chat([src], tmp_path / name, str(tokenizer_dirs["qwen2"]), seq_len=32, val_fraction=0)
        out[name] = [(tmp_path / name / f).read_bytes() for f in ("train.bin", "train.mask")]
    assert out["jsonl"] == out["parquet"] and out["jsonl"][1].count(1) > 0


def test_a_system_turn_the_template_refuses_or_drops_is_a_one_line_error(saved_dirs, tmp_path):
    """--system goes before the user turn; a template that raises on a system role (as Gemma's
    does) or renders without it is refused in one line, naming --system."""
    import shutil

    from jaxtrain.errors import UserError

    chat = ChatFormat(BPETokenizer.from_file(saved_dirs["qwen2", "jinja"]))
    assert chat.prompt("hi", "Be brief.").startswith("<|im_start|>system\nBe brief.<|im_end|>")
    refusing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    dropping = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    for name, template in (("refusing", refusing + "{% endif %}" + dropping), ("dropping", dropping)):
        directory = shutil.copytree(saved_dirs["qwen2", "jinja"], tmp_path / name)
        (directory / "chat_template.jinja").write_text(template)
        chat = ChatFormat(BPETokenizer.from_file(directory))
        assert chat.prompt("hi") == "hi"
        with pytest.raises(UserError) as e:
            chat.prompt("hi", "Be brief.")
        assert "--system" in str(e.value) and "\n" not in str(e.value), e.value


def test_task_chat_without_a_chat_template_names_the_flags_train_py_takes(saved_dirs, tmp_path):
    import shutil

    from jaxtrain.config import Config
    from jaxtrain.errors import UserError
    from jaxtrain.run.tasks import _starts
    from jaxtrain.tokenizer import ByteTokenizer

    directory = shutil.copytree(saved_dirs["qwen2", "jinja"], tmp_path / "plain")
    (directory / "chat_template.jinja").unlink()
    for tokenizer in (BPETokenizer.from_file(directory), ByteTokenizer()):
        with pytest.raises(UserError) as e:
            _starts(Config(task="chat", resume_from="x"), tokenizer, ["hi"])
        assert "--resume_from hf:DIR" in str(e.value) and "--tokenizer" not in str(e.value), e.value


@pytest.mark.parametrize(
    "row,message",
    [
        (
            {"messages": json.dumps(CONVERSATIONS[0])},
            "'messages' is a str, not a non-empty list of {role, content}",
        ),
        ({"messages": []}, "'messages' is an empty list"),
        ({"conversation": []}, "has no 'messages' (the list of messages; it holds: conversation)"),
        ([1, 2], "has no 'messages' (the list of messages; it holds: a list, not an object)"),
    ],
)
def test_a_row_without_a_list_of_messages_says_what_it_holds(row, message):
    from jaxtrain.prepare.chat import check_messages

    with pytest.raises(ValueError) as e:
        check_messages(row, "messages")
    assert message in str(e.value), e.value
