"""jaxtrain's GPT in PyTorch, for the side-by-side benchmarks (bench_torch.py on CPU, bench_gpu.py).

Pre-norm RMSNorm blocks, rotary or learned positions, causal scaled-dot-product attention, GELU
MLP (4x), no biases, tied embeddings: the same function and the same FLOPs as jaxtrain.model.transformer.GPT.
"""

import torch
import torch.nn.functional as F
from torch import nn

from jaxtrain.config import Config


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        if cos is not None and sin is not None:
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TorchGPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        m = cfg.model
        self.wte = nn.Embedding(m.vocab_size, m.d_model)
        self.blocks = nn.ModuleList(Block(m.d_model, m.n_head) for _ in range(m.n_layer))
        self.ln_f = nn.RMSNorm(m.d_model, eps=1e-5)
        self.wpe = nn.Embedding(m.seq_len, m.d_model) if m.pos_embedding == "learned" else None
        half = m.d_model // m.n_head // 2
        inv_freq = 1.0 / (m.rope_theta ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.arange(m.seq_len, dtype=torch.float32)[:, None] * inv_freq[None]
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=m.init_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        cos, sin = self.cos, self.sin
        if self.wpe is not None:
            x, cos, sin = x + self.wpe.weight[: idx.shape[1]], None, None
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied head
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
