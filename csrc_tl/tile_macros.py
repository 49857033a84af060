"""TileLang macros and helpers shared by several kernel families (no kernels here)."""
import tilelang.language as T

LOG2E = 1.4426950408889634


def end_cta():
    """A CUDA ``return`` for every thread of the CTA: call it only under a condition that is
    uniform over the CTA and before any barrier (the threads that stay would wait for the
    ones that left)."""
    from tvm.tirx import op  # TileLang's TVM, importable once tilelang is
    T.evaluate(op.thread_return())


def tf32(x):
    """Round an fp32 value to tf32 (10 explicit mantissa bits, nearest, ties away from 0)."""
    bits = T.reinterpret(x, "uint32")
    return T.reinterpret((bits + T.uint32(0x1000)) & T.uint32(0xFFFFE000), "float32")


def gate_scan_from(C: int, width: int, nseg: int, batch: int, offset: int, zero_row: bool):
    """Macro ``gate_scan(L, tx, G, Tot, run, vals)``: the gates of a chunk's ``width`` columns,
    staged in ``G`` from row ``offset``, turned in place into their inclusive running sums in
    log2 units (gates of rows >= L count 0); with ``zero_row`` row 0 of G is set to 0 (the
    exclusive sum of row 0 when ``offset`` is 1). One thread ``tx`` per (column, row segment):
    ``nseg`` segments of C / nseg rows, thread-indexed so no barrier per row, rows in batches
    of ``batch`` loaded into registers (``vals``) before any store so their loads are in flight
    together; segment totals meet in ``Tot`` [nseg, width]; ``run`` is one fp32 register."""
    SL = C // nseg

    @T.macro
    def gate_scan(L, tx, G, Tot, run, vals):
        col = tx % width
        seg = tx // width
        run[0] = T.float32(0)
        for r0 in T.unroll(0, SL, batch):
            for m in T.unroll(batch):
                row = seg * SL + r0 + m
                vals[m] = T.if_then_else(row < L, G[row + offset, col] * LOG2E, T.float32(0))
            for m in T.unroll(batch):
                run[0] = run[0] + vals[m]
                G[seg * SL + r0 + m + offset, col] = run[0]
        if zero_row:
            if seg == 0:
                G[0, col] = T.float32(0)
        if nseg > 1:
            Tot[seg, col] = run[0]
            T.sync_threads()
            run[0] = T.float32(0)
            for p in T.unroll(nseg - 1):
                if p < seg:
                    run[0] = run[0] + Tot[p, col]
            for r0 in T.unroll(0, SL, batch):
                for m in T.unroll(batch):
                    vals[m] = G[seg * SL + r0 + m + offset, col]
                for m in T.unroll(batch):
                    G[seg * SL + r0 + m + offset, col] = vals[m] + run[0]
        T.sync_threads()

    return gate_scan


# Chunks per CTA of the redo kernels (the exact recompute after a bounded one): a call where
# none broke costs ceil(chunks / 8) CTAs per head that read their totals and exit; a CTA
# recomputes its broken chunks one after another.
REDO_SPAN = 8


def broken_chunks_from(K: int, threads: int, span: int):
    """Macro ``broken_chunks(gl, chunk_len, i_b, c0, S, i_h, bound, flags, slots, count)`` for
    a CTA that covers the ``span`` chunk slots ``c0 ..`` (those below ``S``): ``slots[:count[0]]``
    (shared int32 ``[span]`` and ``[1]``) lists, in order, the non-empty ones where some column
    of the chunk totals ``gl[i_b, c, i_h, :K]`` is below ``bound``.  Every thread issues its
    share of the ``span * K`` loads before testing any, so the CTA waits one load latency for
    all its chunks; ``flags`` (shared int32 ``[span]``) is scratch.  Three barriers; NaN counts
    as not below."""
    per_thread = (span * K + threads - 1) // threads

    @T.macro
    def broken_chunks(gl, chunk_len, i_b, c0, S, i_h, bound, flags, slots, count):
        tx = T.get_thread_binding()
        n = T.alloc_local((1,), "int32")
        for j in T.unroll((span + threads - 1) // threads):
            if tx + j * threads < span:
                flags[tx + j * threads] = 0
        T.sync_threads()
        for j in T.unroll(per_thread):
            e = tx + j * threads
            if e < span * K:
                if c0 + e // K < S:
                    if gl[i_b, c0 + e // K, i_h, e % K] < bound:
                        flags[e // K] = 1  # threads that find one write the same value
        T.sync_threads()
        if tx == 0:
            n[0] = 0
            for s in T.serial(span):
                if flags[s] != 0:
                    if chunk_len[c0 + s] > 0:
                        slots[n[0]] = c0 + s
                        n[0] = n[0] + 1
            count[0] = n[0]
        T.sync_threads()

    return broken_chunks


def zero_rows_from(C: int):
    """Macro ``zero_rows(L, tile)`` for chunks of C rows: in a partial chunk (L < C), zero rows
    L.. of a staged shared tile in place. They hold the next sequence's tokens (copies fetch
    whole chunks); a full chunk skips the pass."""

    @T.macro
    def zero_rows(L, tile):
        if L < C:
            for i, j in T.Parallel(*tile.shape):
                if i >= L:
                    tile[i, j] = T.Cast(tile.dtype, 0)

    return zero_rows


def wgmma_join(threads: int, wgmma: bool = True):
    """Macro ``join(acc, acc2=None)``: wait for the GEMMs issued without waiting (async wgmma;
    with ``wgmma`` False the GEMMs are mma.sync, done when issued, and it does nothing). The
    fences keep nvcc from hoisting reads of the accumulators above the wait."""

    @T.macro
    def join(acc, acc2=None):
        if wgmma:
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc, num_regs=acc.shape[0] * acc.shape[1] // threads)
            if acc2 is not None:
                T.warpgroup_fence_operand(acc2, num_regs=acc2.shape[0] * acc2.shape[1] // threads)

    return join


@T.macro
def split_of(value, hi, lo):
    """hi + lo == value(i, j) to ~2^-17 relative (a bf16 pair); ``value`` an fp32 expression of
    (i, j). The hi/lo terms of the split products (fp32 x fp32 in three GEMMs)."""
    for i, j in T.Parallel(*hi.shape):
        x = value(i, j)
        hi[i, j] = T.Cast(hi.dtype, x)
        lo[i, j] = T.Cast(lo.dtype, x - T.Cast("float32", T.Cast(hi.dtype, x)))


def split(src, hi, lo):
    """:func:`split_of` of a stored fp32 tile."""
    split_of(lambda i, j: src[i, j], hi, lo)


def split_gemms(annotations):
    """Macros ``gemm3(Xh, Xl, Yh, Yl, acc)`` (acc += X Y, both factors split) and
    ``gemm2(Xh, Xl, Y, acc)`` (X split, Y data of the dtype), small terms first, each GEMM
    issued with ``annotations`` (``{"wg_wait": -1}``: without waiting; the caller joins)."""

    @T.macro
    def gemm3(Xh, Xl, Yh, Yl, acc):
        T.gemm(Xl, Yh, acc, annotations=annotations)
        T.gemm(Xh, Yl, acc, annotations=annotations)
        T.gemm(Xh, Yh, acc, annotations=annotations)

    @T.macro
    def gemm2(Xh, Xl, Y, acc):
        T.gemm(Xl, Y, acc, annotations=annotations)
        T.gemm(Xh, Y, acc, annotations=annotations)

    return gemm3, gemm2


def stack_rows(C: int, threads: int) -> int:
    """Rows R of the state backward's stacked [v; v_new; pad] operand: the C x R product
    do·[v; v_new]ᵀ must give every warp whole m16n8 tiles (C = 16 with 8 warps: R = 64 > 2C)."""
    return max(2 * C, 8 * (threads // 32) * 16 // C)
