"""A small RWKV-7 language model in plain PyTorch, with torch_dplr for the attention.

Shared by ``train_rwkv7.py`` and ``generate_rwkv7.py``.  Each block is RWKV-7's time mixing
(token shift, low-rank decay / in-context-rate / value-residual / gate projections, the DPLR
recurrence with ``a = -kk``, ``b = kk·iclr``, a per-head group norm and the ``r·k`` bonus) and
its channel mixing (token shift, squared-ReLU MLP).

Two ways to run it:

- :meth:`RWKV7.forward` over packed sequences (``[1, T]`` tokens, ``cu_seqlens``), the chunked
  form: training, and the prefill of generation (it can return each sequence's final states).
- :meth:`RWKV7.decode` advances a batch of requests by one token each, their states held in
  :class:`DecodeState` pools and addressed by slot (``torch_dplr.rwkv7_decode``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_dplr

RWKV7_BOUND = -math.exp(-0.5)  # w = -exp(-0.5)·sigmoid(·) lies in (RWKV7_BOUND, 0)


@dataclass
class Config:
    vocab_size: int = 64
    d_model: int = 64
    n_layers: int = 2
    head_dim: int = 16
    chunk_size: int = 16
    lora_dim: int = 16
    ffn_mult: int = 4

    @property
    def n_heads(self) -> int:
        return self.d_model // self.head_dim


def shift_tokens(x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``x[t-1] - x[t]`` per packed sequence: ``first [1, T, 1]`` is 1 at each sequence's first
    token, where the previous token is zero (a fresh history)."""
    previous = F.pad(x, (0, 0, 1, -1)) * (1 - first)
    return previous - x


class LowRank(nn.Module):
    """``bias + act(x @ A) @ B`` (RWKV-7's low-rank projections)."""

    def __init__(self, d: int, rank: int, act=None, bias: float | None = 0.0):
        super().__init__()
        self.down = nn.Linear(d, rank, bias=False)
        self.up = nn.Linear(rank, d, bias=bias is not None)
        self.act = act or nn.Identity()
        nn.init.zeros_(self.down.weight)
        nn.init.orthogonal_(self.up.weight, gain=0.1)
        if bias is not None:
            nn.init.constant_(self.up.bias, bias)

    def forward(self, x):
        return self.up(self.act(self.down(x)))


class TimeMix(nn.Module):
    def __init__(self, cfg: Config, layer: int):
        super().__init__()
        d, self.H, self.K = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.layer, self.chunk_size = layer, cfg.chunk_size
        self.mix = nn.Parameter(torch.linspace(0.2, 0.8, 6)[:, None].repeat(1, d))  # r w k v a g
        self.r, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        nn.init.zeros_(self.o.weight)
        self.decay = LowRank(d, cfg.lora_dim, nn.Tanh(), bias=0.5)
        self.iclr = LowRank(d, cfg.lora_dim, bias=-0.5)
        self.value_mix = LowRank(d, cfg.lora_dim, bias=1.0) if layer > 0 else None
        self.gate = LowRank(d, cfg.lora_dim, nn.Sigmoid(), bias=None)
        self.k_k = nn.Parameter(torch.full((d,), 0.85))
        self.k_a = nn.Parameter(torch.ones(d))
        self.r_k = nn.Parameter(torch.full((self.H, self.K), -0.04))
        self.norm = nn.GroupNorm(self.H, d, eps=self.K * 1e-5)

    def projections(self, x, delta, v_first):
        """r, w, k, v, kk, iclr per head, the gate, and the first layer's values."""
        heads = lambda t: t.unflatten(-1, (self.H, self.K))  # noqa: E731
        xr, xw, xk, xv, xa, xg = (x + delta * m for m in self.mix)
        r, k, v = self.r(xr), self.k(xk), self.v(xv)
        w = RWKV7_BOUND * torch.sigmoid(self.decay(xw).float())
        if self.value_mix is None:
            v_first = v
        else:
            v = torch.lerp(v, v_first, torch.sigmoid(self.value_mix(xv)))
        iclr = torch.sigmoid(self.iclr(xa))
        kk = F.normalize(heads(k * self.k_k), dim=-1)
        k = k * (1 + (iclr - 1) * self.k_a)
        return (heads(r), heads(w), heads(k), heads(v), kk, heads(iclr), self.gate(xg),
                v_first)

    def finish(self, o, r, k, v, g):
        """Group norm, the ``(r·k·r_k) v`` bonus, the gate and the output projection."""
        lead = o.shape[:-2]
        o = self.norm(o.reshape(-1, self.H * self.K)).view(*lead, -1)
        bonus = ((r * k * self.r_k).sum(-1, keepdim=True) * v).flatten(-2)
        return self.o((o + bonus) * g)

    def forward(self, x, first, v_first, cu_seqlens, initial_state=None, want_state=False):
        r, w, k, v, kk, iclr, g, v_first = self.projections(x, shift_tokens(x, first), v_first)
        o, state = torch_dplr.chunk_rwkv7(r, w, k, v, -kk, kk * iclr, scale=1.0,
                                          initial_state=initial_state,
                                          output_final_state=want_state,
                                          cu_seqlens=cu_seqlens, lower_bound=RWKV7_BOUND,
                                          chunk_size=self.chunk_size)
        return self.finish(o, r, k, v, g), v_first, state

    def decode(self, x, previous, v_first, pool, slots):
        """One token per request: ``x [N, 1, d]``, ``previous [N, 1, d]`` (its last input)."""
        r, w, k, v, kk, iclr, g, v_first = self.projections(x, previous - x, v_first)
        o = torch_dplr.rwkv7_decode(r, w, k, v, -kk, kk * iclr, pool, slots)
        return self.finish(o, r, k, v, g), v_first


class ChannelMix(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        d = cfg.d_model
        self.mix = nn.Parameter(torch.full((d,), 0.5))
        self.key = nn.Linear(d, cfg.ffn_mult * d, bias=False)
        self.value = nn.Linear(cfg.ffn_mult * d, d, bias=False)
        nn.init.zeros_(self.value.weight)

    def forward(self, x, delta):
        return self.value(torch.relu(self.key(x + delta * self.mix)) ** 2)


class Block(nn.Module):
    def __init__(self, cfg: Config, layer: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.att, self.ffn = TimeMix(cfg, layer), ChannelMix(cfg)


@dataclass
class DecodeState:
    """Every request's recurrent state, in pools addressed by slot: per layer the time-mix
    state ``wkv [slots, H, K, K]`` (fp32, or bf16 storage; updated in place by
    ``rwkv7_decode``) and the last inputs of the two token shifts ``shift_att`` /
    ``shift_ffn [slots, d]``."""
    wkv: list
    shift_att: torch.Tensor  # [layers, slots, d]
    shift_ffn: torch.Tensor

    @staticmethod
    def empty(cfg: Config, slots: int, device, dtype=torch.float32,
              state_dtype=torch.float32) -> "DecodeState":
        wkv = [torch_dplr.new_state_pool(slots, cfg.n_heads, cfg.head_dim, device=device,
                                         dtype=state_dtype)
               for _ in range(cfg.n_layers)]
        shift = torch.zeros(cfg.n_layers, slots, cfg.d_model, device=device, dtype=dtype)
        return DecodeState(wkv, shift, shift.clone())

    def copy_(self, other: "DecodeState") -> None:
        for mine, theirs in zip(self.wkv, other.wkv):
            mine.copy_(theirs)
        self.shift_att.copy_(other.shift_att)
        self.shift_ffn.copy_(other.shift_ffn)

    def clone(self) -> "DecodeState":
        return DecodeState([p.clone() for p in self.wkv], self.shift_att.clone(),
                           self.shift_ffn.clone())


class RWKV7(nn.Module):
    def __init__(self, cfg: Config, checkpoint_policy: str | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.ln0, self.ln_out = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.uniform_(self.embed.weight, -1e-4, 1e-4)
        # checkpoint each time mix under a torch_dplr policy (None: keep everything)
        self.context_fn = (torch_dplr.policies.context_fn(checkpoint_policy)
                           if checkpoint_policy else None)

    def forward(self, tokens, first, cu_seqlens, targets=None, prefill_states=None):
        """Packed sequences ``tokens [1, T]`` (``first [1, T, 1]`` marks each one's first
        token).  With ``targets`` returns the mean cross-entropy over targets ``!= -100``;
        else the logits, and with ``prefill_states`` (a :class:`DecodeState` and the slots of
        the sequences) writes each sequence's final states into it."""
        x = self.ln0(self.embed(tokens))
        v_first = None
        want = prefill_states is not None
        last = cu_seqlens[1:].long() - 1  # each sequence's last token (non-empty sequences)
        for i, blk in enumerate(self.blocks):
            h = blk.ln1(x)
            if self.context_fn is not None and self.training:
                out, v_first, state = torch.utils.checkpoint.checkpoint(
                    blk.att, h, first, v_first, cu_seqlens, use_reentrant=False,
                    context_fn=self.context_fn)
            else:
                out, v_first, state = blk.att(h, first, v_first, cu_seqlens, want_state=want)
            x = x + out
            h2 = blk.ln2(x)
            x = x + blk.ffn(h2, shift_tokens(h2, first))
            if want:
                pool, slots = prefill_states
                index = slots.long()
                pool.wkv[i].index_copy_(0, index, state.to(pool.wkv[i].dtype))
                pool.shift_att[i].index_copy_(0, index, h[0, last].to(pool.shift_att.dtype))
                pool.shift_ffn[i].index_copy_(0, index, h2[0, last].to(pool.shift_ffn.dtype))
        logits = self.head(self.ln_out(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)

    def decode(self, tokens, states: DecodeState, slots):
        """One token per request, ``tokens [N]``; request n's states live in slot
        ``slots[n]`` of ``states`` and are advanced in place.  Returns logits ``[N, vocab]``."""
        index = slots.long()
        x = self.ln0(self.embed(tokens[:, None]))
        v_first = None
        for i, blk in enumerate(self.blocks):
            h = blk.ln1(x)
            previous = states.shift_att[i].index_select(0, index)[:, None].to(h.dtype)
            out, v_first = blk.att.decode(h, previous, v_first, states.wkv[i], slots)
            states.shift_att[i].index_copy_(0, index, h[:, 0].to(states.shift_att.dtype))
            x = x + out
            h2 = blk.ln2(x)
            previous = states.shift_ffn[i].index_select(0, index)[:, None].to(h2.dtype)
            states.shift_ffn[i].index_copy_(0, index, h2[:, 0].to(states.shift_ffn.dtype))
            x = x + blk.ffn(h2, previous - h2)
        return self.head(self.ln_out(x))[:, 0]


def perturb_(model: nn.Module, scale: float = 0.05, seed: int = 0) -> nn.Module:
    """Adds seeded noise to every weight, so an untrained model's outputs depend on every
    path (several projections start at zero, as RWKV-7 initializes them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p) * scale)
    return model
