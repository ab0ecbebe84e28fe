"""The zoo's hand-written models (no transformers): a small LM with a tied head whose output has
``.loss``, and a nanoGPT-style GPT returning ``(logits, loss)`` behind a three-line wrapper.

Both are causal LMs on token ids; neither has dropout (the engine and the reference must agree).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with one fused query/key/value projection (nanoGPT's layout)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.c_attn(x).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq, dim))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TiedLM(nn.Module):
    """Our own LM: token and position embeddings, blocks, a head sharing the token embedding's weight.

    ``forward(input_ids, labels)`` returns an object with ``.loss`` and ``.logits``.
    """

    def __init__(self, vocab: int, dim: int = 32, heads: int = 4, layers: int = 2, max_seq: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two modules
        nn.init.normal_(self.embed.weight, std=0.02)  # N(0, 1) would make the tied head's logits huge

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed(input_ids) + self.position(positions)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)


class GPT(nn.Module):
    """nanoGPT's GPT, shrunk: ``forward(idx, targets)`` returns ``(logits, loss)``; the token
    embedding is tied to the head the nanoGPT way (``wte.weight = lm_head.weight``)."""

    def __init__(self, vocab: int, dim: int = 32, heads: int = 4, layers: int = 2, block_size: int = 64):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, dim),
                wpe=nn.Embedding(block_size, dim),
                h=nn.ModuleList([Block(dim, heads) for _ in range(layers)]),
                ln_f=nn.LayerNorm(dim),
            )
        )
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, param in self.named_parameters():  # nanoGPT's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class GPTWrapper(nn.Module):
    """The three-line wrapper a user writes to feed a GPT keyword batches: still ``(logits, loss)``."""

    def __init__(self, vocab: int):
        super().__init__()
        self.gpt = GPT(vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        return self.gpt(input_ids, labels)
