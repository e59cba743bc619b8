"""Block diffusion with a selective state-space mixer instead of attention: a cache of constant size.

Each layer's mixer is a Mamba-2-style selective scan (pure PyTorch, chunked): per head ``h`` a scalar decay
``exp(dt_t * A_h)``, a state ``S [P, N]`` updated as ``S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T`` and read as
``y_t = S_t C_t + D_h x_t``, gated by ``silu(z_t)`` through an RMS norm. Block diffusion needs a token to see its
own block both ways and every earlier block, never a later one, so the mixer runs two scans:

* forward, causal over the whole sequence, carried from block to block: after a finished block its state
  summarises everything before, so **the cache is that state** (``[H, P, N]`` a layer, whatever the context,
  with the convolution's few-input window);
* backward, inside each block only (reversed, from a zero state), so a block's tokens also see the ones after
  them in the block.

Before the scans, Mamba's short causal convolution (``conv1d``, depthwise, ``conv_kernel`` taps, then SiLU)
mixes each of the scan's inputs ``x, B, C`` with the ``conv_kernel - 1`` before it: what lets a token bind to
its neighbours (a name to the word after it) without spending state on it. It never looks right, so blocks
stay causal; the cache is the forward state plus the convolution's window (each layer's last
``conv_kernel - 1`` inputs), still a constant size. Blocks are ``block_size`` positions from position 0, as
the attention family's. Logits are not shifted: a masked token is predicted from its own state. The family
has no public upstream checkpoint: its layout is Qwen2's for the embeddings, norms and MLP, and Mamba-2's
names (``mixer.in_proj``, ``conv1d``, ``A_log``, ``dt_bias``, ``D``, ``norm``, ``out_proj``) for the mixer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from acache.models.config import ConfigError
from acache.models.layers import RMSNorm


@dataclass(frozen=True)
class SSMConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int  # scan heads
    head_dim: int  # P: channels a head
    state_size: int  # N
    block_size: int
    mask_token_id: int
    eos_token_id: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 65536  # the longest canvas the engine accepts (the scan itself has no limit)
    conv_kernel: int = 4  # Mamba's short causal convolution over the scan's inputs (x, B, C)
    n_groups: int = 1  # Mamba-2's groups: heads in a group share one B and C (their key and query)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the config.json it came from

    def __post_init__(self) -> None:
        check_sizes(self, "state-space config", ("vocab_size", "hidden_size", "num_layers", "intermediate_size",
                                                 "num_heads", "head_dim", "state_size", "block_size",
                                                 "max_position_embeddings", "conv_kernel", "n_groups"),
                    reals=("rms_norm_eps",))
        if self.num_heads % self.n_groups:
            raise ValueError(f"state-space config: num_heads={self.num_heads} is not a multiple of "
                             f"n_groups={self.n_groups}")

    @property
    def pad_token_id(self) -> int:
        return self.eos_token_id

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim


def check_sizes(config: object, label: str, names: tuple[str, ...], reals: tuple[str, ...] = ()) -> None:
    """Every one of ``names`` a positive integer, every one of ``reals`` a positive finite number (a norm's epsilon,
    RoPE's base: 0 or a negative one made every logit NaN), and the mask and end-of-text ids inside the vocabulary:
    the checks a config of the state-cache families makes once, at construction, naming the field."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{label}: {name} must be a positive integer, got {value!r}")
    for name in reals:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{label}: {name} must be a positive number, got {value!r}")
    for name in ("mask_token_id", "eos_token_id"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int):  # true would be token 1, 259.0 a float id
            raise ValueError(f"{label}: {name} must be an integer token id, got {value!r}")
        if not 0 <= value < config.vocab_size:
            raise ValueError(f"{label}: {name}={value} is outside the vocabulary of "
                             f"{config.vocab_size}")


class OwnLayout:
    """The checkpoint format of a family with no public upstream checkpoint: ``config.json`` holds the config's
    fields under the family's ``model_type``, and the tensors keep the module's parameter names under
    ``model.`` (``lm_head`` at the top, as Qwen2's). Loaded and written by the same loader and writer as the
    upstream families. The engine serves them with a cache of the model's own per request
    (``engine/state_runner.py``), through the same ``extend_many`` as the reference loop
    (``engine/state_runner.py``)."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    architectures: ClassVar[tuple[str, ...]]
    config_class: ClassVar[type]
    shifted_logits: ClassVar[bool] = False
    block_causal: ClassVar[bool] = True
    #: the engine keeps each request's cache as the model's own object (``empty_cache``/``extend``), not in pages
    state_cache: ClassVar[bool] = True
    #: whether ``extend_many`` runs its rows in one forward (every row's step copies alive at once) or one by one
    rows_together: ClassVar[bool] = False

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def extend_many(self, rows: list[tuple[torch.Tensor, int, Any]], logits: bool = True, cache: bool = True
                    ) -> list[tuple[torch.Tensor | None, Any]]:
        """``extend`` of each ``(tokens, start, cache)`` row; a family that can run rows together overrides it.
        Without ``cache`` each row's new cache is dropped as soon as its row is done (None): a decoding step
        keeps only its logits, and R2LM's extended K/V are a copy of the whole cache."""
        out = []
        for tokens, start, past in rows:
            row_logits, row_cache = self.extend(tokens, start, past, logits)
            out.append((row_logits, row_cache if cache else None))
            del row_cache  # not alive beside the next row's copy
        return out

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any]) -> Any:
        fields = [f for f in dataclasses.fields(cls.config_class) if f.name != "raw"]
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in raw]
        if missing:
            raise ConfigError(f"{cls.family} config.json is missing the field '{missing[0]}'")
        try:
            return cls.config_class(**{f.name: raw[f.name] for f in fields if f.name in raw}, raw=dict(raw))
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from None

    @classmethod
    def config_to_hf(cls, config: Any) -> dict[str, Any]:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "raw"}
        return {"architectures": list(cls.architectures), "model_type": cls.model_types[0], **fields,
                "torch_dtype": "float32"}

    @classmethod
    def hf_tensor_names(cls, config: Any) -> dict[str, str]:
        with torch.device("meta"):
            names = [name for name, _ in cls(config).named_parameters()]
        return {(name if name.startswith("lm_head.") else f"model.{name}"): name for name in names}


#: a state-space layer's cache: the forward scan's state ``[B, H, P, N]`` and the convolution's window, the
#: last ``conv_kernel - 1`` inputs ``[B, K - 1, C]`` it has seen
MixerCache = tuple[torch.Tensor, torch.Tensor]


def chunked_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan over ``T`` steps, ``chunk`` at a time: within a chunk every output is a masked
    product (no loop over steps), between chunks the state is carried.

    ``x [B, T, H, P]``, ``dt [B, T, H]`` (positive), ``a [H]`` (negative), ``b, c [B, T, N]`` shared by every
    head or ``[B, T, G, N]`` one per group of ``H / G`` heads, ``state [B, H, P, N]`` (the state before step 0).
    Returns ``y [B, T, H, P]`` (without the ``D`` skip) and the state after the last step. Decays are differences
    of cumulative sums inside a chunk, so they never overflow.
    """
    grouped = b.dim() == 4
    if grouped:  # every head gets its group's B and C: [B, T, H, N]
        per_group = x.shape[2] // b.shape[2]
        b, c = b.repeat_interleave(per_group, dim=2), c.repeat_interleave(per_group, dim=2)
    # the same products with B and C shared by the heads (n) or one per head (hn)
    score_eq, out_eq, read_eq, write_eq = (
        ("bthn,bshn->btsh", "btsh,btsh,bsh,bshp->bthp", "bhpn,bthn->bthp", "bsh,bsh,bshp,bshn->bhpn") if grouped
        else ("btn,bsn->bts", "btsh,bts,bsh,bshp->bthp", "bhpn,btn->bthp", "bsh,bsh,bshp,bsn->bhpn"))
    ys = []
    for s in range(0, x.shape[1], chunk):
        xs, dts, bs, cs = x[:, s:s + chunk], dt[:, s:s + chunk], b[:, s:s + chunk], c[:, s:s + chunk]
        log_decay = (dts * a).cumsum(1)  # [B, L, H]: log of the decay from the chunk start to each step
        gap = log_decay[:, :, None, :] - log_decay[:, None, :, :]  # [B, t, s, H]
        causal = torch.ones(gap.shape[1], gap.shape[2], dtype=torch.bool, device=x.device).tril()
        weights = torch.where(causal[None, :, :, None], gap, float("-inf")).exp()
        scores = torch.einsum(score_eq, cs, bs)
        y = torch.einsum(out_eq, weights, scores, dts, xs)
        y = y + torch.einsum(read_eq, state, cs) * log_decay.exp()[..., None]
        ys.append(y)
        to_end = (log_decay[:, -1:, :] - log_decay).exp()  # [B, L, H]
        state = state * log_decay[:, -1, :, None, None].exp() + torch.einsum(write_eq, to_end, dts, xs, bs)
    return torch.cat(ys, dim=1), state


class SSMMixer(nn.Module):
    """The selective scan as a sequence mixer. With ``forward_scan`` (the state-space variant) it scans left to
    right across blocks, carrying the state, and right to left inside each block; without it (R2LM's
    sidecar) only right to left inside each block, so it needs no cache at all. With ``n_groups`` above one,
    each group of heads has a B and C of its own (Mamba-2's groups): as many lookups a layer as groups."""

    def __init__(self, hidden: int, heads: int, head_dim: int, state_size: int, block_size: int, eps: float,
                 forward_scan: bool = True, conv_kernel: int = 0, n_groups: int = 1) -> None:
        super().__init__()
        self.heads, self.head_dim, self.state_size, self.block_size = heads, head_dim, state_size, block_size
        self.forward_scan = forward_scan
        self.conv_kernel = conv_kernel
        self.n_groups = n_groups
        inner = heads * head_dim
        self.bc_size = n_groups * state_size  # B's (and C's) channels
        self.in_proj = nn.Linear(hidden, 2 * inner + 2 * self.bc_size + heads, bias=False)
        if conv_kernel:  # depthwise and causal: a token mixes in the ``conv_kernel - 1`` inputs before it
            channels = inner + 2 * self.bc_size
            self.conv1d = nn.Conv1d(channels, channels, conv_kernel, groups=channels, bias=True)
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.dt_bias = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = RMSNorm(inner, eps)
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def empty_state(self, batch: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(batch, self.heads, self.head_dim, self.state_size, device=device)

    def empty_cache(self, batch: int, device: torch.device) -> MixerCache:
        """The forward scan's state and the convolution's window before position 0 (zeros: nothing yet)."""
        width = max(self.conv_kernel - 1, 0)
        window = torch.zeros(batch, width, self.heads * self.head_dim + 2 * self.bc_size, device=device,
                             dtype=self.in_proj.weight.dtype)
        return self.empty_state(batch, device), window

    def _convolve(self, xbc: torch.Tensor, window: torch.Tensor | None, valid: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal convolution of ``xbc [B, T, C]`` after ``window`` (the inputs before it), and the window
        after the last real input of each row."""
        k = self.conv_kernel
        if window is None:
            window = xbc.new_zeros(xbc.shape[0], k - 1, xbc.shape[2])
        full = torch.cat((window.to(xbc.dtype), xbc), dim=1)
        out = F.conv1d(full.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, groups=xbc.shape[2])
        ends = torch.full((xbc.shape[0],), xbc.shape[1], device=xbc.device) if valid is None else valid.sum(1)
        at = ends[:, None] + torch.arange(k - 1, device=xbc.device)  # the last k - 1 real inputs, in ``full``
        return F.silu(out.transpose(1, 2)), full.gather(1, at[..., None].expand(-1, -1, xbc.shape[2]))

    def forward(self, u: torch.Tensor, cache: MixerCache | None = None, valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, MixerCache | None]:
        """``u [B, T, hidden]`` covering whole blocks from a block boundary, ``cache`` the forward scan's state
        and the convolution's window there. Returns the outputs and the cache after the last token (None
        without a forward scan). Positions where ``valid [B, T]`` is False (right padding) take a step of
        zero: they neither write to the state nor decay it, so a padded row scans as its real tokens alone."""
        bsz, t, _ = u.shape
        h, p, n, bc = self.heads, self.head_dim, self.state_size, self.bc_size
        inner = h * p
        x, z, b, c, dt = self.in_proj(u).split([inner, inner, bc, bc, h], dim=-1)
        state, window = cache if cache is not None else (None, None)
        if self.conv_kernel:
            mixed, window = self._convolve(torch.cat((x, b, c), dim=-1), window, valid)
            x, b, c = mixed.split([inner, bc, bc], dim=-1)
        x = x.reshape(bsz, t, h, p).float()
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if valid is not None:
            dt = dt * valid[..., None]
        a = -self.A_log.float().exp()
        b, c = b.float(), c.float()
        if self.n_groups > 1:
            b, c = b.reshape(bsz, t, self.n_groups, n), c.reshape(bsz, t, self.n_groups, n)
        y = self.D.float()[:, None] * x
        if self.forward_scan:
            start = self.empty_state(bsz, u.device) if state is None else state.float()
            forward, state = chunked_scan(x, dt, a, b, c, start, self.block_size)
            # a token's own input enters both scans: count it once
            own = (b * c).sum(-1)  # [B, T] or [B, T, G]: each token's own B . C
            own = own[:, :, None] if own.dim() == 2 else own.repeat_interleave(h // self.n_groups, dim=2)
            y = y + forward - (dt[..., None] * x) * own[..., None]
        # right to left inside each block, from a zero state: every block one row of a single scan (a short last
        # block padded with steps of zero, which leave the state as it is)
        size = self.block_size
        blocks = -(-t // size)

        def by_block(v: torch.Tensor) -> torch.Tensor:
            v = torch.cat((v, v.new_zeros(bsz, blocks * size - t, *v.shape[2:])), dim=1)
            return v.reshape(bsz * blocks, size, *v.shape[2:]).flip(1)

        back, _ = chunked_scan(by_block(x), by_block(dt), a, by_block(b), by_block(c),
                               self.empty_state(bsz * blocks, u.device), size)
        y = y + back.flip(1).reshape(bsz, blocks * size, h, p)[:, :t]
        y = self.norm(y.reshape(bsz, t, inner).to(u.dtype)) * F.silu(z)
        if not self.forward_scan:
            return self.out_proj(y), None
        if window is None:
            window = u.new_zeros(bsz, 0, inner + 2 * bc)
        return self.out_proj(y), (state, window)


class SSMLayer(nn.Module):
    def __init__(self, config: SSMConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.mixer_norm = RMSNorm(h, config.rms_norm_eps)
        self.mixer = SSMMixer(h, config.num_heads, config.head_dim, config.state_size, config.block_size,
                              config.rms_norm_eps, conv_kernel=config.conv_kernel, n_groups=config.n_groups)
        self.mlp_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, cache: MixerCache, valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, MixerCache]:
        mixed, cache = self.mixer(self.mixer_norm(x), cache, valid)
        x = x + mixed
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), cache


class SSMBlockDiffusionLM(OwnLayout, nn.Module):
    """The state-space variant of the block-diffusion family: the cache after ``k`` finished blocks is one
    ``[H, P, N]`` state a layer, the same size at any context length."""

    family = "blockdiff_ssm"
    model_types = ("acache_blockdiff_ssm",)
    architectures = ("SSMBlockDiffusionLM",)
    config_class = SSMConfig

    @classmethod
    def random_config(cls, vocab_size: int, mask_token_id: int, eos_token_id: int, layers: int, hidden_size: int,
                      heads: int, intermediate_size: int | None, block_size: int | None,
                      rope_theta: float | None = None, state_size: int | None = None,
                      conv_kernel: int | None = None, n_groups: int | None = None, kv_heads: int | None = None,
                      max_seq_len: int | None = None) -> SSMConfig:
        """A config at a width: the scan at twice it (Mamba's expansion) in heads of 16 channels, state 16, a
        convolution of 4 taps and one group unless given. ``heads`` and ``rope_theta`` are attention's, which this
        family has not: the scan's heads follow the width, and both are ignored (every family's writer passes
        them); ``kv_heads``, which only a caller sets, is refused."""
        if kv_heads is not None:
            raise ValueError(f"kv_heads shapes attention, which the {cls.family} family has not")
        positions = 65536 if max_seq_len is None else max_seq_len
        return SSMConfig(vocab_size, hidden_size, layers, intermediate_size or 4 * hidden_size,
                         max(1, 2 * hidden_size // 16), 16, state_size or 16, block_size or 32, mask_token_id,
                         eos_token_id, max_position_embeddings=positions, conv_kernel=conv_kernel or 4,
                         n_groups=n_groups or 1)

    def __init__(self, config: SSMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SSMLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def empty_state(self, batch: int = 1) -> list[MixerCache]:
        return [layer.mixer.empty_cache(batch, self.device) for layer in self.layers]

    @staticmethod
    def state_bytes(state: list[MixerCache]) -> int:
        return sum(t.numel() * t.element_size() for layer in state for t in layer)

    # the block-cache interface of engine/state_runner.py: the cache is the state (and the convolution's window)
    def empty_cache(self) -> list[MixerCache]:
        return self.empty_state()

    cache_bytes = state_bytes
    rows_together: ClassVar[bool] = True

    def step_bytes(self, length: int) -> int:
        """What a step adds beside a request's state, at the most: its row of the batch's stacked states, the
        states after the forward, and the request's own copy of them."""
        return 3 * self.cache_bytes_for(length)

    def cache_bytes_for(self, length: int) -> int:
        """The cache's size for a canvas of ``length`` tokens, whatever the length: a float32 state and the
        convolution's window a layer."""
        c = self.config
        window = (c.conv_kernel - 1) * (c.inner_size + 2 * c.n_groups * c.state_size) * self.embed.weight.element_size()
        return c.num_layers * (c.num_heads * c.head_dim * c.state_size * 4 + window)

    def extend_many(self, rows: list[tuple[torch.Tensor, int, list[MixerCache]]], logits: bool = True,
                    cache: bool = True) -> list[tuple[torch.Tensor | None, list[MixerCache] | None]]:
        """Every row in one forward: states stacked, tokens right-padded (padding steps leave a state as it
        is). Each row starts at a block boundary, so the blocks line up whatever its ``start``. Each row's
        cache is its own copy, so a finished request's state frees with it, not with the batch's."""
        if len(rows) == 1:
            row_logits, row_cache = self.extend(*rows[0], logits)
            return [(row_logits, row_cache if cache else None)]
        width = max(len(tokens) for tokens, _, _ in rows)
        device = self.device
        ids = torch.full((len(rows), width), self.config.mask_token_id, dtype=torch.long, device=device)
        valid = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
        for i, (tokens, _, _) in enumerate(rows):
            ids[i, :len(tokens)], valid[i, :len(tokens)] = tokens, True
        states = [tuple(torch.cat(part) for part in zip(*layer, strict=True))
                  for layer in zip(*(cache for _, _, cache in rows), strict=True)]
        out, after = self(ids, states, valid, logits)
        return [(None if out is None else out[i, :len(tokens)],
                 [(s[i:i + 1].clone(), w[i:i + 1].clone()) for s, w in after] if cache else None)
                for i, (tokens, _, _) in enumerate(rows)]

    def extend(self, tokens: torch.Tensor, start: int, cache: list[MixerCache], logits: bool = True
               ) -> tuple[torch.Tensor | None, list[MixerCache]]:
        """Logits ``[T, V]`` of ``tokens [T]`` (whole blocks from position ``start``, where ``cache`` left
        off; None without ``logits``, when only the cache is wanted) and the state after them."""
        out, state = self(tokens[None], cache, logits=logits)
        return None if out is None else out[0], state

    def forward(self, input_ids: torch.Tensor, state: list[MixerCache] | None = None,
                valid: torch.Tensor | None = None, logits: bool = True
                ) -> tuple[torch.Tensor | None, list[MixerCache]]:
        """Logits ``[B, T, V]`` of ``input_ids [B, T]``, whole blocks that start where ``state`` (None: the
        sequence start) left off, and the state after them; ``valid`` marks real tokens (right padding).
        Without ``logits`` the head is skipped (None): advancing a cache over a long prompt needs no logits."""
        if state is None:
            state = self.empty_state(input_ids.shape[0])
        x = self.embed(input_ids)
        out = []
        for layer, s in zip(self.layers, state, strict=True):
            x, s = layer(x, s, valid)
            out.append(s)
        return (self.lm_head(self.norm(x)).float() if logits else None), out

    def train_logits(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Logits of a right-padded training batch whose rows start at position 0."""
        return self(input_ids, None, valid)[0]


#: how a new scan's per-head decays start (``A`` and the step ``dt``, each spread over the heads): ``short``
#: decays over ``[0.5, 8]`` at steps of 0.1 (a memory of a few to a few tens of tokens, what R2LM's in-block
#: sidecar needs); ``long`` Mamba's own ranges, ``A`` over ``[1, 16]`` and ``dt`` log-spaced over
#: ``[0.001, 0.1]``, so that some heads start remembering hundreds of tokens (lookups across a document)
SCAN_INITS: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "short": ((0.5, 8.0), (0.1, 0.1)),
    "long": ((1.0, 16.0), (0.001, 0.1)),
}


def init_scan_model_(model: nn.Module, seed: int, std: float = 0.02, scan_init: str = "short") -> None:
    """Deterministic random weights for a model with selective scans (the state-space variant, R2LM): scan
    decays and steps spread over the heads as ``SCAN_INITS[scan_init]`` says, norms and skips near one."""
    if scan_init not in SCAN_INITS:
        raise ValueError(f"scan_init must be one of {sorted(SCAN_INITS)}, not {scan_init!r}")
    (a_lo, a_hi), (dt_lo, dt_hi) = SCAN_INITS[scan_init]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.linspace(math.log(a_lo), math.log(a_hi), p.numel()))
            elif name.endswith("dt_bias"):  # softplus(dt_bias) = dt, log-spaced like the decays
                dt = torch.linspace(math.log(dt_lo), math.log(dt_hi), p.numel(), dtype=torch.float64).exp()
                p.copy_(torch.log(torch.expm1(dt)))
            elif name.endswith(".D") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("conv1d.weight"):  # Mamba's (PyTorch's) default, uniform over +-1/sqrt(taps): every
                # tap starts carrying its input, so a token can bind to one a few positions back from the first step
                bound = 1.0 / math.sqrt(p.shape[-1])
                p.copy_((2 * torch.rand(p.shape, generator=gen) - 1) * bound)
            elif name.endswith("conv1d.bias"):
                p.zero_()
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
