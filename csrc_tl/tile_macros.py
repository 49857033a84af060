"""TileLang macros shared by several kernel families (no kernels here)."""
import tilelang.language as T


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
