"""A small character-level language model built from Gated DeltaNet layers: the main job.

embedding -> n_layers x (gdn_ext.layer's Gated DeltaNet layer) -> RMSNorm -> output head,
forward and backward entirely in gdn_ext (recurrence in C, the rest in NumPy), trained with Adam.
Text: the Python documentation topics that ship with the standard library (``pydoc_data``), or
any UTF-8 file. Generation runs token by token with :func:`gdn_ext.layer.gated_deltanet_step`.
"""
import math
from dataclasses import dataclass

import numpy as np

from ..layer import (RULES, GatedDeltaNetParams, gated_deltanet_backward, gated_deltanet_forward,
                    gated_deltanet_step, rmsnorm, rmsnorm_backward)

__all__ = ["load_text", "CharVocab", "CharLM", "Adam", "unigram_baseline", "cross_entropy"]


def load_text(path=None):
    """The training text: a UTF-8 file, or (path None) the standard library's pydoc topics."""
    if path is not None:
        with open(path, encoding="utf-8") as f:
            return f.read()
    from pydoc_data.topics import topics
    return "\n".join(topics[name] for name in sorted(topics))


class CharVocab:
    """Characters <-> integer ids, built from a text."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self):
        return len(self.chars)

    def encode(self, text):
        """str -> int64 ids [len(text)]; KeyError for a character outside the vocabulary."""
        return np.array([self.index[c] for c in text], dtype=np.int64)

    def decode(self, ids):
        """Sequence of int ids -> str."""
        return "".join(self.chars[int(i)] for i in ids)


def cross_entropy(logits, targets):
    """Mean cross-entropy (nats) and its gradient with respect to logits [N, V]; targets [N]."""
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    n = targets.shape[0]
    loss = -logp[np.arange(n), targets].mean()
    dlogits = np.exp(logp)
    dlogits[np.arange(n), targets] -= 1
    return float(loss), dlogits / n


def unigram_baseline(train_ids, val_ids, vocab_size):
    """Cross-entropy (nats per character) of val under train's character frequencies
    (add-one smoothed): what a model that ignores context achieves."""
    counts = np.bincount(train_ids, minlength=vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val_ids].mean())


@dataclass
class CharLM:
    """Weights: embed [V, D], layers (GatedDeltaNetParams each), norm_weight [D], head [D, V]."""
    embed: np.ndarray
    layers: list
    norm_weight: np.ndarray
    head: np.ndarray
    normalize_qk: bool = True
    rule: str = "gated_delta"   # a key of gdn_ext.layer.RULES: the token mixer's rule

    @property
    def _rule(self):
        gated, delta = RULES[self.rule]
        return dict(gated=gated, delta_rule=delta)

    @classmethod
    def init(cls, vocab_size, d_model=128, n_layers=3, n_heads=4, d_head=32, seed=0,
             dtype=np.float32, rule="gated_delta"):
        """Random weights: embeddings N(0, 1), layers as GatedDeltaNetParams.init (Wo scaled by
        1/sqrt(2 n_layers)), head N(0, 1/d_model). d_head is Dk = Dv of every head."""
        rng = np.random.default_rng(seed)
        layers = [GatedDeltaNetParams.init(d_model, d_head, d_head, n_heads, seed=seed + 1 + i,
                                           dtype=dtype) for i in range(n_layers)]
        for p in layers:   # small residual branches at init, as deep residual nets do
            p.Wo *= 1.0 / math.sqrt(2 * n_layers)
        if rule not in RULES:
            raise ValueError(f"rule must be one of {sorted(RULES)}; got {rule!r}")
        return cls(embed=rng.standard_normal((vocab_size, d_model)).astype(dtype),
                   layers=layers, norm_weight=np.ones(d_model, dtype), rule=rule,
                   head=(rng.standard_normal((d_model, vocab_size)) / math.sqrt(d_model)
                         ).astype(dtype))

    def arrays(self):
        """Every trainable array, in a fixed order (the optimiser's view)."""
        out = [self.embed]
        for p in self.layers:
            out += [a for _, a in p]
        return out + [self.norm_weight, self.head]

    def n_params(self):
        """Number of trainable numbers."""
        return sum(a.size for a in self.arrays())

    def loss_and_grads(self, tokens, targets, num_threads=None):
        """Mean cross-entropy of next-character prediction and the gradient of every array.

        tokens, targets: int [B, T]. Returns (loss, grads) with grads aligned with arrays()."""
        B, T = tokens.shape
        xs = [self.embed[tokens]]                                  # [B, T, D]
        caches = []   # each layer's projections, O and checkpoints: one recurrence forward
        for p in self.layers:
            y, _, cache = gated_deltanet_forward(xs[-1], None, p, normalize_qk=self.normalize_qk,
                                                 num_threads=num_threads, return_cache=True,
                                                 **self._rule)
            xs.append(y)
            caches.append(cache)
        h = rmsnorm(xs[-1], self.norm_weight)
        logits = h.reshape(B * T, -1) @ self.head
        loss, dlogits = cross_entropy(logits, targets.reshape(-1))
        dlogits = dlogits.astype(self.head.dtype)

        dhead = h.reshape(B * T, -1).T @ dlogits
        dh = (dlogits @ self.head.T).reshape(h.shape)
        dx, dnorm = rmsnorm_backward(dh, xs[-1], self.norm_weight)
        layer_grads = []
        for p, x, cache in zip(reversed(self.layers), reversed(xs[:-1]), reversed(caches)):
            dx, _, dp = gated_deltanet_backward(dx, x, None, p, normalize_qk=self.normalize_qk,
                                                num_threads=num_threads, cache=cache,
                                                **self._rule)
            layer_grads.append(dp)
        dembed = np.zeros_like(self.embed)
        np.add.at(dembed, tokens.reshape(-1), dx.reshape(B * T, -1))
        grads = [dembed]
        for dp in reversed(layer_grads):
            grads += [a for _, a in dp]
        return loss, grads + [dnorm, dhead]

    def loss(self, tokens, targets, num_threads=None):
        """Mean cross-entropy (nats per character), forward only."""
        B, T = tokens.shape
        x = self.embed[tokens]
        for p in self.layers:
            x, _ = gated_deltanet_forward(x, None, p, normalize_qk=self.normalize_qk,
                                          num_threads=num_threads, **self._rule)
        logits = rmsnorm(x, self.norm_weight).reshape(B * T, -1) @ self.head
        return cross_entropy(logits, targets.reshape(-1))[0]

    def generate(self, prompt_ids, n_new, rng, temperature=0.8):
        """Sample n_new ids after prompt_ids, one token at a time through the recurrent states
        (gated_deltanet_step): the cost per token does not grow with the context."""
        states = [None] * len(self.layers)
        out = list(prompt_ids)
        logits = None
        for i in range(len(prompt_ids) + n_new):
            tok = out[i] if i < len(prompt_ids) else _sample(logits, rng, temperature)
            if i >= len(prompt_ids):
                out.append(tok)
            x = self.embed[[tok]]                                   # [1, D]
            for j, p in enumerate(self.layers):
                x, states[j] = gated_deltanet_step(x, states[j], p, normalize_qk=self.normalize_qk,
                                                   **self._rule)
            logits = (rmsnorm(x, self.norm_weight) @ self.head)[0]
        return out


def _sample(logits, rng, temperature):
    z = logits.astype(np.float64) / temperature
    pr = np.exp(z - z.max())
    return int(rng.choice(pr.size, p=pr / pr.sum()))


class Adam:
    """Adam (Kingma & Ba, 2015) with decoupled weight decay off, updating arrays in place."""

    def __init__(self, arrays, lr=3e-3, betas=(0.9, 0.99), eps=1e-8):
        self.arrays, self.lr, self.betas, self.eps = arrays, lr, betas, eps
        self.m = [np.zeros_like(a) for a in arrays]
        self.v = [np.zeros_like(a) for a in arrays]
        self.t = 0

    def step(self, grads, lr=None):
        """One update of every array in place; grads aligned with the arrays; lr overrides the
        learning rate for this step."""
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.t += 1
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for a, g, m, v in zip(self.arrays, grads, self.m, self.v):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            a -= (lr / c1) * m / (np.sqrt(v / c2) + self.eps)
