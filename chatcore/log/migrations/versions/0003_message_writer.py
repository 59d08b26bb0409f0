"""Schema version 3: which chat wrote each message.

``messages.writer``: the id of the log writer (one per running chat or bot process)
that stored the message. A conversation has one writer at a time: a second chat
writing into it (two terminals on one ``--cid``) is found by this column and moved to
a new conversation of its own, and a retried reply supersedes only the replies of its
own writer, never another chat's. Rows from before this revision have none.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("messages", sa.Column("writer", sa.String(32)))
    op.execute(sa.text("UPDATE chatcore_schema SET version = 3"))
