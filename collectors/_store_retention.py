"""What the store keeps and for how long: raw chunks ``raw_retention_s`` (default 2 days),
1-minute rollups 30 days, 1-hour rollups a year. Ages are measured against the wall clock;
a retention of ``None`` keeps data forever."""

from __future__ import annotations

from collectors._store_file import StoreFile, transaction
from collectors._store_rollups import NS, ROLLUP_BLOCK_NS


def delete_expired(file: StoreFile, now_ns: int) -> dict[int, int]:
    """Delete, in one transaction, what is past its retention at ``now_ns``, then give the
    freed pages back to the file system. The caller holds the file's lock and has folded the
    rollup journal, so no bucket of an expired block waits there.

    Returns, by step (0 for raw chunks), the start from which no block lost a piece: a block
    starting earlier may have (raw chunks expire one by one)."""
    cfg = file.config
    conn = file.conn
    untouched = {step: -(2**63) for step in (0, *ROLLUP_BLOCK_NS)}
    if cfg.raw_retention_s is not None:
        untouched[0] = now_ns - int(cfg.raw_retention_s * NS)
    for step_s, keep_s in ((60, cfg.rollup_1m_retention_s), (3600, cfg.rollup_1h_retention_s)):
        if keep_s is not None:
            untouched[step_s] = now_ns - int(keep_s * NS) - ROLLUP_BLOCK_NS[step_s] + 1

    def attempt() -> None:
        with transaction(conn):
            if cfg.raw_retention_s is not None:
                conn.execute("DELETE FROM chunks WHERE t_max < ?",
                             (now_ns - int(cfg.raw_retention_s * NS),))
            for step_s, keep_s in ((60, cfg.rollup_1m_retention_s),
                                   (3600, cfg.rollup_1h_retention_s)):
                if keep_s is not None:
                    conn.execute("DELETE FROM rollups WHERE step_s = ? AND block_ns + ? <= ?",
                                 (step_s, ROLLUP_BLOCK_NS[step_s], now_ns - int(keep_s * NS)))
            conn.execute("DELETE FROM times WHERE id NOT IN (SELECT times_id FROM chunks)")
        conn.execute("PRAGMA incremental_vacuum")

    file.retry(attempt)
    return untouched
