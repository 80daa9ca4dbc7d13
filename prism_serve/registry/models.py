"""The registry's typed ORM model (SQLAlchemy 2).

Everything stored is data: IR and sGraph JSON, instantiation parameters, timings,
fingerprints and versions. Triton source is regenerated from the sGraph and params
at load time; no column holds code to execute.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

STATUSES = ("verified", "enabled", "disabled")
DEVICE_KINDS = ("gpu", "cpu")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Device(Base):
    """A device fingerprint: kinds of GPU (canonical name, compute capability, SMs) or the CPU."""

    __tablename__ = "devices"
    id: Mapped[int] = mapped_column(primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(8))
    name: Mapped[str] = mapped_column(String(100))
    compute_capability: Mapped[str | None] = mapped_column(String(16))
    sm_count: Mapped[int | None] = mapped_column(Integer)
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    spec: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # GpuSpec.to_json of a measured device


class ProgramRecord(Base):
    """A kernel-level Program by canonical hash, with its IR JSON."""

    __tablename__ = "programs"
    id: Mapped[int] = mapped_column(primary_key=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    ir_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    sources: Mapped[list[ProgramSource]] = relationship(back_populates="program", cascade="all, delete-orphan")


class ProgramSource(Base):
    """Where a program came from: a model and the layer path(s) that run it."""

    __tablename__ = "program_sources"
    __table_args__ = (UniqueConstraint("program_id", "model", "layer_path", name="uq_program_source"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    program_id: Mapped[int] = mapped_column(ForeignKey("programs.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(300))
    layer_path: Mapped[str] = mapped_column(String(300))
    program: Mapped[ProgramRecord] = relationship(back_populates="sources")


class SGraphRecord(Base):
    """A verified sGraph (JSON), with its proof and test metadata."""

    __tablename__ = "sgraphs"
    id: Mapped[int] = mapped_column(primary_key=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    program_id: Mapped[int] = mapped_column(ForeignKey("programs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    sgraph_json: Mapped[str] = mapped_column(Text)
    proof: Mapped[dict[str, Any]] = mapped_column(default=dict)
    tests: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WarmupRun(Base):
    """One `prism-serve warmup` run: what model, on what device, how it went."""

    __tablename__ = "warmup_runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(300))
    device_id: Mapped[int | None] = mapped_column(ForeignKey("devices.id", ondelete="SET NULL"))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    status: Mapped[str] = mapped_column(String(16), default="running")
    summary: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Kernel(Base):
    """An instantiated sGraph for one (program, device, dtype, num_tokens bucket), with its timings."""

    __tablename__ = "kernels"
    __table_args__ = (
        UniqueConstraint("program_id", "device_id", "dtype", "bucket_lo", "bucket_hi", "sgraph_id", "params_json",
                         name="uq_kernel_key"),
        Index("ix_kernel_lookup", "program_id", "device_id", "dtype", "status", "bucket_lo", "bucket_hi"),
        Index("ix_kernel_device", "device_id", "status"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    program_id: Mapped[int] = mapped_column(ForeignKey("programs.id", ondelete="CASCADE"))
    sgraph_id: Mapped[int] = mapped_column(ForeignKey("sgraphs.id", ondelete="CASCADE"))
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    dtype: Mapped[str] = mapped_column(String(16))
    bucket_lo: Mapped[int] = mapped_column(Integer)
    bucket_hi: Mapped[int] = mapped_column(Integer)
    params_json: Mapped[str] = mapped_column(String(1000))
    codegen_version: Mapped[int] = mapped_column(Integer)
    torch_version: Mapped[str] = mapped_column(String(40))
    triton_version: Mapped[str] = mapped_column(String(40))
    vllm_version: Mapped[str | None] = mapped_column(String(40))
    prism_version: Mapped[str] = mapped_column(String(40))
    modeled_us: Mapped[float | None] = mapped_column(Float)
    measured_us: Mapped[float | None] = mapped_column(Float)
    baseline: Mapped[str | None] = mapped_column(String(100))
    baseline_us: Mapped[float | None] = mapped_column(Float)
    speedup: Mapped[float | None] = mapped_column(Float)  # measured: baseline_us / measured_us
    baseline_modeled_us: Mapped[float | None] = mapped_column(Float)  # vLLM's path for the region, modeled
    modeled_speedup: Mapped[float | None] = mapped_column(Float)  # baseline_modeled_us / what the plugin runs, modeled
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    warmup_run_id: Mapped[int | None] = mapped_column(ForeignKey("warmup_runs.id", ondelete="SET NULL", name="fk_kernels_warmup_run"))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)

    program: Mapped[ProgramRecord] = relationship()
    sgraph: Mapped[SGraphRecord] = relationship()
    device: Mapped[Device] = relationship()
