"""Initial schema: devices, programs and their sources, sGraphs, kernels.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "devices",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("fingerprint", sa.String(200), nullable=False, unique=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("compute_capability", sa.String(16)),
        sa.Column("sm_count", sa.Integer),
        sa.Column("memory_bytes", sa.BigInteger),
    )
    op.create_table(
        "programs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("ir_json", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "program_sources",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("program_id", sa.Integer, sa.ForeignKey("programs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("model", sa.String(300), nullable=False),
        sa.Column("layer_path", sa.String(300), nullable=False),
        sa.UniqueConstraint("program_id", "model", "layer_path", name="uq_program_source"),
    )
    op.create_table(
        "sgraphs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.Column("program_id", sa.Integer, sa.ForeignKey("programs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("sgraph_json", sa.Text, nullable=False),
        sa.Column("proof", sa.JSON, nullable=False),
        sa.Column("tests", sa.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_sgraphs_program_id", "sgraphs", ["program_id"])
    op.create_table(
        "kernels",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("program_id", sa.Integer, sa.ForeignKey("programs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("sgraph_id", sa.Integer, sa.ForeignKey("sgraphs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("device_id", sa.Integer, sa.ForeignKey("devices.id", ondelete="CASCADE"), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("bucket_lo", sa.Integer, nullable=False),
        sa.Column("bucket_hi", sa.Integer, nullable=False),
        sa.Column("params_json", sa.String(1000), nullable=False),
        sa.Column("codegen_version", sa.Integer, nullable=False),
        sa.Column("torch_version", sa.String(40), nullable=False),
        sa.Column("triton_version", sa.String(40), nullable=False),
        sa.Column("vllm_version", sa.String(40)),
        sa.Column("prism_version", sa.String(40), nullable=False),
        sa.Column("modeled_us", sa.Float),
        sa.Column("measured_us", sa.Float),
        sa.Column("baseline", sa.String(100)),
        sa.Column("baseline_us", sa.Float),
        sa.Column("speedup", sa.Float),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("program_id", "device_id", "dtype", "bucket_lo", "bucket_hi", "sgraph_id",
                            "params_json", name="uq_kernel_key"),
    )
    op.create_index("ix_kernel_lookup", "kernels",
                    ["program_id", "device_id", "dtype", "status", "bucket_lo", "bucket_hi"])
    op.create_index("ix_kernel_device", "kernels", ["device_id", "status"])


def downgrade() -> None:
    for table in ("kernels", "sgraphs", "program_sources", "programs", "devices"):
        op.drop_table(table)
