"""Rotary embedding applied to q and k in place, in Triton. Same signature as
kernels/rotary.py::apply_rotary_.

Legend: T tokens, N query heads, K key heads, H head dim (even), H2 = H / 2.
Neox layout: element i pairs with i + H2. One program rotates all heads of q and k for BLOCK_T
tokens. The products are rounded to the tensors' dtype before they are summed, as the reference
computes q * cos + rotate_half(q) * sin in that dtype.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(ptr, cos_ptr, sin_ptr, rows, T, stride_t, stride_n, stride_c, NUM_HEADS, H2,
            BLOCK_H2: tl.constexpr, BLOCK_NH: tl.constexpr):
    # (head, half-dim) flattened into one axis, so one tile covers every head of a token.
    idx = tl.arange(0, BLOCK_NH)
    head, col = idx // BLOCK_H2, idx % BLOCK_H2
    mask = (rows[:, None] < T) & (head[None, :] < NUM_HEADS) & (col[None, :] < H2)
    cs = rows[:, None] * stride_c + col[None, :]
    c1 = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + H2, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + H2, mask=mask, other=0.0).to(tl.float32)
    base = ptr + rows[:, None] * stride_t + head[None, :] * stride_n + col[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + H2, mask=mask, other=0.0).to(tl.float32)
    ty = ptr.dtype.element_ty
    y1 = (x1 * c1).to(ty).to(tl.float32) - (x2 * s1).to(ty).to(tl.float32)
    y2 = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
    tl.store(base, y1.to(ty), mask=mask)
    tl.store(base + H2, y2.to(ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, T, N, K, H2, stride_qt, stride_qn, stride_kt, stride_kn, stride_c,
                   BLOCK_T: tl.constexpr, BLOCK_H2: tl.constexpr, BLOCK_NQ: tl.constexpr, BLOCK_NK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _rotate(q_ptr, cos_ptr, sin_ptr, rows, T, stride_qt, stride_qn, stride_c, N, H2, BLOCK_H2, BLOCK_NQ)
    _rotate(k_ptr, cos_ptr, sin_ptr, rows, T, stride_kt, stride_kn, stride_c, K, H2, BLOCK_H2, BLOCK_NK)


def apply_rotary_(q_TNH: torch.Tensor, k_TKH: torch.Tensor, cos_TH: torch.Tensor,
                  sin_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, N, H) and k (T, K, H) in place by cos/sin (T, H) (q's dtype). Returns (q, k).

    q and k may be strided views (e.g. slices of a fused qkv projection) as long as the head dim is
    contiguous.
    """
    T, N, H = q_TNH.shape
    K = k_TKH.shape[1]
    if k_TKH.shape != (T, K, H) or cos_TH.shape != (T, H) or sin_TH.shape != (T, H) or H % 2:
        raise ValueError(f"apply_rotary_: shapes q {tuple(q_TNH.shape)}, k {tuple(k_TKH.shape)}, "
                         f"cos {tuple(cos_TH.shape)}, sin {tuple(sin_TH.shape)} do not match (T, N|K, H even)")
    if q_TNH.stride(-1) != 1 or k_TKH.stride(-1) != 1:
        raise ValueError("apply_rotary_: q and k need a contiguous head dimension")
    if T == 0:
        return q_TNH, k_TKH
    cos_TH, sin_TH = cos_TH.contiguous(), sin_TH.contiguous()
    H2 = H // 2
    BLOCK_H2 = triton.next_power_of_2(H2)
    BLOCK_NQ = triton.next_power_of_2(N) * BLOCK_H2
    BLOCK_NK = triton.next_power_of_2(K) * BLOCK_H2
    BLOCK_T = max(1, min(8, 8192 // BLOCK_NQ, triton.next_power_of_2(T)))
    _rotary_kernel[(triton.cdiv(T, BLOCK_T),)](
        q_TNH, k_TKH, cos_TH, sin_TH, T, N, K, H2, q_TNH.stride(0), q_TNH.stride(1), k_TKH.stride(0),
        k_TKH.stride(1), cos_TH.stride(0), BLOCK_T=BLOCK_T, BLOCK_H2=BLOCK_H2, BLOCK_NQ=BLOCK_NQ, BLOCK_NK=BLOCK_NK)
    return q_TNH, k_TKH
