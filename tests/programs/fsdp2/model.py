"""A small decoder-only transformer, the shape of pytorch/examples' FSDP2 model (written anew).

Blocks of pre-norm attention and a GELU feed-forward under token and position
embeddings; each module can reset its own parameters, which is how FSDP2 scripts
initialise a model built on the meta device. Logits keep the model's dtype (float64
in the tests), where the example casts them to float32.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.0


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.dim % args.n_heads:
            raise ValueError(f"dim {args.dim} is not a multiple of n_heads {args.n_heads}")
        self.n_heads, self.dropout_p = args.n_heads, args.dropout_p
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))
        self.drop = nn.Dropout(args.dropout_p)

    def forward(self, x):
        batch, length, dim = x.shape

        def heads(t):  # (batch, length, dim) -> (batch, heads, length, dim / heads)
            return t.view(batch, length, self.n_heads, dim // self.n_heads).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)),
                                                  dropout_p=self.dropout_p if self.training else 0.0)
        return self.drop(self.wo(attended.transpose(1, 2).reshape(batch, length, dim)))

    def reset_parameters(self):
        for linear in (self.wq, self.wk, self.wv, self.wo):
            linear.reset_parameters()


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout_p: float):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.drop(self.down(F.gelu(self.up(x))))

    def reset_parameters(self):
        self.up.reset_parameters()
        self.down.reset_parameters()


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.attention = SelfAttention(args)
        self.mlp = MLP(args.dim, 4 * args.dim, args.dropout_p)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def reset_parameters(self):
        for part in (self.norm1, self.norm2, self.attention, self.mlp):
            part.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tokens = nn.Embedding(args.vocab_size, args.dim)
        self.positions = nn.Embedding(args.max_seq_len, args.dim)
        self.drop = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        length = tokens.shape[1]
        if length > self.args.max_seq_len:
            raise ValueError(f"sequence of {length} tokens, the model takes {self.args.max_seq_len}")
        h = self.drop(self.tokens(tokens) + self.positions(torch.arange(length, device=tokens.device)))
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))

    def reset_parameters(self):
        """The modules outside the blocks (each block resets its own)."""
        for part in (self.tokens, self.positions, self.norm, self.head):
            part.reset_parameters()
