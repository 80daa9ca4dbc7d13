"""Store vLLM's path for each kernel's region as modeled (beside the measured `baseline_us`), and
the modeled speedup over it, so every row can say how it compares with vLLM, modeled or measured.
Rows written before this revision keep NULL: nothing modeled was stored for them.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("kernels") as batch:
        batch.add_column(sa.Column("baseline_modeled_us", sa.Float, nullable=True))
        batch.add_column(sa.Column("modeled_speedup", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("kernels") as batch:
        batch.drop_column("modeled_speedup")
        batch.drop_column("baseline_modeled_us")
