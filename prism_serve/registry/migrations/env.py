"""Alembic environment: always driven from `prism_serve.registry.db` with an open connection."""

from alembic import context

from prism_serve.registry.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
