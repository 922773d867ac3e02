"""Numerics shared by draftlab's own forward passes (the fast backend, feature drafts).

Written once so that every module computes them the same way, bit for bit. This is also the one place that owns
row invariance (a row scored in a block of any size rounds as the row scored alone), op by op:
- products: `invariant_linear`, every product on exactly R rows (the route's R, timed per host);
- norms: `invariant_rms_norm`, every reduction on exactly R rows too (the route's R);
- attention: one SDPA call per row (`attention.RowAttention`; the static step's `attention.MaskedAttention`) on a
  contiguous copy of the row (`attention_row`)
  over exactly the keys it sees, a view of the cache for chains and plain decoding alike;
- rope, residual adds, SiLU, embedding: elementwise or gathers, row-invariant as they are.
`draftlab.checks.exactness` checks each of them on a device, per model shape (`draftlab check exact`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftlab.errors import DraftlabError

INVARIANT_ROWS = 16  # the row chunk of exact products on CUDA (no host timing there yet)
NORM_ROWS = 16  # `invariant_rms_norm`'s default chunk (a backend passes its route's R)
WEIGHT_MAJOR_MAX_ROWS = 64  # above this many rows (a long prefill) the GEMM that F.linear calls is as fast or faster
UPCAST_MIN_ROWS = 6  # emulated bf16/fp16: from this many rows on, converting the weight to fp32 first is faster
UPCAST_CHUNK = 1 << 24  # weight elements converted at a time (64 MB of fp32 scratch)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm as transformers computes it: normalised in fp32, cast back, then scaled."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * normed


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rows: int = NORM_ROWS) -> torch.Tensor:
    """`rms_norm` on [n, D] whose every row is bitwise independent of n and of the other rows.

    A reduction kernel picks its configuration (how a row's sum is split and in which order it is added) from the
    shape it reduces: on CUDA, a row of a 7-row block and the same row alone were summed differently (fp32, hidden
    1536). Here every reduction sees exactly `rows` rows, zero padded (an all-zero row normalises to zero and
    touches no other row), so the configuration, and with it each row's rounding, is the same alone or in a block.
    """
    n = x.shape[0]
    padded = F.pad(x, (0, 0, 0, (-n) % rows))  # [ceil(n / rows) * rows, D]
    return torch.cat([rms_norm(chunk, weight, eps) for chunk in padded.split(rows)])[:n]  # [n, D]


def attention_row(query: torch.Tensor) -> torch.Tensor:
    """One query row [H, 1, hd] as every path gives it to attention: a fresh contiguous copy. Sliced from a block's
    [H, n, hd] it is a strided view, and CUDA's SDPA rounded such a view apart from the same row contiguous (bf16,
    head 128); a copy gives plain decoding, chains and trees one memory layout."""
    return query.clone(memory_format=torch.contiguous_format)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half) on [..., n, hd] with cos/sin [n, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def causal_mask(start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Boolean [n, start+n]: query i sees keys 0..start+i. None for a single token (it sees all)."""
    if n == 1:
        return None
    return torch.ones(n, start + n, dtype=torch.bool, device=device).tril(diagonal=start)


def tree_mask(start: int, ancestors: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [n, start+n]: every cached key, plus each block token's ancestors and itself."""
    n = ancestors.shape[0]
    return torch.cat([torch.ones(n, start, dtype=torch.bool), ancestors], dim=1).to(device)


def scatter_vocab(probs: torch.Tensor, vocab_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Probabilities over a cut vocabulary [V'] placed at their target ids in a [V] vector."""
    return torch.zeros(vocab_size, dtype=probs.dtype).index_copy_(0, vocab_map, probs)


def cut_head(weight: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """An LM head [V, D] kept whole (rows None) or cut to `rows` [V'] as a new contiguous [V', D] tensor."""
    if rows is None:
        return weight
    return weight.detach()[checked_rows(rows, weight.shape[0]).to(weight.device)].contiguous()


def checked_rows(rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`rows` [V'] as CPU long ids, refused unless every id is in 0..vocab_size-1."""
    rows = rows.to(torch.long).cpu()
    if rows.ndim != 1 or len(rows) == 0 or int(rows.min()) < 0 or int(rows.max()) >= vocab_size:
        raise DraftlabError(f"head rows must be a non-empty list of ids in 0..{vocab_size - 1}")
    return rows


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = INVARIANT_ROWS,
    weight_major: bool = False,
) -> torch.Tensor:
    """`F.linear` on [n, D] whose every output row is bitwise independent of n and of the other rows.

    GEMM kernels pick their blocking (and so their rounding) from the shape: a
    1-row product (a GEMV) and row j of an 8-row product differ in the last bits.
    Here every product sees exactly `rows` rows, zero padded, so a token's row is
    computed the same way alone or inside a block, whatever `rows` is; which
    `rows` is fastest depends on the host (`draftlab.backends.routes` times
    them). `weight_major`: each chunk runs as weight [out, D] @ chunk^T, the form
    in which fp32 CPU kernels stream the weight once for a few rows.
    """
    n = x.shape[0]
    padded = x.new_zeros(-(-n // rows) * rows, x.shape[1])  # [ceil(n / R) R, D] row-major
    padded[:n] = x
    out = torch.cat([chunk_linear(chunk, weight, None, weight_major) for chunk in padded.split(rows)])[:n]  # [n, out]
    return out if bias is None else out + bias


def chunk_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_major: bool = False
                 ) -> torch.Tensor:
    """One chunk of `invariant_linear`: x [R, D], exactly its R rows, contiguous (`weight_major`: as weight @ x^T);
    the bias added apart (a GEMM's fused bias rounds otherwise). A block of R rows runs it directly."""
    out = torch.mm(weight, x.t()).t() if weight_major else F.linear(x, weight)  # [R, out]
    return out if bias is None else out + bias


def weight_major_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` on [n, D], taken as weight [out, D] @ x^T [D, n] for blocks of 2..64 rows.

    On CPUs in fp32 the GEMM that `F.linear` calls for a few rows costs about one
    single-row product per row (its small-M path; on 2 AVX2 cores a 4-row block
    of Qwen2.5-1.5B's MLP costs about 3x one row). The same product with the weight
    as the left operand streams the weight once, so 2-4 rows cost about one row
    (`benchmarks/backend_limits.py` prints both curves). A single row stays
    `F.linear` (a GEMV: each step of plain decoding computes what it did) and so
    does a prefill of more than 64 tokens, where the GEMM's own blocking is as
    fast; shorter prompts are prefilled weight-major. Rows agree with `F.linear`
    to rounding, not bitwise.
    """
    n = x.shape[0]
    if n == 1 or n > WEIGHT_MAJOR_MAX_ROWS:
        return F.linear(x, weight, bias)
    rows = n + 1 if n % 4 == 3 else n  # 3 rows cost more than 4 (and 7 than 8, 15 than 16): pad with a zero row
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])]) if rows > n else x.contiguous()  # [rows, D] row-major
    out = torch.mm(weight, padded.t())[:, :n].t().contiguous()  # [n, out]; x column-major makes the kernel 3x slower
    return out if bias is None else out + bias


class UpcastLinear:
    """`F.linear` for bf16/fp16 weights on a CPU that emulates them: short blocks as they are, longer ones in fp32.

    Without native bf16 (AVX-512 BF16, AMX) a bf16 product costs about one single-row
    product per row, yet a single row reads half the bytes of fp32 and runs ~2x faster.
    From `UPCAST_MIN_ROWS` rows on (a prompt's prefill, a tree) the weight is copied
    into a reused fp32 scratch buffer, `UPCAST_CHUNK` elements at a time, and the rows
    run as one fp32 block product (`weight_major_linear`); a 118-token prefill of
    Qwen2.5-0.5B's MLP then costs ~4x less. Rows differ from the bf16 product in the
    last bits, so only drafts use it (their rounding never reaches the output).
    """

    def __init__(self) -> None:
        self._scratch = torch.empty(0)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] < UPCAST_MIN_ROWS:
            return F.linear(x, weight, bias)
        x32 = x.float()  # [n, D]
        rows = max(1, UPCAST_CHUNK // weight.shape[1])
        parts = [weight_major_linear(x32, self._fp32(chunk)) for chunk in weight.split(rows)]  # [n, out_chunk] each
        out = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [n, out]
        return (out if bias is None else out + bias.float()).to(x.dtype)

    def _fp32(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` copied into the scratch buffer as fp32 (valid until the next call)."""
        if self._scratch.numel() < weight.numel():
            self._scratch = torch.empty(weight.numel(), dtype=torch.float32, device=weight.device)
        return self._scratch[: weight.numel()].view(weight.shape).copy_(weight)
