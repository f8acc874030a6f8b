"""Backups of the console's database: scheduled dumps, their records, and the restore."""
