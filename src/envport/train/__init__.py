"""Token-exact training rows from traces, their advantages, and their export.

See :mod:`envport.train.rows` for how rows are built and every label a split or a
drop can carry, :mod:`envport.train.advantages` for group-relative advantages and
:mod:`envport.train.export` for the JSONL / Parquet shapes.
"""

from envport.train.advantages import assign_advantages, row_advantages
from envport.train.export import (
    art_trajectory,
    art_trajectory_groups,
    read_rows_jsonl,
    read_rows_parquet,
    to_record,
    write_art_jsonl,
    write_rows_jsonl,
    write_rows_parquet,
)
from envport.train.rows import (
    DROP_REASONS,
    SPLIT_REASONS,
    Decoder,
    RowsResult,
    TrainingRow,
    build_all,
    build_rows,
    summarise,
    summary_table,
)

__all__ = [
    "DROP_REASONS",
    "SPLIT_REASONS",
    "Decoder",
    "RowsResult",
    "TrainingRow",
    "art_trajectory",
    "art_trajectory_groups",
    "assign_advantages",
    "build_all",
    "build_rows",
    "read_rows_jsonl",
    "read_rows_parquet",
    "row_advantages",
    "summarise",
    "summary_table",
    "to_record",
    "write_art_jsonl",
    "write_rows_jsonl",
    "write_rows_parquet",
]
