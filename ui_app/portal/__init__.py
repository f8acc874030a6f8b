"""The tenant portal's pages, mounted at ``/portal/``."""
