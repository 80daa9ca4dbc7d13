"""Record each warmup run and link the kernels it produced.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "warmup_runs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("model", sa.String(300), nullable=False),
        sa.Column("device_id", sa.Integer, sa.ForeignKey("devices.id", ondelete="SET NULL")),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("summary", sa.JSON, nullable=False),
    )
    with op.batch_alter_table("kernels") as batch:
        batch.add_column(sa.Column("warmup_run_id", sa.Integer, nullable=True))
        batch.create_foreign_key("fk_kernels_warmup_run", "warmup_runs", ["warmup_run_id"], ["id"],
                                 ondelete="SET NULL")


def downgrade() -> None:
    with op.batch_alter_table("kernels") as batch:
        batch.drop_constraint("fk_kernels_warmup_run", type_="foreignkey")
        batch.drop_column("warmup_run_id")
    op.drop_table("warmup_runs")
