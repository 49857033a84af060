"""The chunk-local math of one tile of ``BT`` rows (one head), shared by the forward and the
backward kernel: the backward recomputes everything here from the inputs and the tile's start
state instead of reading it back from HBM.

Per tile (rows ``r < L`` hold tokens, rows past the sequence end load as zeros and their gates
as 0, which makes them exact no-ops), in log2 units ``g = log2(e) · gk``::

    G  = inclusive cumsum of g      Ge = G - g (exclusive)      Gl = G of the last row
    qg = scale q 2^G    ag = a 2^Ge    kg = k 2^(Gl - G)    bg = b 2^(Gl - G)
    A_qk[i, j] = scale Σ_k q_ik k_jk 2^(G_ik - G_jk)   (i >= j)     A_qb: b for k
    A_ak[i, j] =       Σ_k a_ik k_jk 2^(Ge_ik - G_jk)  (i >  j)     A_ab: b for k
    Ainv = (I - A_ab)^-1    w = Ainv ag    u = Ainv A_ak v
    v_new = u + w h    o = qg h + A_qk v + A_qb v_new    h' = 2^Gl h + kgᵀ v + bgᵀ v_new

The four ``A`` matrices come from tensor-core products of centred operands
(``q 2^(G - c)`` times ``k 2^(c - G)``, ``c`` the gates' running sum at the middle row) when
every such factor stays inside fp32's range (:data:`CENTRED_LIMIT`), which each tile checks on
its own gates; otherwise from exact pairwise exponents (``2^(G_i - G_j)``, never above 1), one
column at a time.  A gate far below a declared bound therefore costs time, never accuracy.

Rounding points are those of the staged pipeline (``torch_dplr.reference``): ``A_qk``,
``A_qb``, ``qg``, ``kg``, ``ag``, ``bg``, ``w`` and ``u`` in the data dtype, ``A_ak``,
``A_ab`` and the inverse in fp32; products with the fp32 state and ``v_new`` take them as a
hi/lo pair of the data dtype (two products), so the state stays fp32-accurate.
"""
import triton
import triton.language as tl

from ._common import dot, dot_fp32, round_to

LOG2E = tl.constexpr(1.4426950408889634)
# Kernel schemes: centred products only (tiles that need more are counted per program);
# exact, for the programs flagged by a FAST pass; exact, for every program.
FAST = tl.constexpr(0)
EXACT_FLAGGED = tl.constexpr(1)
EXACT_ALL = tl.constexpr(2)
# Largest exponent (log2) a centred operand factor may take: 2^100 times an input stays far
# inside fp32 (and tf32), and 2^-100 far above its smallest normal.
CENTRED_LIMIT = tl.constexpr(100.0)


@triton.jit
def tile_rows(bos, eos, t, BT: tl.constexpr, REVERSE: tl.constexpr):
    """Tokens of tile ``t`` of the sequence ``[bos, eos)`` walked forward (or from its end)
    and which rows hold one."""
    pos = t * BT + tl.arange(0, BT)
    valid = pos < eos - bos
    if REVERSE:
        tok = eos - 1 - pos
    else:
        tok = bos + pos
    return tok, valid


@triton.jit
def tile_at(bos, eos, t, BT: tl.constexpr):
    """Tile ``t`` of the sequence ``[bos, eos)`` walked forward: its first token (int64), its
    rows relative to that token (int32) and which rows hold one.  Loads through pointers
    advanced to the first token (``x + first · H · D``) keep every per-element offset in int32:
    an int64 offset tile costs two registers an element."""
    rows = tl.arange(0, BT)
    first = bos + t * BT
    return first, rows, rows < eos - first


@triton.jit
def chunk_tile_rows(start, length, t, BT: tl.constexpr):
    """Tokens of tile ``t`` of a chunk of ``length`` rows from token ``start``, and which rows
    hold one."""
    rows = tl.arange(0, BT)
    return start.to(tl.int64) + t * BT + rows, rows < length - t * BT


@triton.jit
def sequence_of(cu_seqlens, chunk_offsets, i_n):
    """(first token, end, first chunk slot) of sequence ``i_n``, as int64."""
    return (tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64),
            tl.load(chunk_offsets + i_n).to(tl.int64))


@triton.jit
def first_column(i_v, BV: tl.constexpr, V: tl.constexpr):
    """The first value column of block ``i_v``: a literal 0 when one block holds all of V, so
    that every column offset is static (a dynamic one costs the 64-row walk half its
    registers in spills)."""
    if BV == V:
        return 0
    else:
        return i_v * BV


@triton.jit
def walk_start(h0, i_n, i_h, H, K: tl.constexpr, V: tl.constexpr, v0, BV: tl.constexpr,
               USE_H0: tl.constexpr):
    """A walk's state columns ``[v0, v0 + BV)`` of (sequence ``i_n``, head ``i_h``): their
    offsets in a ``[K, V]`` state, the pair's state offset, and the start state (``h0``'s,
    or zeros)."""
    state_offsets = tl.arange(0, K)[:, None] * V + v0 + tl.arange(0, BV)[None, :]
    seq_state = (i_n * H + i_h) * K * V
    if USE_H0:
        h = tl.load(h0 + seq_state + state_offsets)
    else:
        h = tl.zeros([K, BV], dtype=tl.float32)
    return state_offsets, seq_state, h


@triton.jit
def keep_chunk_state(h_out, h, t, slot0, i_h, H, K: tl.constexpr, V: tl.constexpr,
                     state_offsets, TILES_PER_CHUNK: tl.constexpr):
    """Store ``h`` as the state of its chunk slot when tile ``t`` starts a chunk."""
    if t % TILES_PER_CHUNK == 0:
        slot = slot0 + t // TILES_PER_CHUNK
        tl.store(h_out + (slot * H + i_h) * K * V + state_offsets, h)


@triton.jit
def load_stored(x, tok, valid, i_h, H, D: tl.constexpr, d0, BD: tl.constexpr):
    """Columns ``[d0, d0 + BD)`` of a ``[1, T, H, D]`` tensor at a tile's tokens, ``[BT, BD]``
    in the tensor's dtype (rows past the end: 0): a product's operand, loaded without a round
    trip through fp32 registers."""
    offsets = (tok[:, None] * H + i_h) * D + d0 + tl.arange(0, BD)[None, :]
    return tl.load(x + offsets, mask=valid[:, None], other=0.0)


@triton.jit
def load_rows(x, tok, valid, i_h, H, D: tl.constexpr, d0, BD: tl.constexpr):
    """:func:`load_stored` as fp32."""
    return load_stored(x, tok, valid, i_h, H, D, d0, BD).to(tl.float32)


@triton.jit
def load_tile(q, k, v, a, b, gk, tok, valid, i_h, H, K: tl.constexpr, V: tl.constexpr,
              v0, BV: tl.constexpr):
    """A tile's q, k, a, b, log2 gates ``[BT, K]`` and value columns ``[v0, v0 + BV)`` of v
    ``[BT, BV]``, as fp32 (rows past the end: 0)."""
    return (load_rows(q, tok, valid, i_h, H, K, 0, K), load_rows(k, tok, valid, i_h, H, K, 0, K),
            load_rows(a, tok, valid, i_h, H, K, 0, K), load_rows(b, tok, valid, i_h, H, K, 0, K),
            load_rows(gk, tok, valid, i_h, H, K, 0, K) * LOG2E,
            load_rows(v, tok, valid, i_h, H, V, v0, BV))


@triton.jit
def row_of(x, rows, i):
    """Row ``i`` of a ``[R, D]`` tile as a ``[D]`` vector."""
    return tl.sum(tl.where(rows[:, None] == i, x, 0.0), axis=0)


@triton.jit
def col_of(x, cols, j):
    """Column ``j`` of a ``[R, D]`` tile as an ``[R]`` vector."""
    return tl.sum(tl.where(cols[None, :] == j, x, 0.0), axis=1)


@triton.jit
def split_hi_lo(x, dtype: tl.constexpr, SPLIT: tl.constexpr = True):
    """``x ≈ hi + lo`` as two tiles of ``dtype`` (an fp32 value to about 2^-16 relative);
    without ``SPLIT`` only ``hi`` (returned twice: :func:`dot2` then reads it once)."""
    hi = round_to(x, dtype)
    if SPLIT:
        return hi, round_to(x - hi.to(tl.float32), dtype)
    else:
        return hi, hi


@triton.jit
def dot2(x, y_hi, y_lo, acc, SPLIT: tl.constexpr = True):
    """``acc + x (y_hi + y_lo)``: a product with a split fp32 right factor (without
    ``SPLIT``: ``acc + x y_hi``, the factor rounded once to the data dtype)."""
    if SPLIT:
        return dot(x, y_lo, dot(x, y_hi, acc))
    else:
        return dot(x, y_hi, acc)


@triton.jit
def gate_sums(g, BT: tl.constexpr):
    """Running sums of a tile's log2 gates ``g [BT, K]``: (G, Ge, Gl, centre)."""
    rows = tl.arange(0, BT)
    G = tl.cumsum(g, axis=0)
    Ge = G - g
    Gl = tl.sum(g, axis=0)
    centre = row_of(G, rows, BT // 2 - 1)
    return G, Ge, Gl, centre


@triton.jit
def centred_fits(Gl, centre):
    """Whether every centred factor's exponent stays within :data:`CENTRED_LIMIT`: the largest
    are ``2^-c`` (``a`` of the first row) and ``2^(c - Gl)`` (``k``, ``b`` of the last)."""
    largest = tl.maximum(tl.max(-centre, axis=0), tl.max(centre - Gl, axis=0))
    return largest <= CENTRED_LIMIT


@triton.jit
def centred_operands(q, k, a, b, G, Ge, centre):
    """``q 2^(G-c)``, ``k 2^(c-G)``, ``b 2^(c-G)``, ``a 2^(Ge-c)`` (fp32)."""
    c = centre[None, :]
    down = tl.exp2(c - G)
    return q * tl.exp2(G - c), k * down, b * down, a * tl.exp2(Ge - c)


@triton.jit
def intra_centred(q, k, a, b, G, Ge, centre, scale, BT: tl.constexpr):
    """(A_qk, A_qb, A_ak, A_ab), fp32 and masked, from products of centred operands."""
    rows = tl.arange(0, BT)
    incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    Qc, Kc, Bc, Ac = centred_operands(q, k, a, b, G, Ge, centre)
    zero = tl.zeros([BT, BT], dtype=tl.float32)
    A_qk = tl.where(incl, dot(Qc, tl.trans(Kc), zero) * scale, 0.0)
    A_qb = tl.where(incl, dot(Qc, tl.trans(Bc), zero) * scale, 0.0)
    A_ak = tl.where(strict, dot(Ac, tl.trans(Kc), zero), 0.0)
    A_ab = tl.where(strict, dot(Ac, tl.trans(Bc), zero), 0.0)
    return A_qk, A_qb, A_ak, A_ab


@triton.jit
def key_row_factors(k, b, G, Ge, rows, j):
    """Key row ``j``'s k and b ``[1, K]`` and its exact decays to every query row:
    ``2^(G_i - G_j)`` for rows ``i >= j`` and ``2^(Ge_i - G_j)`` for ``i > j`` (0 elsewhere,
    so no exponent above 0 is ever taken)."""
    Gj = row_of(G, rows, j)[None, :]
    e_incl = tl.exp2(tl.where(rows[:, None] >= j, G - Gj, float("-inf")))
    e_strict = tl.exp2(tl.where(rows[:, None] > j, Ge - Gj, float("-inf")))
    return row_of(k, rows, j)[None, :], row_of(b, rows, j)[None, :], e_incl, e_strict


@triton.jit
def intra_pairwise(q, k, a, b, G, Ge, scale, BT: tl.constexpr):
    """(A_qk, A_qb, A_ak, A_ab) with exact pairwise exponents (all <= 0), column by column."""
    rows = tl.arange(0, BT)
    A_qk = tl.zeros([BT, BT], dtype=tl.float32)
    A_qb = tl.zeros([BT, BT], dtype=tl.float32)
    A_ak = tl.zeros([BT, BT], dtype=tl.float32)
    A_ab = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(BT):
        kj, bj, e_incl, e_strict = key_row_factors(k, b, G, Ge, rows, j)
        column = rows[None, :] == j
        A_qk = tl.where(column, (tl.sum(q * kj * e_incl, axis=1) * scale)[:, None], A_qk)
        A_qb = tl.where(column, (tl.sum(q * bj * e_incl, axis=1) * scale)[:, None], A_qb)
        A_ak = tl.where(column, tl.sum(a * kj * e_strict, axis=1)[:, None], A_ak)
        A_ab = tl.where(column, tl.sum(a * bj * e_strict, axis=1)[:, None], A_ab)
    return A_qk, A_qb, A_ak, A_ab


@triton.jit
def intra(q, k, a, b, G, Ge, Gl, centre, scale, EXACT: tl.constexpr, BT: tl.constexpr):
    """The tile's four A matrices (fp32, masked): centred products, or with ``EXACT`` the
    scheme its gates allow (the pairwise code costs registers, so the fast kernel leaves it
    out and only reports the tiles that need it)."""
    if EXACT:
        if centred_fits(Gl, centre):
            A_qk, A_qb, A_ak, A_ab = intra_centred(q, k, a, b, G, Ge, centre, scale, BT)
        else:
            A_qk, A_qb, A_ak, A_ab = intra_pairwise(q, k, a, b, G, Ge, scale, BT)
    else:
        A_qk, A_qb, A_ak, A_ab = intra_centred(q, k, a, b, G, Ge, centre, scale, BT)
    return A_qk, A_qb, A_ak, A_ab


@triton.jit
def unit_lower_inverse(N, BT: tl.constexpr):
    """``(I - N)^-1`` for a strictly lower ``N [BT, BT]`` (fp32, BT = 16): ``N^16 = 0``, so it is
    ``(I + N)(I + N^2)(I + N^4)(I + N^8)``, six small fp32 products (a row-by-row substitution
    costs a cross-warp reduction per row)."""
    tl.static_assert(BT == 16)
    rows = tl.arange(0, BT)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    zero = tl.zeros([BT, BT], dtype=tl.float32)
    X = eye + N
    P = dot_fp32(N, N, zero)
    X = dot_fp32(X, P, X)
    P = dot_fp32(P, P, zero)
    X = dot_fp32(X, P, X)
    P = dot_fp32(P, P, zero)
    return dot_fp32(X, P, X)


@triton.jit
def gated_operands(q, k, b, G, Gl, scale, dtype: tl.constexpr):
    """``qg``, ``kg``, ``bg`` of a tile in ``dtype``: the state step's operands (the state
    sweep forms them from q, k, b and the gates rather than reading them back)."""
    to_end = tl.exp2(Gl[None, :] - G)
    return (round_to(q * tl.exp2(G) * scale, dtype), round_to(k * to_end, dtype),
            round_to(b * to_end, dtype))


@triton.jit
def tile_forward_terms(q, k, a, b, v, g, scale, dtype: tl.constexpr, EXACT: tl.constexpr,
                       BT: tl.constexpr):
    """Everything of a tile that does not depend on its start state, rounded as staged:
    (qg, kg, bg, w, u, A_qk, A_qb in ``dtype``; Gl; plus Ainv, A_ak, ag, G, Ge, centre in fp32
    for the backward)."""
    G, Ge, Gl, centre = gate_sums(g, BT)
    A_qk, A_qb, A_ak, A_ab = intra(q, k, a, b, G, Ge, Gl, centre, scale, EXACT, BT)
    Ainv = unit_lower_inverse(A_ab, BT)
    qg, kg, bg = gated_operands(q, k, b, G, Gl, scale, dtype)
    ag = a * tl.exp2(Ge)
    zero_k = tl.zeros_like(q)
    zero_v = tl.zeros_like(v)
    w = round_to(dot(Ainv, round_to(ag, dtype).to(tl.float32), zero_k), dtype)
    u = round_to(dot(Ainv, dot(A_ak, v, zero_v), zero_v), dtype)
    return (qg, kg, bg, w, u, round_to(A_qk, dtype), round_to(A_qb, dtype), Gl,
            Ainv, A_ak, A_ab, ag, G, Ge, centre)


@triton.jit
def tile_state_step(h, qg, kg, bg, w, u, A_qk, A_qb, Gl, v, valid, dtype: tl.constexpr,
                    SPLIT: tl.constexpr = True):
    """(o, v_new, h') of a tile from its start state ``h`` (fp32 ``[K, V]``); ``SPLIT``
    takes ``h`` and ``v_new`` into products as hi/lo pairs (the state stays fp32-accurate),
    otherwise rounded once to the data dtype (half the products; the state still accumulates
    in fp32)."""
    h_hi, h_lo = split_hi_lo(h, dtype, SPLIT)
    v_new = tl.where(valid[:, None], dot2(w, h_hi, h_lo, u.to(tl.float32), SPLIT), 0.0)
    vn_hi, vn_lo = split_hi_lo(v_new, dtype, SPLIT)
    o = dot2(qg, h_hi, h_lo, tl.zeros_like(v_new), SPLIT)
    o = dot(A_qk, v.to(dtype), o)
    o = dot2(A_qb, vn_hi, vn_lo, o, SPLIT)
    h_next = h * tl.exp2(Gl)[:, None]
    h_next = dot(tl.trans(kg), v.to(dtype), h_next)
    h_next = dot2(tl.trans(bg), vn_hi, vn_lo, h_next, SPLIT)
    return o, v_new, h_next


@triton.jit
def tile_forward_step(q, k, v, a, b, gk, tok, valid, i_h, H, K: tl.constexpr,
                      V: tl.constexpr, h, scale, dtype: tl.constexpr, EXACT: tl.constexpr,
                      BT: tl.constexpr, SPLIT: tl.constexpr):
    """The state leaving a tile (all V columns) from the state ``h`` entering it, the tile's
    terms recomputed from its inputs: the backward's recompute of a state it did not keep."""
    q_t, k_t, a_t, b_t, g_t, v_t = load_tile(q, k, v, a, b, gk, tok, valid, i_h, H, K, V, 0, V)
    (qg, kg, bg, w, u, A_qk, A_qb, Gl, _Ainv, _A_ak, _A_ab, _ag, _G, _Ge,
     _centre) = tile_forward_terms(q_t, k_t, a_t, b_t, v_t, g_t, scale, dtype, EXACT, BT)
    _o, _vn, h = tile_state_step(h, qg, kg, bg, w, u, A_qk, A_qb, Gl, v_t, valid, dtype, SPLIT)
    return h
