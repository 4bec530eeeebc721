"""Every table the tuner keeps in the state database, in one place for the schema's owner (the
composition root's migrations), which may see them only through this package's face."""

from __future__ import annotations

from sqlalchemy import Table

from tuner._change_tables import change_events_table, changes_table, modes_table
from tuner._fleet_tables import jobs_table, sidecars_table
from tuner._versions import versions_table

STATE_TABLES: tuple[Table, ...] = (changes_table, change_events_table, modes_table,
                                   versions_table, sidecars_table, jobs_table)
