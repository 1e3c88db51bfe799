"""Tenants, their API keys, the adapter registry (who may use which adapter) and the admin audit log."""
