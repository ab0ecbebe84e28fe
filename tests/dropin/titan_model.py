"""A small decoder written the way torchtitan writes its Llama (our own code, in its style): the
blocks in ``self.layers``, an ``nn.ModuleDict`` keyed by layer number, and a forward that returns
logits, the loss computed by the training loop. ``labels=`` makes it return the mean loss as a bare
scalar instead (the minimal loop's model). A model file for ``elixir-tune profile``.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, LAYERS, HEADS, SEQ = 80, 32, 2, 2, 32


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, DIM))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)
        self.w3 = nn.Linear(DIM, 4 * DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, labels=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        logits = self.output(self.norm(h))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build_model():
    return Transformer()


def example_batch(batch_size, seq_len):
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"tokens": tokens, "labels": tokens}
