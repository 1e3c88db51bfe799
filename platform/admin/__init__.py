"""The admin API (under /admin/api): routes, OpenAPI schemas, admin authentication,
adapter uploads, and the views of tenants, adapters and usage."""
