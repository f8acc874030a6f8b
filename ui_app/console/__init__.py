"""The admin console's pages (platform admins only), mounted at the site root."""
