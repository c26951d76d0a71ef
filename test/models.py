"""Small models the flow tests quantize: an MLP, a pre-norm transformer block, and a linear
held under several names."""

import torch
import torch.nn.functional as F


class MLP(torch.nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class TransformerBlock(torch.nn.Module):
    """Attention + MLP with residuals; every projection is an nn.Linear that gets quantized."""

    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp(self.norm2(x))


def aliased_linear(dim: int = 64, seed: int = 0) -> torch.nn.Sequential:
    """One linear under names '0', '2' and '3' of a Sequential, run three times."""
    torch.manual_seed(seed)
    shared = torch.nn.Linear(dim, dim)
    return torch.nn.Sequential(shared, torch.nn.GELU(), shared, shared)
