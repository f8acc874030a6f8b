"""The backups' management API: `/api/v1/backups/` (platform admins only)."""
