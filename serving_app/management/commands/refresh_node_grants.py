"""Give every joined node's database role and Redis user this release's grants.

    .venv/bin/python manage.py refresh_node_grants

A node's role and Redis user get their grants when the node joins
(`serving_app.fleet.credentials`); run this after an upgrade (after `migrate`) so that agents of
nodes joined before it may use what the new release's agent reads and writes. The nodes'
row-level security policies are made again as this release has them
(`serving_app.fleet.rowsecurity`), each role joins their group role; database grants only add,
but for a whole-table read of a table with secret columns, which becomes a read of the other
columns; a Redis user's keys and channels are set to this release's.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand
from django.db import connection

from serving_app.fleet import credentials, rowsecurity
from serving_app.models import Node


class Command(BaseCommand):
    help = "Give every joined node's database role and Redis user this release's grants."

    def handle(self, *args: Any, **options: Any) -> None:
        rowsecurity.apply(connection)
        nodes = Node.objects.exclude(db_role="", redis_user="")
        for node in nodes:
            credentials.grant_again(node)
            self.stdout.write(f"{node.name}: {node.db_role or '-'}, {node.redis_user or '-'}")
        self.stdout.write(f"{len(nodes)} node(s) given this release's grants.")
