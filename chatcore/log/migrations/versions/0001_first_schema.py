"""Schema version 1: conversations, messages and the chatcore_schema version row.

Logs written before Alembic managed the schema are at this revision: opening one
stamps it as 0001 and runs the later revisions. This file is frozen; later changes
go into new revisions.
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.create_table(
        "chatcore_schema",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
    )
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("created", sa.DateTime, nullable=False),
        sa.Column("updated", sa.DateTime, nullable=False),
        sa.Column("adapter", sa.String(64)),
        sa.Column("channel_key", sa.String(255)),
        sa.Column("model", sa.String(255)),
        sa.Column("title", sa.String(255)),
        sa.Column("meta", sa.JSON, nullable=False),
    )
    op.create_index("ix_conversations_updated", "conversations", ["updated"])
    op.create_index("ix_conversations_created", "conversations", ["created"])
    op.create_index("ix_conversations_channel_updated", "conversations", ["channel_key", "updated"])
    op.create_index("ix_conversations_adapter_updated", "conversations", ["adapter", "updated"])
    op.create_table(
        "messages",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "conversation_id", sa.String(64), sa.ForeignKey("conversations.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("created", sa.DateTime, nullable=False),
        sa.Column("token_count", sa.Integer),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("latency_s", sa.Float),
        sa.Column("first_token_s", sa.Float),
        sa.Column("decoder", sa.JSON),
        sa.Column("steerers", sa.JSON),
        sa.Column("candidates", sa.JSON),
        sa.Column("seed", sa.BigInteger),
        sa.Column("interrupted", sa.Boolean, nullable=False),
        sa.Column("superseded", sa.Boolean, nullable=False),
        sa.Column("provenance", sa.JSON),
    )
    op.create_index("ix_messages_conversation_id", "messages", ["conversation_id", "id"])
    op.create_index("ix_messages_created", "messages", ["created"])
    op.bulk_insert(schema, [{"id": 1, "version": 1}])
