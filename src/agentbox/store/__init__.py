"""Persistence (SQLAlchemy; SQLite embedded, PostgreSQL later)."""
