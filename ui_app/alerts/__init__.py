"""Alert pages: the console's (platform admins) and each tenant's in the portal."""
