"""GPT decoder in flax.linen: pre-norm blocks, rotary or learned positions, tied output.

Options for the Llama family (config.ModelConfig): a SwiGLU MLP, grouped-query attention,
an untied output head, q/k norms (Qwen3), q/k/v biases (Qwen2). Rotary positions rotate the
two contiguous halves of each head (rotate-half), the layout Hugging Face checkpoints use.
DeepSeek-V3's pieces: multi-head latent attention (model/mla.py) and routed experts in place of
the MLP past the first dense layers (model/moe.py).

Params are always float32; `dtype` is the compute dtype of activations and matmuls.
Norms and rotary angles run in float32 and logits come back as float32.

    model = GPT(cfg.model, dtype=jnp.bfloat16)
    params = model.init(rng, tokens)["params"]   # tokens: int32 [B, T], T <= seq_len
    logits = model.apply({"params": params}, tokens)   # float32 [B, T, vocab]
    losses = forward(model, params, rows, stack)   # rows [B, T+1]; stack(name, x, doc) runs each stack
    new_tokens = generate(params, cfg.model, prompt, 256, rng)   # KV-cached sampling

With `decode=True` the model keeps a key/value cache (flax collection "cache") of seq_len
positions per layer, and each call appends its tokens at the cache's index.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxtrain.config import ModelConfig
from jaxtrain.model import fp8
from jaxtrain.model.attention import Attention
from jaxtrain.model.documents import Documents, packed
from jaxtrain.model.head import Embedding, token_losses
from jaxtrain.model.layers import cache_index, constrain, norm, norm_layer
from jaxtrain.model.mlp import Mlp
from jaxtrain.model.moe import MoeMlp, is_moe_layer
from jaxtrain.model.placement import LOCAL, Gather, Placement
from jaxtrain.text.format import TOKEN_BITS


class Block(nn.Module):
    """Pre-norm transformer block. A MoE block under model.moe.overlap_groups g runs a device's
    sequences in g groups, each through the whole block by itself: no group waits on another, so
    XLA's scheduler may run one group's expert exchange beside another's attention and experts
    (the exchange hidden behind compute: docs/moe.md). The math is each sequence's alone; only
    what a capacity drops is each group's."""

    cfg: ModelConfig
    dtype: Any
    decode: bool = False
    moe: bool = False  # routed experts (model/moe.py) in place of the MLP
    placement: Placement = LOCAL

    @nn.compact
    def __call__(self, x: jax.Array, doc: Documents | None = None) -> tuple[jax.Array, None]:
        # (carry, input broadcast to every layer) -> (carry, per-layer output): what nn.scan needs.
        eps, placement = self.cfg.norm_eps, self.placement
        ln_1, ln_2 = norm_layer(eps, "ln_1"), norm_layer(eps, "ln_2")
        attn = Attention(self.cfg, self.dtype, self.decode, placement, name="attn")
        mlp: nn.Module = (
            MoeMlp(self.cfg, self.dtype, placement, name="moe")
            if self.moe
            else Mlp(self.cfg, self.dtype, placement, name="mlp")
        )

        def block(x: jax.Array, doc: Documents | None) -> jax.Array:
            x = x + attn(ln_1(x), doc)
            return x + mlp(ln_2(x))

        groups = self.cfg.moe.overlap_groups if self.moe and not self.decode else 1
        if groups == 1 or x.shape[0] % groups:  # decoding's batch, or a pipeline's microbatch
            return block(x, doc), None
        # Strided groups (sequence i in group i % g): each is a slice of this device's rows as it
        # holds them, so no group moves between devices where the batch is sharded.
        split = lambda a: a.reshape(-1, groups, *a.shape[1:])  # noqa: E731
        xs, docs = split(x), jax.tree.map(split, doc)
        ys = [block(xs[:, g], jax.tree.map(lambda a, g=g: a[:, g], docs)) for g in range(groups)]
        return jnp.stack(ys, axis=1).reshape(x.shape), None


def _with_gather(
    cls: Any, gather: Gather | None, where: tuple[str, ...] = (), methods: list[str] | None = None
) -> Any:
    """`cls` whose params pass through `gather` each time it runs (no-op when gather is None);
    `where`: the module's name, when its params' own paths do not say what they are (an embedding's
    table is `embedding`, a token embedding's is wte/embedding)."""
    if gather is None:
        return cls
    return nn.map_variables(
        cls, "params", trans_in_fn=functools.partial(gather, where=where), methods=methods
    )


def block_class(cfg: ModelConfig, placement: Placement, checkpointed: bool = False) -> Any:
    """Block, its params gathered as it runs (the placement's gather), wrapped in nn.remat as
    cfg.remat asks; not when `checkpointed`: the caller's checkpoint around it recomputes it
    (cfg.remat still says so to the layers inside, the experts' exchange among them: model/moe.py
    `_routed`)."""
    block = _with_gather(Block, placement.gather)
    if cfg.remat == "none" or checkpointed:
        return block
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if cfg.remat == "dots" else None
    policy = fp8.saving_scales(cfg.matmul, policy)
    # Under scan the loop body already stops CSE across the recomputation; outside it,
    # prevent_cse keeps XLA from merging the recomputed forward into the saved one.
    return nn.remat(block, policy=policy, prevent_cse=not cfg.scan_layers)


class GPT(nn.Module):
    """Decoder-only language model: int32 tokens [B, T] -> float32 logits [B, T, vocab]."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    # How the step runs it over its devices (model/placement.py): FSDP's per-layer gather, the
    # attention kernel's place, the experts' exchange. The model never knows how it is laid out.
    placement: Placement = LOCAL
    decode: bool = False  # keep a KV cache (collection "cache"): see `generate`
    # What a call computes: "all" (tokens -> logits), or the part before or after the layers, for
    # callers that run the layers themselves (`embed`, `head`, `forward`): "embed" (tokens -> the
    # residual stream) and "head" (the stream -> logits, or with `targets` each token's loss, as
    # "all" gives them).
    span: str = "all"

    @nn.compact
    def __call__(self, tokens: jax.Array, targets: jax.Array | None = None) -> jax.Array:
        """float32 logits [B, T, vocab]; with next tokens `targets` [B, T], each token's float32
        cross-entropy [B, T] instead, over model.token_chunks pieces of the sequence (model/head.py)."""
        cfg = self.cfg

        def embedding(num: int, name: str) -> nn.Embed:
            methods = ["__call__", "attend", "table"]
            cls = _with_gather(Embedding, self.placement.gather, (name,), methods=methods)
            init, rows_first = nn.initializers.normal(cfg.init_std), self.span == "embed"
            return cls(num, cfg.d_model, dtype=self.dtype, param_dtype=jnp.float32, embedding_init=init,
                       rows_first=rows_first, matmul=cfg.head_matmul, name=name)  # fmt: skip

        wte = embedding(cfg.vocab_size, name="wte")

        def output(x: jax.Array) -> jax.Array:
            x = norm(x, cfg.norm_eps, "ln_f")
            head = wte if cfg.tie_embeddings else embedding(cfg.vocab_size, name="lm_head")
            if targets is not None and cfg.token_chunks > 1:
                chunks = (cfg.token_chunks, self.dtype, self.placement.length_split, cfg.head_matmul)
                return token_losses(x, head.table(), targets, *chunks)
            logits = constrain(head.attend(x), "batch", "length", "vocab").astype(jnp.float32)
            if targets is None:
                return logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets)

        if self.span == "head":
            return output(tokens)
        x = wte(tokens)
        # Packed documents never see each other (decoding continues one text: no need).
        doc = None if self.decode else packed(cfg, tokens)
        if cfg.pos_embedding == "learned":
            start = cache_index(self, tokens.shape[1]) if self.decode else 0
            wpe = embedding(cfg.seq_len, name="wpe")
            x = x + (wpe(start + jnp.arange(tokens.shape[1]))[None] if doc is None else wpe(doc.positions))
        if self.span == "embed":
            return x
        if cfg.scan_layers:
            # One traced body for all layers: compile time stays flat in depth. DeepSeek's first
            # dense layers are a stack of their own, before the MoE layers' (`scanned_stacks`).
            for name, length, moe in scanned_stacks(cfg):
                x, _ = layers(self, moe, length, stack_in=True, name=name)(x, doc)
        else:
            for i in range(cfg.n_layer):
                x, _ = layers(self, is_moe_layer(cfg, i), name=f"block_{i}")(x, doc)
        return output(x)


# stack(name, x, doc) -> x: the scanned stack `name`'s layers (`scanned_stacks`), run by a caller
Stack = Callable[[str, jax.Array, Documents | None], jax.Array]


def embed(model: GPT, params: Any, rows: jax.Array) -> tuple[jax.Array, Documents | None]:
    """The model's forward before its layers, on rows [b, T+1] (token ids with flag bits:
    text/format.py): (the residual stream [b, T, d_model], the documents packed in the inputs)."""
    inputs = rows[:, :-1] & TOKEN_BITS
    x: jax.Array = model.clone(span="embed").apply({"params": params}, inputs)  # type: ignore[assignment]
    # Computed again for the layers (the span's own, for learned positions, stays inside it):
    # returning the span's copy drops one of a pipeline tick's carried arrays, a change of the
    # compiled step to make on its own.
    return x, packed(model.cfg, inputs)


def head(model: GPT, params: Any, x: jax.Array, rows: jax.Array) -> jax.Array:
    """The model's forward after its layers: each token's float32 loss [b, T] of the last layer's
    output `x` against the next tokens of rows [b, T+1]."""
    return model.clone(span="head").apply({"params": params}, x, rows[:, 1:] & TOKEN_BITS)  # type: ignore[return-value]


def forward(model: GPT, params: Any, rows: jax.Array, stack: Stack) -> jax.Array:
    """Each token's loss [b, T] of rows [b, T+1] through the model, its scanned stacks run by the
    caller's `stack` (run/accumulate.py's backward of its own); the layers between `embed` and
    `head` as GPT.__call__ runs them, in the same order."""
    x, doc = embed(model, params, rows)
    for name, _, _ in scanned_stacks(model.cfg):
        x = stack(name, x, doc)
    return head(model, params, x, rows)


def layers(
    model: GPT,
    moe: bool,
    length: int | None = None,
    checkpointed: bool = False,
    stack_in: bool = False,
    name: str | None = None,
) -> Any:
    """`model`'s layers, not yet run: one Block, or `length` of them as one scanned stack (`layer_stack`),
    params gathered as the placement asks (`block_class`; `checkpointed`: no remat of their own).
    `stack_in`: the stack's params through the placement's stack_in as it runs (GPT.__call__);
    callers that pass them through it once a step leave it out (run/accumulate.py)."""
    block = block_class(model.cfg, model.placement, checkpointed)
    cls = block if length is None else layer_stack(block, length)
    if length is not None and stack_in and model.placement.stack_in is not None:
        cls = nn.map_variables(cls, "params", trans_in_fn=model.placement.stack_in)
    return cls(model.cfg, model.dtype, model.decode, moe, model.placement, name=name)


def layer_stack(block: Any, length: int, unroll: int = 1) -> Any:
    """`length` layers of `block` as one scanned module, params stacked on a leading `layers` dim."""
    return nn.scan(
        block,
        variable_axes={"params": 0, "cache": 0, "moe": 0},
        split_rngs={"params": True},
        in_axes=nn.broadcast,
        length=length,
        unroll=unroll,
    )


def scanned_stacks(cfg: ModelConfig) -> list[tuple[str, int, bool]]:
    """The scanned layers' stacks, in order: (name, layers, MoE): `blocks` for all, or with
    moe.first_dense, `blocks_dense` of the first ones, then `blocks` of the MoE ones."""
    dense = min(cfg.moe.first_dense, cfg.n_layer) if cfg.moe.n_experts else 0
    stacks = [("blocks_dense", dense, False), ("blocks", cfg.n_layer - dense, is_moe_layer(cfg, dense))]
    return [stack for stack in stacks if stack[1]]


def flops_per_token(cfg: ModelConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 * n_params + 6 * n_layer * d_model * seq_len.

    6N counts the forward (2N) and backward (4N) multiply-adds of every weight matmul,
    with the tied embedding counted once as the output projection (an untied input embedding
    is a lookup: not counted); 6 * L * d * T (d: heads x head size) adds the attention scores
    and weighted sum (QK^T and AV, forward and backward: PaLM's 12 * L * d * T, Chowdhery et al.
    2022, appendix B) halved for the causal mask, as MaxText counts it and as cuDNN's causal
    kernel computes it (the planner's schedule replay counts the same: docs/scaling.md). With
    value heads unlike the query's (MLA), QK^T counts the query head size and AV the value's.
    """
    matmul_params = n_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    return 6.0 * matmul_params + 3.0 * cfg.n_layer * cfg.n_head * (cfg.head_size + cfg.v_size) * cfg.seq_len
