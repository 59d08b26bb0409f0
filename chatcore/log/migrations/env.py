"""Alembic's entry point for the conversation log: migrate the connection it is handed.

:func:`chatcore.log.schema.prepare` opens the transaction, takes
the lock that serialises concurrent first opens, and passes the connection in
``config.attributes["connection"]``; Alembic then runs inside that one transaction,
so a crash at any point leaves either the old schema or the new one, never half.
"""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None)
with context.begin_transaction():
    context.run_migrations()
